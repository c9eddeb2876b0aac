"""Backup workers on parameter-server BSP (Chen et al. 2016): N + b workers, each round
closes at the first N gradients, late ones are dropped, counted and answered.

Integer-valued gradients, SGD lr 1 and float64 make every expected value exact. b = 0 is
BSP as before: tests/pserver/test_pserver_store.py and test_pserver_training.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.pserver_util import (
    TINY_MLP_FLAGS,
    addresses,
    connect,
    initial_params,
    run_workers,
    serve,
)

from dtlab.models.config import ConfigError, build
from dtlab.models.optim import OptimConfig, Schedule, make_optimizer
from dtlab.models.run.metrics import read_metrics
from dtlab.pserver.common.config import ServerConfig
from dtlab.pserver.common.errors import DeadlineExceeded
from dtlab.pserver.server.consistency import Consistency
from dtlab.pserver.server.leases import Leases
from dtlab.pserver.server.store import ShardLayout, ShardStore

N = 6


def store(expected: int = 3, backups: int = 1) -> ShardStore:
    ocfg = build(OptimConfig, {"optimizer": "sgd", "lr": 1.0, "warmup": 0,
                               "schedule": "constant"})
    params = np.zeros(N, np.float64)
    s = ShardStore(ShardLayout("toy", N, 0, 1), params, make_optimizer(ocfg, params),
                   Schedule(ocfg, 0), Consistency("bsp", backups=backups),
                   expected_workers=expected, log_every=0)
    for w in range(expected):
        s.register(w, "toy", N, 0)
    return s


def g(value: float) -> np.ndarray:
    return np.full(N, value, np.float64)


def test_the_round_closes_at_n_and_a_late_gradient_is_dropped_and_answered():
    s = store()  # N + b = 2 + 1
    assert s.push(0, 0, 0, g(1)).pending
    r1 = s.push(1, 0, 0, g(4))  # the second of N = 2: the round closes
    assert not r1.pending and s.version == 1
    np.testing.assert_array_equal(s.params, g(-2.5))  # the mean of the 2 that arrived
    late = s.push(2, 0, 0, g(100))  # read at version 0: its round closed
    assert (late.duplicate, late.pending, late.staleness, late.version, late.lr) == \
           (False, False, 1, 1, 0.0)
    np.testing.assert_array_equal(s.params, g(-2.5))  # dropped, not in the next round
    assert s.push(2, 0, 0, g(100)) == dataclasses.replace(late, duplicate=True)  # a retry
    assert s.read(2, 0, timeout=0.0).version == 1  # it goes on: nothing of it waits
    # round 2: worker 2 on time this once, worker 1 held back
    assert s.push(2, 1, 1, g(5)).pending
    with pytest.raises(DeadlineExceeded, match="waits for the BSP round"):
        s.read(2, 1, timeout=0.05)  # its gradient is in the open round
    s.push(0, 1, 1, g(7))
    np.testing.assert_array_equal(s.params, g(-8.5))  # -2.5 - mean(5, 7)
    assert s.push(1, 1, 1, g(1000)).staleness == 1  # late too
    np.testing.assert_array_equal(s.params, g(-8.5))
    st = s.stats()
    assert (st.version, st.updates, st.pushes, st.late) == (2, 2, 4, 2)
    assert {w: (ws.clock, ws.late, ws.next_step) for w, ws in st.workers.items()} == \
           {0: (2, 0, 2), 1: (1, 1, 2), 2: (1, 1, 2)}
    assert st.staleness.total == 4 and st.staleness.max == 0  # only on-time gradients
    state = s.state()
    assert state["workers"][1]["late"] == 1 and "late" not in state["workers"][0]
    again = store()
    again.load_state(state)
    assert {w: ws.late for w, ws in again.stats().workers.items()} == {0: 0, 1: 1, 2: 1}


def test_with_fewer_workers_active_than_n_the_round_closes_with_all_of_them():
    s = store(expected=4, backups=1)  # N = 3
    s.deregister(3)
    s.deregister(2)
    s.push(0, 0, 0, g(2))
    assert s.version == 0
    s.push(1, 0, 0, g(4))  # both active workers: closes below N
    assert s.version == 1
    np.testing.assert_array_equal(s.params, g(-3))


def test_leases_drop_workers_below_n_and_a_returning_one_is_late_not_next():
    """N = 3 of 3 + 1: with two workers dropped by their leases the round closes with the
    two left; a dropped one back with its old gradient is late, never in the next round."""
    s = store(expected=4, backups=1)
    now = [0.0]
    s.leases = Leases(1.0, lambda: now[0])
    for w in range(4):
        s.register(w, "toy", N, 0)
    s.push(0, 0, 0, g(2))
    s.push(1, 0, 0, g(4))
    now[0] = 0.5
    s.register(0, "toy", N, 0)  # signs of life of 0 and 1
    s.register(1, "toy", N, 0)
    now[0] = 1.2
    assert s.expire_leases() == [2, 3] and s.version == 1  # closed with the two left
    np.testing.assert_array_equal(s.params, g(-3))
    with s.holding(3, 0):  # back: its call (as the servicer holds it) is a sign of life
        r = s.push(3, 0, 0, g(1000))  # read before round 1
    assert r.staleness == 1 and s.clocks.workers[3].active and s.stats().workers[3].late == 1
    s.push(0, 1, 1, g(1))
    s.push(1, 1, 1, g(3))
    assert s.version == 1  # 3 active again: the round waits for N = 3
    s.push(3, 1, 1, g(5))
    np.testing.assert_array_equal(s.params, g(-6))  # -3 - mean(1, 3, 5)


def test_backup_flags_are_checked():
    for values, message in [({"backup_workers": 1}, "bsp only"),
                            ({"backup_workers": 1, "consistency": "bsp", "num_workers": 1},
                             "--num-workers N \\+ 1"),
                            ({"backup_workers": -1}, "--backup-workers")]:
        with pytest.raises(ConfigError, match=message):
            build(ServerConfig, values)
    with pytest.raises(ValueError, match="backup workers need BSP"):
        store(expected=1, backups=1)


def test_late_pushes_over_the_wire_hold_no_one_back():
    """Three real clients of one float64 shard, in a fixed order: workers 0 and 1 close
    each round; worker 2's pushes come after it and are dropped; its pulls never wait."""
    params = initial_params(dtype="float64")
    start = params.data.copy()
    with serve(shards=1, dtype="float64", consistency="bsp", num_workers=3,
               backup_workers=1) as daemons:
        clients = [connect(addresses(daemons), w, params) for w in range(3)]
        try:
            flat = [np.empty(params.size, np.float64) for _ in range(3)]
            for c, f in zip(clients, flat, strict=True):
                c.pull(f)
            want = start.copy()
            for step in range(3):
                grads = [np.arange(params.size, dtype=np.float64) % 7 + 10 * w + step
                         for w in range(3)]
                r0 = clients[0].push(grads[0], step)
                r1 = clients[1].push(grads[1], step)
                r2 = clients[2].push(grads[2], step)
                assert r0[0].pending and not r1[0].pending and r2[0].staleness == 1
                want -= (grads[0] + grads[1]) / 2
                for c, f in zip(clients, flat, strict=True):
                    c.pull(f)  # worker 2 included: it reads the new version at once
                np.testing.assert_array_equal(flat[2], want)
            st = daemons[0].store.stats()
        finally:
            for c in clients:
                c.close()
    assert st.version == 3 and st.late == 3
    assert [st.workers[w].late for w in range(3)] == [0, 0, 3]


def test_real_workers_with_a_straggler_and_delays(tmp_path):
    """3 worker processes, N = 2 + 1 backup, worker 2 slowed 100x and everyone delayed:
    the run ends; each worker's late gradients are the ones the server dropped, and with
    the accepted ones they are every step it pushed."""
    steps = 12
    with serve(shards=2, consistency="bsp", num_workers=3, backup_workers=1) as daemons:
        paths = run_workers(addresses(daemons), 3,
                            [*TINY_MLP_FLAGS, "--steps", str(steps), "--batch-size", "4",
                             "--clip", "0", "--straggler", "2:100", "--delay-ms", "2"],
                            tmp_path)
        stats = [d.store.stats() for d in daemons]
    for w, path in enumerate(paths):
        _, records = read_metrics(str(path))
        assert len(records) == steps
        for k, st in enumerate(stats):
            late = sum(r["staleness"][k] > 0 for r in records)
            assert st.workers[w].late == late
            assert st.workers[w].clock + late == steps
        assert sum(r["late"] for r in records) == sum(st.workers[w].late for st in stats)
    assert sum(st.workers[2].late for st in stats) > 0  # the straggler came late
    for st in stats:
        assert st.staleness.max == 0 and st.staleness.total == st.pushes
        assert st.pushes + st.late == 3 * steps
