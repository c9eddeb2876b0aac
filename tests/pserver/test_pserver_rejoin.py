"""Availability of a replicated shard under faults, with the fault harness's parts
(tests/support/faults.py: real daemons, a cut link as a proxy that forwards nothing,
SIGSTOP, integer pushes whose sum tells which were applied and how often).

One shard (--replica-timeout-s 1), two workers with dtlab-worker's default deadline
(120 s) pushing all along, and three faults of 3 s in a row:

- the replicas' link cut both ways: at its lease's end the primary, which ran all along
  and still says SERVING, goes on alone (the backup takes over only when a worker asks
  it, and none does), and acknowledgements resume within the replica timeout + 1 s;
  once the link heals the backup learns it was dropped and rejoins;
- SIGSTOP of the primary: the workers give up on it (its health gives no answer) and
  ask the backup, which has heard nothing for the lease, to take over, within the
  replica timeout + 1 s; once it runs again the old primary learns it was replaced and
  rejoins;
- SIGSTOP of the backup: the primary goes on alone at its lease's end, within the
  replica timeout + 1 s, the backup still paused; then the backup, dropped, rejoins by
  itself and says why in one line.

After each fault the shard is two replicas again within seconds with no daemon
restarted by hand; every acknowledged push applied exactly once, nothing unsent
applied, never two primaries.
"""

from __future__ import annotations

import random
import signal
import time

import numpy as np
from support import faults
from support.pserver_util import connect, initial_params
from support.waiting import wait_for

T = faults.REPLICA_TIMEOUT_S
FAULT_S = 3.0


def test_acknowledgements_resume_within_the_lease_and_replicas_rejoin_by_themselves(tmp_path):
    params = initial_params("mlp", faults.MODEL, dtype="float64")
    init = params.data.copy()
    pair = faults.Pair(tmp_path, 0, 1, random.Random(3), fault_s=(FAULT_S, FAULT_S))
    watch = faults.RoleWatch(pair.addresses)
    pushers = None
    try:
        servers = "|".join(pair.addresses)
        pushers = faults.Pushers(servers, 2, params, shm=False, rpc_timeout_s=120.0)
        wait_for("pushes acknowledged", lambda: len(pushers.times) > 20 or
                        bool(pushers.errors))
        for kind in ("cut-both", "pause-primary", "pause-backup"):
            pair.inject(kind)
            time.sleep(0.5)  # acknowledgements after the last fault too
        pushers.stop()
        assert not pushers.errors, pushers.errors
        out = faults.Outcome(acked=len(pushers.acked))
        reader = connect(servers, worker=2, params=params, shm=False)
        try:
            got = np.empty(init.size, np.float64)
            reader.pull(got)
        finally:
            reader.close()
        faults.applied(pushers, got, init, out)
        out.split_brain = watch.stop()
        faults.attribute_gaps(pushers.times, pair.records, pushers.stopped)
        rows = {r.kind: r for r in pair.records}
        print("\n".join(f"{k}: longest gap between acknowledgements {r.gap:.2f} s, "
                        f"unreplicated {r.unreplicated:.2f} s" for k, r in rows.items()),
              f"\n{out.acked} acknowledged, lost {out.lost}, duplicated {out.duplicated}",
              flush=True)
        assert (out.lost, out.duplicated, out.stray, out.split_brain) == (0, 0, 0, 0)
        assert out.acked > 50
        assert rows["cut-both"].gap <= T + 1, rows["cut-both"].gap
        assert rows["pause-primary"].gap <= T + 1, rows["pause-primary"].gap
        assert rows["pause-backup"].gap <= T + 1, rows["pause-backup"].gap
        assert pair.restarted == 0  # every replica rejoined by itself
        for r in pair.records:  # whole again within seconds of the fault's end
            assert r.unreplicated <= FAULT_S + 4, (r.kind, r.unreplicated)
        logs = [s.daemon.output() for s in pair.slots]
        dropped = [line for log in logs for line in log.splitlines()
                   if "dropped as the backup of" in line and "rejoining" in line]
        assert dropped, logs
        for line in dropped:  # one line that says why, not the stream's cancellation
            assert "CANCELLED" not in line and ("lost it" in line or "answers as" in line), \
                line
        assert any("replaced as primary: its backup" in line and "rejoining it as its "
                   "backup" in line for log in logs for line in log.splitlines()), logs
    finally:
        watch.stop()
        if pushers is not None and not pushers.stopped:
            pushers.stop()
        pair.close()


def test_a_dropped_backup_rejoins_where_new_connections_to_its_primary_are_slow(tmp_path):
    """The backup's link opens each new connection 0.4 s late (a proxy, a loaded host:
    longer than a question to the primary waits) and the backup is paused for 1.5 s: the
    primary goes on alone, and the backup learns it on the connection it followed on, so
    the shard is two replicas again within seconds (asked on a new connection each time,
    every question went unanswered: an orphan for good, or a dropped backup that rejoined
    only at its 10 s bound)."""
    pair = faults.Pair(tmp_path, 0, 1, random.Random(0))
    try:
        p, b = pair.heal()
        link = pair.slots[b].link
        opens = link._far

        def slow_open(near):
            time.sleep(0.4)
            return opens(near)

        link._far = slow_open  # the daemon's env names this link: patch it, not replace it
        pair.slots[b].signal(signal.SIGSTOP)
        time.sleep(1.5)
        pair.slots[b].signal(signal.SIGCONT)
        assert pair.heal(timeout=8.0) == (p, b)  # raises TimeoutError past 8 s
        assert faults.status(pair.addresses[p]).term == 2  # it went on alone once
        assert pair.restarted == 0
        assert "rejoining it as its backup" in pair.slots[b].daemon.output()
    finally:
        pair.close()
