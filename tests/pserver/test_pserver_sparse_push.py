"""Mixture-of-Experts workers push only the experts their tokens reached (pserver.common.ranges).

Against real daemons on loopback ports: a push of ranges equals a dense push whose
other ranges are zero (SGD, exactly, over every transport path); experts no push
carried stay bit-identical, with their optimizer state (lazy Adam); under BSP the
sparse round equals the dense round; malformed ranges are refused by name with
nothing applied; per-expert staleness is counted exactly; and a real worker run
with --moe-sparse-push pushes fewer bytes than the dense one.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
from support.pserver_util import ONE_BLAS_THREAD, ROOT, addresses, run_workers, serve

from dtlab.models.config import build
from dtlab.models.optim import OptimConfig, Schedule, make_optimizer
from dtlab.models.params import FlatParams
from dtlab.models.run.metrics import read_metrics
from dtlab.models.zoo import build_model, config_class
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.common.errors import InvalidArgument
from dtlab.pserver.server import checkpoint, metrics
from dtlab.pserver.server.cache_blocked import BlockedOptimizer
from dtlab.pserver.server.consistency import Consistency
from dtlab.pserver.server.store import ShardLayout, ShardStore
from dtlab.pserver.worker.client import PSClient

MOE = {"vocab": 8, "seq_len": 8, "d_model": 8, "n_heads": 2, "n_layers": 2, "d_ff": 16,
       "moe_experts": 4, "moe_top_k": 1}
SGD = {"optimizer": "sgd", "lr": 0.5, "warmup": 0, "schedule": "constant", "clip": 0.0}
ADAM = {"optimizer": "adam", "lr": 0.01, "warmup": 0, "schedule": "constant", "clip": 0.0}


def moe_params(cfg: dict = MOE) -> FlatParams:
    model = build_model("transformer", build(config_class("transformer"), dict(cfg)))
    return FlatParams(model.specs(), seed=0, dtype="float32", xp=np)


def client(daemons, worker: int, params: FlatParams, **options) -> PSClient:
    transport = options.pop("transport", "session")
    shm = options.pop("shm", False)
    codec = wire.CODECS[options.pop("codec", "hand")]
    c = PSClient(build(ClientConfig, {"servers": addresses(daemons), "connect_timeout_s": 20.0,
                                      "rpc_timeout_s": 20.0, **options}),
                 transport=transport, shm=shm, codec=codec)
    c.connect(worker, "transformer", params.size, wire.layout_crc(params.specs))
    return c


def leaving(experts: dict[str, ranges.Ranges], size: int, *names: str) -> ranges.Ranges:
    """The model's ranges without the parameters of the experts `names`."""
    return ranges.without(size, [r for n in names for r in experts[n]])


def gradient(size: int, seed: int, zero: ranges.Ranges = ()) -> np.ndarray:
    g = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    for lo, hi in zero:
        g[lo:hi] = 0
    return g


def test_ranges_merge_split_per_shard_and_are_checked():
    assert ranges.merged([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert ranges.without(10, [(2, 4), (3, 5), (8, 10)]) == [(0, 2), (5, 8)]
    assert ranges.within([(0, 3), (5, 9)], 2, 7) == [(0, 1), (3, 5)]
    assert ranges.within_packed([(0, 3), (5, 9), (12, 14)], 2, 7) == ([(0, 1), (3, 5)], 2)
    values = np.arange(10.0)
    assert ranges.gather(values, [(1, 3), (7, 8)]).tolist() == [1, 2, 7]
    ok = ranges.decode(pb.PushRanges(offset=[0, 4], length=[2, 6]), 10)
    assert ok == [(0, 2), (4, 10)]
    for offsets, lengths, why in (([0, 1], [2, 2], "sorted and disjoint"),
                                  ([4, 0], [1, 1], "sorted and disjoint"),
                                  ([8], [3], "runs past"), ([0], [0], "empty"),
                                  ([0, 4], [1], "2 offsets but 1 lengths")):
        with pytest.raises(InvalidArgument, match=why) as e:
            ranges.decode(pb.PushRanges(offset=offsets, length=lengths), 10)
        assert e.value.reason == "ranges"
    specs = moe_params().specs
    experts = ranges.expert_ranges(specs)
    assert sorted(experts) == [f"h{i}.moe.e{j}" for i in range(2) for j in range(4)]
    assert all(len(r) == 1 for r in experts.values())  # each expert's tensors are adjacent


@pytest.mark.parametrize("optim", [SGD, {**SGD, "momentum": 0.9}, ADAM,
                                   {**ADAM, "optimizer": "adamw", "weight_decay": 0.1}])
def test_a_lazy_step_updates_exactly_its_ranges(optim):
    """Inside the ranges: the dense step's values bit for bit (elementwise update, same step
    count); outside: parameters and state untouched. Blocks of 64 cut across ranges."""
    n, keep = 300, [(3, 70), (128, 129), (190, 300)]
    cfg = build(OptimConfig, optim)
    start = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    g = gradient(n, 2)
    for make in (lambda p: make_optimizer(cfg, p), lambda p: BlockedOptimizer(cfg, p, block=64)):
        dense_p, lazy_p = start.copy(), start.copy()
        dense, lazy = make(dense_p), make(lazy_p)
        for _ in range(3):
            dense.step(dense_p, g, 0.1)
            lazy.step_ranges(lazy_p, ranges.gather(g, keep), keep, 0.1)
        assert lazy.steps == dense.steps == 3
        inside = np.zeros(n, bool)
        for lo, hi in keep:
            inside[lo:hi] = True
        np.testing.assert_array_equal(lazy_p[inside], dense_p[inside])
        np.testing.assert_array_equal(lazy_p[~inside], start[~inside])
        for name, state in lazy.state_dict().items():
            if name != "steps":
                np.testing.assert_array_equal(state[~inside], 0)


@pytest.mark.parametrize("path", [
    {},  # a session, one message each way (push_whole with then_pull)
    {"chunk_bytes": 4096},  # a session, the push streamed in chunks, its pull behind it
    {"codec": "generated"},  # the same through protobuf's generated classes
    {"shm": True},  # shared memory (shm_push with then_pull)
    {"transport": "calls", "chunk_bytes": 4096},  # a Push call, then a Pull call
])
def test_a_ranged_push_equals_the_dense_push_of_zeros_there(path):
    params = moe_params()
    experts = ranges.expert_ranges(params.specs)
    omitted = ["h0.moe.e1", "h0.moe.e2", "h1.moe.e0"]
    keep = leaving(experts, params.size, *omitted)
    dense_g = gradient(params.size, 0, zero=ranges.without(params.size, keep))
    with serve(2, "transformer", MOE, SGD) as ranged_servers, \
            serve(2, "transformer", MOE, SGD) as dense_servers:
        a = client(ranged_servers, 0, params, **path)
        b = client(dense_servers, 0, params, **path)
        try:
            got, want = np.empty(params.size, np.float32), np.empty(params.size, np.float32)
            a.pull(got)
            b.pull(want)
            for step in range(2):
                a.push_pull(dense_g, step, got, keep)
                b.push_pull(dense_g, step, want)
            if path.get("shm"):
                assert all(s.shared_memory for s in a.shards)
            sent = sum(st.bytes_received for st in a.stats())
        finally:
            a.close()
            b.close()
    np.testing.assert_array_equal(got, want)
    assert sent == 2 * ranges.size(keep) * 4  # only the ranges' bytes travelled
    for name in omitted:  # (SGD: a zero gradient changes nothing either)
        for lo, hi in experts[name]:
            np.testing.assert_array_equal(got[lo:hi], params.data[lo:hi])


def test_untouched_experts_stay_bit_identical_under_asp_with_adam():
    params = moe_params()
    experts = ranges.expert_ranges(params.specs)
    with serve(2, "transformer", MOE, ADAM) as daemons:
        clients = [client(daemons, w, params) for w in (0, 1)]
        try:
            out = np.empty(params.size, np.float32)
            for c in clients:
                c.pull(out)
            for step in range(3):  # worker 0 never carries e3 of h0; worker 1 never h0.e3 and h1.e1
                for w, c in enumerate(clients):
                    omit = ["h0.moe.e3"] + (["h1.moe.e1"] if w else [])
                    keep = leaving(experts, params.size, *omit)
                    c.push_pull(gradient(params.size, 10 * step + w), step, out, keep)
            state = [d.store.state() for d in daemons]
        finally:
            for c in clients:
                c.close()
    values = np.concatenate([s["params"] for s in state])
    moments = np.concatenate([s["optimizer"]["m"] for s in state])
    lo, hi = experts["h0.moe.e3"][0]
    np.testing.assert_array_equal(values[lo:hi], params.data[lo:hi])
    assert not moments[lo:hi].any()
    lo, hi = experts["h1.moe.e1"][0]  # carried by worker 0 only: changed
    assert (values[lo:hi] != params.data[lo:hi]).any()
    assert all(s["version"] == 6 for s in state)


def test_sparse_bsp_rounds_equal_dense_bsp_rounds():
    """Each worker leaves out other experts (some omitted by both): the mean over the
    round's workers, applied to the union, is the dense round's result bit for bit."""
    params = moe_params()
    experts = ranges.expert_ranges(params.specs)
    omit = {0: ["h0.moe.e0", "h0.moe.e1", "h1.moe.e2"], 1: ["h0.moe.e0", "h1.moe.e3"]}
    results = []
    for sparse in (True, False):
        with serve(2, "transformer", MOE, SGD, consistency="bsp", num_workers=2) as daemons:
            clients = [client(daemons, w, params) for w in (0, 1)]
            try:
                out = [np.empty(params.size, np.float32) for _ in clients]
                for c, o in zip(clients, out, strict=True):
                    c.pull(o)
                for step in range(2):
                    for w, c in enumerate(clients):
                        keep = leaving(experts, params.size, *omit[w])
                        g = gradient(params.size, 10 * step + w,
                                     zero=ranges.without(params.size, keep))
                        c.push(g, step, keep if sparse else None)
                    for c, o in zip(clients, out, strict=True):
                        c.pull(o)
                assert all(d.store.version == 2 for d in daemons)
                results.append(out[0].copy())
                np.testing.assert_array_equal(out[0], out[1])
            finally:
                for c in clients:
                    c.close()
    np.testing.assert_array_equal(results[0], results[1])
    lo, hi = experts["h0.moe.e0"][0]  # omitted by both workers
    np.testing.assert_array_equal(results[0][lo:hi], params.data[lo:hi])


def test_malformed_ranges_are_refused_by_name_and_nothing_is_applied():
    params = moe_params()
    with serve(1, "transformer", MOE, SGD) as daemons:
        store = daemons[0].store
        before = store.params.copy()
        c = client(daemons, 0, params, transport="calls")
        s = c.shards[0]
        try:
            c.pull(np.empty(params.size, np.float32))
            n = params.size
            bad = [
                (pb.PushRanges(offset=[0, 5], length=[10, 10]), 20, "sorted and disjoint"),
                (pb.PushRanges(offset=[n - 5], length=[10]), 10, "runs past"),
                (pb.PushRanges(offset=[0, 40], length=[10]), 10, "offsets but"),
                (pb.PushRanges(offset=[3], length=[0]), 0, "empty"),
            ]
            for message, count, why in bad:
                header = s._push_header(np.zeros(n, np.float32), 0, 0, 0)
                header.ranges.CopyFrom(message)
                stream = wire.stream(header, np.ones(count, np.float32), 4096)
                with pytest.raises(grpc.RpcError) as e:
                    s._push(stream, timeout=20)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert why in e.value.details() and "ranges" in e.value.details()
            # data of another length than the ranges': a whole push on a session, too short
            # and too long
            c.shards[0].transport = "session"
            for count in (9, 11):
                with pytest.raises(grpc.RpcError) as e:
                    s.push(np.ones(count, np.float32), 0, 0, 0, [(0, 10)])
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "ranges holding 10 elements" in e.value.details()
            st = store.stats()
        finally:
            c.close()
        np.testing.assert_array_equal(store.params, before)
    assert st.version == 0 and st.pushes == 0 and st.rejected["ranges"] == 6


def test_per_expert_staleness_is_counted_exactly():
    """Two workers, one shard, a scripted order; expert staleness counts the updates that
    touched the expert between the worker's pull and its push."""
    params = moe_params()
    experts = ranges.expert_ranges(params.specs)
    names = sorted(experts)

    def only(*carried):
        return leaving(experts, params.size, *(n for n in names if n not in carried))

    with serve(1, "transformer", MOE, SGD) as daemons:
        w0, w1 = (client(daemons, w, params) for w in (0, 1))
        try:
            out = np.empty(params.size, np.float32)
            g = gradient(params.size, 0)
            w0.pull(out)
            w1.pull(out)
            w0.push(g, 0, only("h0.moe.e0"))  # e0: 0                 -> e0 v1
            w1.push(g, 0, only("h0.moe.e0", "h0.moe.e1"))  # e0: 1, e1: 0 -> e0 v2, e1 v1
            w1.push(g, 1, only("h0.moe.e1"))  # e1: 1 (no pull since)  -> e1 v2
            w0.pull(out)
            w0.push(g, 1, only("h0.moe.e1", "h1.moe.e2"))  # e1: 0, h1.e2: 0
            w1.push(g, 2)  # dense: every expert; h0.e0 2-0, h0.e1 3-0, h1.e2 1-0, others 0
            reply = w0.stats()[0]
        finally:
            w0.close()
            w1.close()
    counts = {e: dict(h.counts) for e, h in reply.expert_staleness.items()}
    assert counts["h0.moe.e0"] == {0: 1, 1: 1, 2: 1}
    assert counts["h0.moe.e1"] == {0: 2, 1: 1, 3: 1}
    assert counts["h1.moe.e2"] == {0: 1, 1: 1}
    for e in set(names) - {"h0.moe.e0", "h0.moe.e1", "h1.moe.e2"}:
        assert counts[e] == {0: 1}
    assert dict(reply.staleness.counts) == {0: 2, 1: 1, 2: 1, 4: 1}  # the shard's, as before
    exposed = {(f.name, tuple(s.labels.items())): s.value for f in metrics.families(reply)
               for s in f.samples if f.name == "dtlab_ps_expert_staleness"}
    assert exposed[("dtlab_ps_expert_staleness", (("shard", "0"), ("expert", "h0.moe.e1"),
                                                  ("le", "1")))] == 3


def test_a_worker_pushing_only_reached_experts_sends_fewer_bytes(tmp_path):
    """Real dtlab-worker runs, dense and --moe-sparse-push, under 2 servers with plain SGD:
    the same losses step for step (the experts left out had a zero gradient), fewer bytes."""
    cfg = {"vocab": 8, "seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32,
           "moe_experts": 8, "moe_top_k": 1}
    data = {"markov_order": 1, "n_tokens": 2000}
    model = ["--model", "transformer"] + [x for k, v in {**cfg, **data}.items()
                                          for x in (f"--{k.replace('_', '-')}", str(v))]
    run = [*model, "--steps", "6", "--batch-size", "1", "--clip", "0"]
    sent, losses = {}, {}
    for sparse in (False, True):
        with serve(2, "transformer", cfg, SGD, data=data) as daemons:
            path, = run_workers(addresses(daemons), 1,
                                [*run, *(["--moe-sparse-push"] if sparse else [])], tmp_path,
                                timeout=60, name=f"sparse{int(sparse)}-")
            received = sum(d.store.stats().bytes_received for d in daemons)
        _, records = read_metrics(str(path))
        assert len(records) == 6 and all(np.isfinite(r["loss"]) for r in records)
        sent[sparse] = sum(r["push_bytes"] for r in records)
        losses[sparse] = [r["loss"] for r in records]
        assert received == sent[sparse]
        if sparse:
            fractions = [r["expert_push_fraction"] for r in records]
            assert all(0 <= f <= 1 for f in fractions) and min(fractions) < 1
    assert sent[True] < sent[False]
    assert losses[True] == losses[False]


def test_a_shard_that_no_range_meets_gets_an_empty_push():
    """Ranges inside shard 0 only: shard 1 gets a push of no ranges, which counts as the
    worker's step (an update of nothing: its values stay, its version and steps move)."""
    params = moe_params()
    with serve(2, "transformer", MOE, SGD) as daemons:
        c = client(daemons, 0, params)
        try:
            out = np.empty(params.size, np.float32)
            c.pull(out)
            half = daemons[0].store.layout.length
            replies, _ = c.push_pull(gradient(params.size, 0), 0, out, [(0, half // 2)])
            stats = [d.store.stats() for d in daemons]
            values = daemons[1].store.params.copy()
        finally:
            c.close()
    assert [r.version for r in replies] == [1, 1] and [s.updates for s in stats] == [1, 1]
    assert [s.bytes_received for s in stats] == [half // 2 * 4, 0]
    np.testing.assert_array_equal(values, params.data[half:])
    np.testing.assert_array_equal(out[half // 2:], params.data[half // 2:])


def test_a_checkpoint_keeps_the_ranges_of_an_unfinished_bsp_round(tmp_path):
    """Momentum SGD: a resumed round of ranged pushes still updates only their union (a
    dense apply would move the other ranges by their velocity)."""
    n, optim = 40, {**SGD, "momentum": 0.9}
    ocfg = build(OptimConfig, optim)

    def shard() -> ShardStore:
        values = np.arange(n, dtype=np.float32)
        s = ShardStore(ShardLayout("toy", n, 0, 1), values, make_optimizer(ocfg, values),
                       Schedule(ocfg, 0), Consistency("bsp"), log_every=0)
        for w in (0, 1):
            s.register(w, "toy", n, 0)
        s.push(0, 0, 0, np.ones(n, np.float32))  # round 1, dense: every element gets velocity
        s.push(1, 0, 0, np.ones(n, np.float32))
        s.push(0, 1, 1, np.full(10, 2, np.float32), [(5, 15)])  # round 2: ranged, half done
        return s

    straight = shard()
    straight.push(1, 1, 1, np.full(5, 4, np.float32), [(30, 35)])
    before = shard()
    path = checkpoint.save(str(tmp_path), before.layout, before.state(),
                           {"optim": {"optimizer": "sgd"}})
    resumed = ShardStore(ShardLayout("toy", n, 0, 1), np.zeros(n, np.float32),
                         make_optimizer(ocfg, np.zeros(n, np.float32)), Schedule(ocfg, 0),
                         Consistency("bsp"), log_every=0)
    for w in (0, 1):
        resumed.register(w, "toy", n, 0)
    resumed.load_state(checkpoint.load(path, before.layout, "sgd"))
    resumed.push(1, 1, 1, np.full(5, 4, np.float32), [(30, 35)])
    assert resumed.version == straight.version == 2
    np.testing.assert_array_equal(resumed.params, straight.params)
    after_round_1 = np.arange(n, dtype=np.float32) - 0.5  # lr 0.5 x velocity 1
    untouched = np.r_[0:5, 15:30, 35:40]
    np.testing.assert_array_equal(straight.params[untouched], after_round_1[untouched])


@pytest.mark.parametrize("flags, why", [
    (["--model", "mlp"], "--moe-sparse-push needs a Mixture-of-Experts model"),
    (["--model", "transformer", "--moe-experts", "4", "--tp", "2"], "worker group"),
])
def test_moe_sparse_push_is_refused_where_it_cannot_apply(flags, why):
    r = subprocess.run([sys.executable, "-m", "dtlab.pserver.worker", "--servers",
                        "127.0.0.1:1", "--moe-sparse-push", *flags], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=ONE_BLAS_THREAD)
    assert r.returncode == 2 and why in r.stderr, r.stderr
