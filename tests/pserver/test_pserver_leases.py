"""Worker leases: a worker killed with -9 is dropped after --worker-timeout, and rejoins.

Real daemons and real worker processes on loopback, killed with SIGKILL:
under BSP the round the dead worker held up completes with the workers that
remain, averaged over the two that contributed (integer gradients and lr 1,
so the parameters are checked exactly); under SSP the survivors stop waiting
for its clock and finish; the daemon's log, Stats and Prometheus name the
dropped worker; a worker restarted with the same id rejoins; nothing
acknowledged is lost. Each fault test prints one line: what was injected,
how long recovery took, what was lost.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from support.pserver_util import (
    ONE_BLAS_THREAD,
    ROOT,
    TINY_MLP_FLAGS,
    DaemonProcess,
    connect,
    initial_params,
)
from support.waiting import wait_for
from test_pserver_store import N as TOY_N
from test_pserver_store import g, join, store

from dtlab.models.run.metrics import read_metrics
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.server.leases import Leases

INIT = initial_params()
N = INIT.size
DATA = ["--n-samples", "256", "--label-noise", "0.1"]
SGD_FLAGS = ["--optimizer", "sgd", "--lr", "1", "--warmup", "0", "--schedule", "constant"]
ADAM_FLAGS = ["--optimizer", "adam", "--lr", "3e-3", "--warmup", "0", "--schedule", "constant"]
WORKER = [*TINY_MLP_FLAGS, *DATA, "--batch-size", "8", "--clip", "0.5", "--log-every", "1000"]
TIMEOUT_S = 1.0


def fault_line(capsys, injected: str, recovery_s: float, lost: str) -> None:
    with capsys.disabled():
        print(f"\nFAULT injected: {injected}; recovered in {recovery_s:.2f} s; lost: {lost}")


def stats(address: str) -> pb.StatsReply:
    """The shard's Stats, over a call that registers nothing."""
    with grpc.insecure_channel(address) as ch:
        return pb.StatsReply.FromString(
            ch.unary_unary(f"/{wire.SERVICE}/Stats")(b"", timeout=10))


def start_worker(servers: str, tmp: Path, wid: int, name: str, *flags: str,
                 world: int = 3) -> subprocess.Popen:
    """A real `python -m dtlab.pserver.worker` of `world` sharing the data; stderr to
    NAME.err, metrics to NAME.jsonl."""
    err = open(tmp / f"{name}.err", "w")  # noqa: SIM115 - the child holds it; closed at exit
    return subprocess.Popen(
        [sys.executable, "-m", "dtlab.pserver.worker", "--servers", servers, *WORKER,
         "--worker-id", str(wid), "--num-workers", str(world),
         "--metrics", str(tmp / f"{name}.jsonl"),
         *flags], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=ONE_BLAS_THREAD)


def finish(proc: subprocess.Popen, tmp: Path, name: str, timeout: float = 30.0) -> str:
    """Wait for a worker to exit 0; its stderr."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    err = (tmp / f"{name}.err").read_text()
    assert rc == 0, f"{name} exited with {rc}:\n{err}"
    return err


def kill9(proc: subprocess.Popen) -> float:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return time.monotonic()


def end_all(procs: dict) -> None:
    """Kill whatever worker is still running (a failed test's), resuming a stopped one."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(timeout=30)


def acked_steps(path: Path) -> int:
    """Steps a worker recorded (each written after the servers acknowledged its push)."""
    return len(read_metrics(str(path))[1]) if path.exists() else 0


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def daemon_args(*extra: str) -> list[str]:
    return [*TINY_MLP_FLAGS, *DATA, "--grace-s", "5", "--worker-timeout", str(TIMEOUT_S),
            "--metrics-port", "0", "--allow-takeover", *extra]  # killed workers restart


def test_bsp_round_completes_without_a_killed_worker_averaging_over_contributors(
        tmp_path, capsys):
    """Workers 0 and 1 are clients here pushing integer gradients; worker 2 is a real
    process that sleeps before its second step (--straggler), killed with -9 there, so
    round 1 holds the two gradients here only: it must apply their mean, not a third."""
    with DaemonProcess(tmp_path, daemon_args(*SGD_FLAGS, "--consistency", "bsp",
                                             "--num-workers", "3")) as d:
        c0, c1 = connect(d.address, 0), connect(d.address, 1)
        victim = start_worker(d.address, tmp_path, 2, "w2", "--steps", "1000",
                              "--straggler", "2:1e6")
        try:
            params = np.empty(N, np.float32)
            c0.pull(params)  # waits for worker 2's Register: --num-workers 3
            np.testing.assert_array_equal(params, INIT.data)
            c1.pull(np.empty(N, np.float32))
            for c, value in ((c0, 1.0), (c1, 3.0)):
                c.push(np.full(N, value, np.float32), 0)  # the last of three applies round 0
            c0.pull(params)  # round 0 applied once worker 2 pushed its step 0 too
            c1.pull(np.empty(N, np.float32))
            assert stats(d.address).workers[2].clock == 1
            before = params.copy()
            for c, value in ((c0, 2.0), (c1, 4.0)):  # round 1: worker 2 is asleep
                assert c.push(np.full(N, value, np.float32), 1)[0].pending
            killed = kill9(victim)
            c0.pull(params)  # held until the round goes on without worker 2
            recovery = time.monotonic() - killed
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait(timeout=30)
        # the mean of the two contributions, (2 + 4) / 2; dividing by 3 would give 2
        np.testing.assert_array_equal(params, before - np.float32(3.0))
        # the lease runs from the end of its session (at the kill, about when wait returned)
        assert 0.9 * TIMEOUT_S < recovery < 1.25 * TIMEOUT_S + 2.0, recovery
        st = stats(d.address)
        assert st.workers_dropped == 1 and st.workers[2].expired and not st.workers[2].active
        assert (st.version, st.pushes) == (2, 5)  # worker 2's acknowledged step 0 is in round 0
        assert "worker 2 dropped" in d.output() and "2 gradients averaged" in d.output()
        text = scrape(d.metrics_port)
        assert 'dtlab_ps_workers_dropped_total{shard="0"} 1.0' in text
        assert 'dtlab_ps_worker_expired{shard="0",worker="2"} 1.0' in text
        acked = acked_steps(tmp_path / "w2.jsonl")
        assert acked <= st.workers[2].next_step == 1  # every step it recorded was accepted

        # restarted with the same id: it rejoins at the others' clock, its next step, and a
        # round needs it again
        again = start_worker(d.address, tmp_path, 2, "w2b", "--steps", "3")
        try:
            wait_for("worker 2 registered again", lambda: stats(d.address).workers[2].active)
            for step in (2, 3):
                for c, value in ((c0, 1.0), (c1, 1.0)):
                    c.push(np.full(N, value, np.float32), step)
                for c in (c0, c1):
                    c.pull(params)  # round 2 waits for the rejoined worker's step 1
            err = finish(again, tmp_path, "w2b")
        finally:
            c0.close()
            c1.close()
        st = stats(d.address)
        assert "rejoins at step 1" in err
        # at the others' clock 2 (rounds 0 and 1), not its own 1
        assert "worker 2 rejoins after its lease expired: it registers again; clock 2 " \
            in d.output()
        assert not st.workers[2].expired and st.workers[2].next_step == 3
        assert (st.version, st.pushes) == (4, 5 + 3 + 3)  # rounds 2 and 3 of three each
    fault_line(capsys, "kill -9 of BSP worker 2 while round 1 waited for it",
               recovery, f"nothing acknowledged: its {acked} recorded step(s) were applied; "
                         "round 1 averaged the 2 that contributed")


def test_ssp_survivors_finish_after_a_killed_worker_is_dropped_and_it_rejoins(tmp_path, capsys):
    """Three real workers under SSP(1); worker 2 is killed -9 mid-run. The survivors, held
    by its clock, go on once it is dropped and finish; restarted, it rejoins."""
    K = 60
    with DaemonProcess(tmp_path, daemon_args(*ADAM_FLAGS, "--consistency", "ssp",
                                             "--staleness", "1", "--num-workers", "3")) as d:
        procs = {w: start_worker(d.address, tmp_path, w, f"w{w}", "--steps",
                                 str(K if w < 2 else 100_000), "--delay-ms", "20")
                 for w in range(3)}
        try:
            wait_for("worker 2 pushed 5 gradients",
                     lambda: stats(d.address).workers[2].clock >= 5)
            killed = kill9(procs[2])

            def lead(st: pb.StatsReply) -> int:
                return max(st.workers[w].clock for w in (0, 1)) - st.workers[2].clock

            def held() -> pb.StatsReply | None:  # read at lead 1, pushed once more: wait
                st = stats(d.address)
                return st if lead(st) >= 2 or st.workers_dropped else None

            st = wait_for("the survivors held by worker 2's clock, or worker 2 dropped", held)
            if not st.workers_dropped:
                assert lead(st) == 2  # no further while its lease holds
            if time.monotonic() - killed < TIMEOUT_S:
                assert not st.workers_dropped  # dropped only once its lease expired
            wait_for("worker 2 dropped", lambda: stats(d.address).workers_dropped)
            recovery = time.monotonic() - killed
            dead_next = stats(d.address).workers[2].next_step
            procs[2] = start_worker(d.address, tmp_path, 2, "w2b", "--steps",
                                    str(dead_next + 5))
            errs = [finish(procs[w], tmp_path, name) for w, name in
                    ((0, "w0"), (1, "w1"), (2, "w2b"))]
        finally:
            end_all(procs)
        st = stats(d.address)
        log = d.output()
    assert "worker 2 dropped" in log and "worker 2 rejoins after its lease expired" in log
    assert f"rejoins at step {dead_next}" in errs[2]
    assert [st.workers[w].next_step for w in range(3)] == [K, K, dead_next + 5]
    assert not st.workers[2].expired and st.workers_dropped == 1
    assert st.max_clock_lead <= 1  # the bound held throughout
    # nothing acknowledged lost: every step a worker recorded was accepted, and every
    # accepted gradient applied (SSP applies each push)
    acked = acked_steps(tmp_path / "w2.jsonl")
    assert acked <= dead_next
    assert st.pushes == st.updates == 2 * K + dead_next + 5 and st.duplicates == 0
    assert [acked_steps(tmp_path / f"w{w}.jsonl") for w in (0, 1)] == [K, K]
    fault_line(capsys, f"kill -9 of SSP(1) worker 2 at clock {dead_next}, survivors held "
                       "by its clock", recovery,
               f"nothing acknowledged: its {acked} recorded steps all applied, "
               f"{st.pushes} pushes = {st.updates} updates")


def test_a_stopped_worker_is_dropped_through_keepalive_and_back_by_its_next_call(
        tmp_path, capsys):
    """SIGSTOP: the worker's session stays open but no longer answers the server's
    keepalive pings, so the connection closes and its lease runs down; SIGCONT: its next
    call (the session reopened) brings it back without a new Register."""
    with DaemonProcess(tmp_path, daemon_args(*ADAM_FLAGS, "--consistency", "ssp",
                                             "--staleness", "1", "--num-workers", "2")) as d:
        procs = {w: start_worker(d.address, tmp_path, w, f"w{w}", "--steps", "200",
                                 "--delay-ms", "5", "--transport", "session",
                                 "--retries", "20", world=2)
                 for w in range(2)}
        try:
            wait_for("worker 1 pushed 5 gradients",
                     lambda: stats(d.address).workers[1].clock >= 5)
            procs[1].send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            wait_for("worker 1 dropped", lambda: stats(d.address).workers_dropped)
            recovery = time.monotonic() - stopped
            procs[1].send_signal(signal.SIGCONT)
            errs = [finish(procs[w], tmp_path, f"w{w}") for w in range(2)]
        finally:
            end_all(procs)
        st = stats(d.address)
        log = d.output()
    assert "worker 1 dropped" in log
    assert "worker 1 rejoins after its lease expired: it calls again" in log
    assert [st.workers[w].next_step for w in range(2)] == [200, 200] and st.duplicates == 0
    assert st.pushes == st.updates == 400 and not st.workers[1].expired
    assert "Traceback" not in errs[1]
    fault_line(capsys, "SIGSTOP of SSP(1) worker 1 (session open, pings unanswered)",
               recovery, "nothing: after SIGCONT it rejoined by its next call and ran all "
                         "200 steps, 400 pushes = 400 updates")


# -- the lease rules, on a store without the network and a clock the test moves ----------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_holds_while_a_call_is_open_and_runs_out_after_the_timeout():
    clock = Clock()
    leases = Leases(2.0, clock)
    leases.renew(0)
    leases.enter(1)  # worker 1 has a session open
    clock.now = 5.0
    assert leases.overdue([0, 1]) == [(0, 5.0)]
    leases.leave(1)
    clock.now = 6.9
    assert leases.overdue([1]) == []
    clock.now = 7.1
    assert [w for w, _ in leases.overdue([1, 7])] == [1]  # 7: first seen now
    clock.now = 9.2
    assert [w for w, _ in leases.overdue([7])] == [7]
    assert Leases(0.0, clock).overdue([0]) == []  # no --worker-timeout: never


@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_a_dropped_worker_is_not_waited_for_and_comes_back_at_the_slowest_clock(mode):
    s = store(mode, staleness=1 if mode == "ssp" else 0, expected=3)
    clock = Clock()
    s.leases = Leases(1.0, clock)
    join(s, 0, 1, 2)
    for step in range(2 if mode == "ssp" else 1):  # workers 0 and 1 run ahead of worker 2
        for w in (0, 1):
            s.push(w, step, s.version, g(2.0 * (w + 1)))
    if mode == "bsp":
        assert s.version == 0  # round 0 waits for worker 2
    clock.now = 0.5
    s.register(2, "toy", TOY_N, 0)  # a sign of life
    clock.now = 1.2
    assert s.expire_leases() == [0, 1]  # 0 and 1 last called at 0; 2 at 0.5
    s.register(0, "toy", TOY_N, 0)
    s.register(1, "toy", TOY_N, 0)
    clock.now = 1.6
    assert s.expire_leases() == [2]
    st = s.stats()
    assert st.workers_dropped == 3 and st.workers[2].expired and not st.workers[2].active
    if mode == "bsp":  # the round of 0 and 1 applied without 2: the mean of 2 and 4
        np.testing.assert_array_equal(s.params, g(-3.0))
        assert s.version == 1
    else:  # both pushes of each applied: 2 + 2 + 4 + 4
        np.testing.assert_array_equal(s.params, g(-12.0))
        assert s.clocks.may_read(s.policy, 0)  # worker 2's clock 0 holds nobody back
    with s.holding(2, 0):  # its next call: active again, at the slowest clock (1 or 2)
        assert s.clocks.workers[2].active
        assert s.clocks.workers[2].clock == min(s.clocks.workers[w].clock for w in (0, 1))
    assert not s.stats().workers[2].expired
