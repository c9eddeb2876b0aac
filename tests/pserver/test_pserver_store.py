"""The shard store and consistency policies, without the network: staleness, dedup, BSP, SSP."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dtlab.models.config import ConfigError, build
from dtlab.models.optim import OptimConfig, Schedule, make_optimizer
from dtlab.models.run.launcher_env import RANK_VARS, SIZE_VARS
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import buffers
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from dtlab.pserver.server import checkpoint
from dtlab.pserver.server.cache_blocked import BlockedOptimizer
from dtlab.pserver.server.consistency import Consistency
from dtlab.pserver.server.store import ShardLayout, ShardStore
from dtlab.pserver.worker.loop import WorkerConfig

N = 10


def store(mode: str = "asp", staleness: int = 0, expected: int = 0, lr_rule: str = "none",
          **optim) -> ShardStore:
    ocfg = build(OptimConfig, {"optimizer": "sgd", "lr": 1.0, "warmup": 0,
                               "schedule": "constant", **optim})
    params = np.zeros(N, np.float32)
    return ShardStore(ShardLayout("toy", N, 0, 1), params, make_optimizer(ocfg, params),
                      Schedule(ocfg, 0), Consistency(mode, staleness), staleness_lr=lr_rule,
                      expected_workers=expected, log_every=0)


def join(s: ShardStore, *workers: int) -> None:
    for w in workers:
        s.register(w, "toy", N, 0)


def g(value: float) -> np.ndarray:
    return np.full(N, value, np.float32)


def chunked(values: np.ndarray, chunk_bytes: int) -> buffers.ChunkedArray:
    """`values` as the server receives a push of it: views into the chunk messages."""
    msgs = list(wire.stream(pb.PushHeader(), values, chunk_bytes))
    out = buffers.ChunkedArray(values.size, values.dtype)
    for raw in msgs[1:-1]:
        out.add(*wire.parse_chunk(wire.split(raw)[1]))
    out.finish(wire.parse(pb.Trailer, wire.split(msgs[-1])[1]))
    return out


def test_layout_is_contiguous_and_balanced():
    n, S = 10007, 3
    parts = [ShardLayout("m", n, i, S) for i in range(S)]
    assert parts[0].offset == 0
    assert all(a.offset + a.length == b.offset for a, b in zip(parts, parts[1:], strict=False))
    assert parts[-1].offset + parts[-1].length == n
    assert max(p.length for p in parts) - min(p.length for p in parts) <= 1


def test_staleness_is_version_at_apply_minus_version_read():
    s = store()
    join(s, 0, 1)
    assert s.push(0, 0, 0, g(1)).staleness == 0  # version 0 -> 1
    assert s.push(1, 0, 0, g(1)).staleness == 1  # read 0, applied at 1
    assert s.push(0, 1, 1, g(1)).staleness == 1
    r = s.push(1, 1, 3, g(1))
    assert (r.staleness, r.version) == (0, 4)
    np.testing.assert_array_equal(s.params, g(-4))
    st = s.stats()
    assert dict(st.staleness.counts) == {0: 2, 1: 2} and st.staleness.total == 4
    assert dict(st.workers[1].staleness.counts) == {1: 1, 0: 1}


def test_divide_lr_by_staleness():
    s = store(lr_rule="divide")
    join(s, 0, 1)
    s.push(0, 0, 0, g(1))
    s.push(0, 1, 1, g(1))
    r = s.push(1, 0, 0, g(4))  # staleness 2: lr 1/2
    assert (r.staleness, r.lr) == (2, 0.5)
    np.testing.assert_array_equal(s.params, g(-4))


def test_push_is_idempotent_by_worker_and_step():
    s = store()
    join(s, 0)
    first = s.push(0, 5, 0, g(1))
    again = s.push(0, 5, 0, g(1))
    assert again.duplicate and (again.staleness, again.version) == (first.staleness, 1)
    assert s.push(0, 4, 0, g(1)).duplicate  # older steps too
    assert s.admit(0, 5, 1) is not None and s.admit(0, 6, 1) is None
    np.testing.assert_array_equal(s.params, g(-1))
    assert s.stats().duplicates == 3


def test_bad_pushes_change_nothing():
    s = store()
    join(s, 0)
    with pytest.raises(FailedPrecondition, match="not registered"):
        s.push(7, 0, 0, g(1))
    with pytest.raises(InvalidArgument, match="future"):
        s.push(0, 0, 1, g(1))
    with pytest.raises(FailedPrecondition, match="layout"):
        s.register(1, "toy", N + 1, 0)
    assert s.version == 0 and not s.params.any() and s.stats().pushes == 0


def test_bsp_averages_one_gradient_per_worker_then_applies_once():
    s = store("bsp", expected=2)
    join(s, 0, 1)
    r0 = s.push(0, 0, 0, g(1))
    assert r0.pending and s.version == 0 and not s.params.any()
    with pytest.raises(FailedPrecondition, match="already pushed"):
        s.push(0, 1, 0, g(1))
    r1 = s.push(1, 0, 0, chunked(g(3), 12))  # as received: three chunks of views
    assert not r1.pending and s.version == 1
    np.testing.assert_array_equal(s.params, g(-2))  # mean of 1 and 3
    assert s.stats().staleness.total == 2


def test_bsp_round_completes_when_a_worker_leaves():
    s = store("bsp")
    join(s, 0, 1)
    s.push(0, 0, 0, g(2))
    s.deregister(1)
    assert s.version == 1
    np.testing.assert_array_equal(s.params, g(-2))


def test_state_keeps_an_unfinished_bsp_round_and_the_staleness_histograms(tmp_path):
    """A shard restored from state() mid-round finishes the round as if never stopped."""
    def first_half(s: ShardStore) -> None:
        join(s, 0, 1)
        s.push(0, 0, 0, g(1))
        s.push(1, 0, 0, g(3))  # round 1 applied: version 1
        s.push(0, 1, 1, g(5))  # round 2: worker 0 is in, worker 1 not yet

    straight = store("bsp")
    first_half(straight)
    straight.push(1, 1, 1, g(7))

    before = store("bsp")
    first_half(before)
    state = before.state()
    assert state["workers"][0] == {"clock": 2, "next_step": 2, "active": True}
    assert state["round"]["contributors"] == {0: (1, 1)}
    layout = before.layout
    path = checkpoint.save(str(tmp_path), layout, state, {"optim": {"optimizer": "sgd"}})
    restored = store("bsp")
    restored.load_state(checkpoint.load(path, layout, "sgd"))
    with pytest.raises(FailedPrecondition, match="already pushed"):
        restored.push(0, 2, 1, g(5))
    assert restored.push(0, 1, 1, g(5)).duplicate  # a retry of the saved push
    r = restored.push(1, 1, 1, g(7))
    assert (r.pending, r.version) == (False, 2)
    np.testing.assert_array_equal(restored.params, straight.params)  # -2, then -6
    assert restored.stats().staleness == straight.stats().staleness
    assert restored.stats().workers[1].staleness.total == 2

    with pytest.raises(ValueError, match="--consistency bsp"):
        store("asp").load_state(state)
    bad = dict(state, staleness={"shard": {"0": 2}, "workers": {"0": {"0": 1}}})
    with pytest.raises(ValueError, match="add up"):
        store("bsp").load_state(bad)


def test_ssp_pull_waits_while_a_worker_is_too_far_ahead():
    s = store("ssp", staleness=1, expected=2)
    join(s, 0)
    with pytest.raises(DeadlineExceeded, match="1 of --num-workers 2"):
        s.read(0, None, timeout=0.05)
    join(s, 1)
    s.push(0, 0, 0, g(1))
    assert s.read(0, None, timeout=0.05).version == 1  # lead 1 <= 1
    s.push(0, 1, 1, g(1))
    with pytest.raises(DeadlineExceeded, match="2 clocks ahead"):
        s.read(0, None, timeout=0.05)
    done = threading.Event()

    def reader():
        s.read(0, None, timeout=20)
        done.set()

    t = threading.Thread(target=reader)
    t.start()
    assert not done.wait(0.2)
    s.push(1, 0, 0, g(1))  # the slow worker ticks: lead back to 1
    assert done.wait(20)
    t.join()
    assert s.stats().max_clock_lead == 1


def test_read_not_modified_and_close():
    s = store()
    join(s, 0)
    assert s.read(0, None, 1).tensor is not None
    assert s.read(0, 0, 1).tensor is None
    with pytest.raises(InvalidArgument, match="future"):
        s.read(0, 5, 1)
    s.close()
    with pytest.raises(Unavailable):
        s.read(0, None, 1)


def test_exact_sum_under_concurrent_pushes():
    """W threads x K integer gradients with SGD lr 1: the exact sum, W*K staleness records."""
    s = store()
    W, K = 4, 50
    join(s, *range(W))

    def work(w):
        for k in range(K):
            s.push(w, k, s.version, g(w + 1))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(s.params, g(-K * sum(range(1, W + 1))))
    st = s.stats()
    assert st.staleness.total == W * K == sum(st.staleness.counts.values())
    assert all(st.workers[w].staleness.total == K for w in range(W))


@pytest.mark.parametrize("optim", [
    {"optimizer": "sgd"},
    {"optimizer": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    {"optimizer": "adam", "weight_decay": 0.1},
    {"optimizer": "adamw", "weight_decay": 0.1},
])
def test_blocked_optimizer_is_bit_identical_to_one_instance(optim):
    cfg = build(OptimConfig, optim)
    rng = np.random.default_rng(0)
    n = 1000  # not a multiple of the block
    mask = (rng.random(n) < 0.7).astype(np.float32)
    whole = rng.standard_normal(n).astype(np.float32)
    blocked, from_chunks = whole.copy(), whole.copy()
    one = make_optimizer(cfg, whole, decay_mask=mask)
    parts = BlockedOptimizer(cfg, blocked, mask, block=128, threads=3)
    parts_chunked = BlockedOptimizer(cfg, from_chunks, mask, block=128, threads=2)
    for t in range(5):
        g = rng.standard_normal(n).astype(np.float32)
        one.step(whole, g, 1e-2 * (t + 1))
        parts.step(blocked, g, 1e-2 * (t + 1))
        parts_chunked.step(from_chunks, chunked(g, 400), 1e-2 * (t + 1))  # chunks copied
    np.testing.assert_array_equal(blocked, whole)
    np.testing.assert_array_equal(from_chunks, whole)
    state, want = parts.state_dict(), one.state_dict()
    assert state.keys() == want.keys() and state["steps"] == want["steps"] == 5
    for k in state:
        np.testing.assert_array_equal(state[k], want[k])
    fresh = BlockedOptimizer(cfg, blocked, mask, block=300)
    fresh.load_state_dict(state)
    assert fresh.steps == 5
    if len(state) > 1:
        with pytest.raises(ValueError, match="shape"):
            fresh.load_state_dict({k: v if k == "steps" else v[:-1] for k, v in state.items()})


def test_blocked_optimizer_reads_a_pushed_gradient_in_place_and_across_chunks():
    cfg = build(OptimConfig, {"optimizer": "adam"})
    rng = np.random.default_rng(1)
    n = 3 * wire.KEEP_BYTES // 4 + 11  # three chunks used in place, a short one copied
    whole = rng.standard_normal(n).astype(np.float32)
    blocked = whole.copy()
    one, parts = make_optimizer(cfg, whole), BlockedOptimizer(cfg, blocked, block=5000,
                                                             threads=2)
    for _ in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        one.step(whole, g, 1e-3)
        parts.step(blocked, chunked(g, wire.KEEP_BYTES), 1e-3)  # blocks straddle chunks
    np.testing.assert_array_equal(blocked, whole)


def test_worker_id_and_count_come_from_the_launcher_else_the_servers(monkeypatch):
    for var in RANK_VARS + SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    alone = WorkerConfig()
    assert alone.given_id() is None  # the servers assign one
    assert alone.data_shard(0, 0) == (0, 1)  # nobody says how many: the whole data
    assert alone.data_shard(3, 2) == (1, 2)  # the servers' --num-workers; ids wrap around
    with pytest.raises(ConfigError, match="assigned this worker id 1, but nothing tells"):
        alone.data_shard(1, 0)
    with pytest.raises(ConfigError, match="--worker-id 1 nothing tells"):
        WorkerConfig(worker_id=1).data_shard(1, 0)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    launched = WorkerConfig()
    assert launched.given_id() == 2 and launched.data_shard(2, 7) == (2, 3)
    assert WorkerConfig(worker_id=0, num_workers=5).data_shard(0, 2) == (0, 5)
    with pytest.raises(ConfigError, match="--worker-id 2 must be in"):
        WorkerConfig(num_workers=2).data_shard(2, 0)


def test_a_snapshot_is_copied_only_when_an_update_overtakes_its_readers():
    s = store()
    join(s, 0)
    a = s.read(0, None, 1)  # a stream of version 0 still running
    assert a.tensor.values is s.params  # nothing copied yet
    s.push(0, 0, 0, g(1))  # the update first gives version 0's reader a copy
    b = s.read(0, None, 1)
    assert (a.version, b.version) == (0, 1) and a.tensor.values is not s.params
    np.testing.assert_array_equal(a.tensor.values, g(0))
    np.testing.assert_array_equal(b.tensor.values, g(-1))
    copy = a.tensor.values
    s.release(a)  # nobody reads version 0 now: its array becomes spare
    s.release(b)
    s.push(0, 1, 1, g(1))  # nobody reads version 1: nothing is copied
    c = s.read(0, None, 1)
    assert c.tensor.values is s.params and c.version == 2
    assert s.read(0, 2, 1).tensor is None  # not modified
    d = s.read(0, None, 1)
    assert d.tensor is c.tensor and c.tensor.readers == 2  # shared by readers of one version
    s.push(0, 2, 2, g(1))
    assert c.tensor.values is copy  # frozen into the spare array, not a new one
    np.testing.assert_array_equal(c.tensor.values, g(-2))


@pytest.mark.parametrize("overtaken_after", [0, 1, 3])
def test_a_pull_overtaken_by_an_update_streams_its_own_version_whole(overtaken_after):
    """Chunks streamed before and after an update that lands mid-pull are all of the
    version the pull began with, and the trailer's checksum agrees."""
    s = store()
    join(s, 0)
    s.push(0, 0, 0, np.arange(N, dtype=np.float32))
    s.chunk_bytes = 8  # two elements per chunk: five chunks
    read = s.read(0, None, 1)
    want = s.params.copy()
    msgs = read.tensor.stream(pb.PullHeader())
    got = [next(msgs) for _ in range(1 + overtaken_after)]
    s.push(0, 1, 1, g(100))
    got += list(msgs)
    s.release(read)
    out = buffers.ChunkedArray(N, np.float32)
    for raw in got[1:-1]:
        out.add(*wire.parse_chunk(wire.split(raw)[1]))
    out.finish(wire.parse(pb.Trailer, wire.split(got[-1])[1]))
    np.testing.assert_array_equal(out[0:N], want)
    np.testing.assert_array_equal(s.params, want - 100)


def blocked_store(mode: str = "asp", expected: int = 0) -> ShardStore:
    """A store whose optimizer runs in blocks of 4 elements on 2 threads, as the daemon's."""
    ocfg = build(OptimConfig, {"optimizer": "sgd", "lr": 1.0, "warmup": 0,
                               "schedule": "constant", "momentum": 0.9})
    params = np.arange(N, dtype=np.float32)
    return ShardStore(ShardLayout("toy", N, 0, 1), params,
                      BlockedOptimizer(ocfg, params, block=4, threads=2), Schedule(ocfg, 0),
                      Consistency(mode), expected_workers=expected, log_every=0)


def test_an_update_copies_its_values_out_as_it_makes_them():
    """push(copy_to=the segment holding the gradient): the new parameters land there with
    their Adler-32, exactly as a pull's copy would give them; a duplicate's reply, a BSP
    push still waiting for its round and a ranged push copy nothing."""
    import zlib
    s, twin = blocked_store(), blocked_store()
    join(s, 0)
    join(twin, 0)
    for step in range(3):
        segment = np.linspace(-1, 1, N, dtype=np.float32) * (step + 1)  # the gradient, in place
        twin.push(0, step, step, segment.copy())
        result = s.push(0, step, step, segment, copy_to=segment)
        np.testing.assert_array_equal(s.params, twin.params)  # the same update, bit for bit
        np.testing.assert_array_equal(segment, s.params)
        assert result.copied == zlib.adler32(s.params.tobytes()) and result.version == step + 1
    assert s.push(0, 2, 2, g(1.0), copy_to=g(0.0)).copied is None  # a duplicate
    assert s.push(0, 3, 3, g(1.0)[:2], ranges=[(0, 2)], copy_to=g(0.0)).copied is None

    bsp = blocked_store("bsp", expected=2)
    join(bsp, 0, 1)
    assert bsp.push(0, 0, 0, g(1.0), copy_to=g(0.0)).copied is None  # pending
    out = g(0.0)
    done = bsp.push(1, 0, 0, g(3.0), copy_to=out)  # closes the round: the mean applied
    np.testing.assert_array_equal(out, bsp.params)
    assert done.copied == zlib.adler32(bsp.params.tobytes()) and done.version == 1


@pytest.mark.parametrize("n", [0, 1, 5, 262144, 3 * 262144 + 17])
def test_passes_taken_backward_give_the_forward_checksum(n):
    """Blocks last to first (buffers.backward_blocks), each block's Adler-32 combined in
    order: zlib's value of the whole; the first non-finite element still the first."""
    import zlib
    v = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    want = zlib.adler32(v.tobytes(), 7)
    assert buffers.checksum_and_first_nonfinite_backward(v, 7) == (want, -1)
    out = np.empty_like(v)
    assert buffers.copy_and_checksum_backward(out, v, 7) == want
    np.testing.assert_array_equal(out, v)
    if n > 3:
        v[[n // 3, n - 1]] = np.inf
        assert buffers.checksum_and_first_nonfinite_backward(v, 1)[1] == n // 3
    a, b = v[: n // 2].tobytes(), v[n // 2:].tobytes()
    assert buffers.adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == \
        zlib.adler32(a + b)
