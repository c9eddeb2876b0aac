"""Compressed async pushes (dtlab-worker --compress topk:F | randk:F | sign; error feedback
by default): real daemons on loopback ports and real worker processes.

topk:1.0 under BSP is the uncompressed BSP run bit for bit (float64 SGD); the residual
holds exactly what a push did not send and the servers applied exactly what it did (against
a twin compressor of models/compress.py, float64 SGD lr 1); a sign push decoded on a server
is models/compress.py's decode; the bytes counted are the payload formula; malformed
compressed pushes are refused by name with nothing applied; the flags it does not go with
are refused by name.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from support.pserver_util import (
    TINY_MLP_FLAGS,
    addresses,
    initial_params,
    run_workers,
    serve,
)

from dtlab.models.compress import CompressConfig, RandK, Sign, TopK
from dtlab.models.config import ConfigError, build
from dtlab.models.run.metrics import read_metrics
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import compressed
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker import loop
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.compressed_push import CompressedPush


def client(daemons, spec: str, params, error_feedback: bool = True, worker: int = 0,
           **options) -> PSClient:
    transport = options.pop("transport", "session")
    pusher = CompressedPush(build(CompressConfig, {"compress": spec,
                                                   "error_feedback": error_feedback}),
                            params.size, params.data.dtype)
    c = PSClient(build(ClientConfig, {"servers": addresses(daemons), "connect_timeout_s": 20.0,
                                      "rpc_timeout_s": 20.0, **options}),
                 transport=transport, compress=pusher)
    c.connect(worker, "mlp", params.size, wire.layout_crc(params.specs))
    return c


def gradient(size: int, seed: int, dtype=np.float64) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(dtype)


def values_of(daemons) -> np.ndarray:
    return np.concatenate([d.store.params for d in daemons])


def test_topk_1_under_bsp_is_the_uncompressed_bsp_run_bit_for_bit(tmp_path):
    """Two worker processes, two shards, float64 SGD: every element is sent (the residual
    stays exactly 0) and each shard's round is the dense round."""
    flags = [*TINY_MLP_FLAGS, "--steps", "4", "--batch-size", "8", "--clip", "0",
             "--dtype", "float64"]
    got, pushed = {}, {}
    for spec in ("", "topk:1.0"):
        with serve(shards=2, consistency="bsp", num_workers=2, dtype="float64",
                   optim={"optimizer": "sgd", "lr": 0.5, "momentum": 0.9, "warmup": 0,
                          "schedule": "constant", "clip": 0.0}) as daemons:
            paths = run_workers(addresses(daemons), 2,
                                [*flags, *(["--compress", spec] if spec else [])], tmp_path,
                                timeout=90, name=f"w{spec.replace(':', '')}-")
            got[spec] = values_of(daemons)
            received = sum(d.store.stats().bytes_received for d in daemons)
        records = [r for p in paths for r in read_metrics(str(p))[1]]
        pushed[spec] = [r["push_bytes"] for r in records]
        assert received == sum(pushed[spec])
        if spec:
            assert read_metrics(str(paths[0]))[0]["compress"] == spec
    np.testing.assert_array_equal(got["topk:1.0"], got[""])
    n = got[""].size
    assert pushed[""] == [n * 8] * 8
    assert pushed["topk:1.0"] == [n * (4 + 8)] * 8  # k (4 + b), k = n


@pytest.mark.parametrize("spec, twin", [("topk:0.25", lambda n: TopK(n, 0.25, dtype=np.float64)),
                                        ("sign", lambda n: Sign(n, dtype=np.float64))])
def test_the_residual_is_exactly_what_was_not_sent_and_the_servers_apply_what_was(spec, twin):
    """A twin compressor of models/compress.py on the same gradients: the worker's residual
    equals the twin's (e = p - D(C(p))), and each step the servers (float64 SGD lr 1) move
    by exactly -D(C(p)): sent elements by their value, the others not at all (top-k)."""
    params = initial_params(dtype="float64")
    n = params.size
    mirror = twin(n)
    with serve(shards=2, dtype="float64") as daemons:
        c = client(daemons, spec, params)
        try:
            flat = np.empty(n, np.float64)
            c.pull(flat)
            for step in range(3):
                before = values_of(daemons).copy()
                g = gradient(n, step)
                p = g + mirror.residual
                payload = mirror.compress(g)
                sent = mirror.decompress(payload)
                c.push_pull(g, step, flat)
                np.testing.assert_array_equal(c.compress.residual, mirror.residual)
                np.testing.assert_array_equal(values_of(daemons), before - sent)
                np.testing.assert_array_equal(flat, before - sent)
                if spec.startswith("topk"):  # each element sent whole or not at all
                    np.testing.assert_array_equal(mirror.residual + sent, p)
                    held = sent == 0
                    np.testing.assert_array_equal(mirror.residual[held], p[held])
                    assert not mirror.residual[~held].any()
        finally:
            c.close()


def test_without_error_feedback_nothing_is_kept():
    params = initial_params()
    with serve(shards=1) as daemons:
        c = client(daemons, "topk:0.1", params, error_feedback=False)
        try:
            c.pull(np.empty(params.size, np.float32))
            c.push(gradient(params.size, 0, np.float32), 0)
            assert c.compress.residual is None
        finally:
            c.close()


def test_a_sign_part_decoded_on_a_server_is_models_compress_decode():
    """The decoder the servicer runs, on each shard's part of a payload (shards not on
    byte boundaries, a zero gradient element, float32 and float64)."""
    for dtype in (np.float32, np.float64):
        n = 67
        g = gradient(n, 3, dtype)
        g[5] = 0  # sign(0) = +1
        sign = Sign(n, dtype=dtype)
        payload = sign.compress(g)
        want = sign.decompress(payload)
        bounds = [(0, 13), (13, 40), (40, n)]
        for (lo, hi), part in zip(bounds, compressed.split(payload, bounds), strict=True):
            dense, ranges = compressed.decode(part.message, part.data, hi - lo, dtype)
            assert ranges is None and dense.dtype == dtype
            np.testing.assert_array_equal(dense, want[lo:hi])
            assert part.data.size == math.ceil((hi - lo) / 8) + np.dtype(dtype).itemsize


@pytest.mark.parametrize("spec", ["topk:0.1", "randk:0.2", "sign"])
def test_bytes_counted_are_the_payload_formula(spec):
    """k (4 + b) for top-k and random-k (the indices travel), sum over the shards of
    ceil(length / 8) + b for sign; counted alike by the worker and the servers."""
    params = initial_params()
    n, b, steps = params.size, 4, 2
    with serve(shards=2) as daemons:
        c = client(daemons, spec, params)
        try:
            flat = np.empty(n, np.float32)
            c.pull(flat)
            for step in range(steps):
                c.push_pull(gradient(n, step, np.float32), step, flat)
            received = sum(st.bytes_received for st in c.stats())
            lengths = [d.store.layout.length for d in daemons]
        finally:
            c.close()
    kind, _, fraction = spec.partition(":")
    if kind == "sign":
        per_push = sum(math.ceil(length / 8) + b for length in lengths)
    else:
        k = (TopK if kind == "topk" else RandK)(n, float(fraction)).k
        per_push = k * (4 + b)
    assert c.pushed_bytes == received == steps * per_push


def indexed(indices, values, dtype=np.float32) -> tuple[pb.PushCompressed, np.ndarray]:
    idx = np.asarray(indices, compressed.INDEX)
    data = np.concatenate([idx.view(np.uint8), np.asarray(values, dtype).view(np.uint8)])
    return pb.PushCompressed(kind=pb.PushCompressed.INDEXED, count=len(indices)), data


def test_malformed_compressed_pushes_are_refused_by_name_and_nothing_is_applied():
    params = initial_params()
    with serve(shards=1) as daemons:
        store = daemons[0].store
        n = store.layout.length
        before = store.params.copy()
        c = client(daemons, "topk:0.1", params, transport="calls")
        s = c.shards[0]
        sign_bytes = math.ceil(n / 8)
        bad = [
            (*indexed([0, n], [1, 1]), "outside the shard's"),
            (*indexed([3, 3], [1, 1]), "is a duplicate of index [0]"),
            (*indexed([5, 2], [1, 1]), "is below index [0]"),
            (pb.PushCompressed(kind=pb.PushCompressed.INDEXED, count=n + 1),
             np.zeros(8 * (n + 1), np.uint8), "compressed.count"),
            (pb.PushCompressed(kind=pb.PushCompressed.SIGN),
             np.concatenate([np.zeros(sign_bytes, np.uint8),
                             np.asarray([np.nan], np.float32).view(np.uint8)]), "scale is nan"),
            (pb.PushCompressed(kind=pb.PushCompressed.SIGN),
             np.concatenate([np.zeros(sign_bytes, np.uint8),
                             np.asarray([-1], np.float32).view(np.uint8)]), "scale is -1"),
            (pb.PushCompressed(kind=0), np.zeros(4, np.uint8), "INDEXED or SIGN"),
        ]
        try:
            c.pull(np.empty(n, np.float32))
            for message, data, why in bad:
                part = compressed.Part(message, data, np.dtype(np.float32))
                header = s._push_header(data, 0, 0, 0, compressed=part)
                with pytest.raises(grpc.RpcError) as e:
                    s._push(wire.stream(header, data, 4096), timeout=20)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert why in e.value.details()
            # a packed length other than the kind and count make: whole pushes on a session
            s.transport = "session"
            message, data = indexed([1, 2], [1, 1])
            for wrong in (data[:-1], np.concatenate([data, data[:4]])):
                part = compressed.Part(message, wrong, np.dtype(np.float32))
                with pytest.raises(grpc.RpcError) as e:
                    s.push(wrong, 0, 0, 0, compressed=part)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"a compressed push (INDEXED, count 2) to a shard of {n} elements carries " \
                       f"{wrong.size} bytes, not 16" in e.value.details()
            # with ranges, and in a half dtype
            header = s._push_header(data, 0, 0, 0, compressed=compressed.Part(
                message, data, np.dtype(np.float32)))
            header.ranges.CopyFrom(pb.PushRanges(offset=[0], length=[4]))
            with pytest.raises(grpc.RpcError, match="ranges or is compressed, not both"):
                s._push(wire.stream(header, data, 4096), timeout=20)
            header = s._push_header(data, 0, 0, 0, compressed=compressed.Part(
                message, data, np.dtype(np.float16)))
            with pytest.raises(grpc.RpcError, match="carries its FLOAT32 values"):
                s._push(wire.stream(header, data, 4096), timeout=20)
            st = store.stats()
        finally:
            c.close()
        np.testing.assert_array_equal(store.params, before)
    assert st.version == 0 and st.pushes == 0
    assert st.rejected["compressed"] == len(bad) + 3 and st.rejected["dtype"] == 1


@pytest.mark.parametrize("flags, why", [
    (["--compress", "topk:0.1", "--local-steps", "2"], "with --local-steps 2"),
    (["--compress", "sign", "--wire", "fp16"], "with --wire fp16"),
    (["--compress", "sign", "--tp", "2"], "with --tp 2"),
    (["--model", "transformer", "--moe-experts", "4", "--compress", "topk:0.1",
      "--moe-sparse-push"], "with --moe-sparse-push: not supported"),
    (["--compress", "powersgd:2"], "the parameter servers take topk, randk, sign"),
    (["--no-error-feedback"], "--no-error-feedback needs --compress"),
])
def test_what_compression_does_not_go_with_is_refused_by_name(flags, why):
    argv = ["--servers", "127.0.0.1:1", *TINY_MLP_FLAGS, *flags]
    if "transformer" in flags:
        argv = ["--servers", "127.0.0.1:1", *flags]
    with pytest.raises(ConfigError, match=why):
        loop.main(argv)
