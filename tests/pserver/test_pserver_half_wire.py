"""Half-precision tensors on the parameter server's wire (--wire fp16 / bf16) and
mixed-precision workers (--precision): pulls come as half, pushes go as half, the
servers keep float32 and convert on receipt; half the bytes; training lands where the
float32 wire does within the rounding; a dtype the shard cannot take is refused."""

from __future__ import annotations

import numpy as np
import pytest
from support.pserver_util import addresses, initial_params, run_workers, serve

from dtlab.models.config import build
from dtlab.models.precision import PRECISIONS, UNIT_ROUNDOFF
from dtlab.models.run.metrics import read_metrics
from dtlab.pserver.common import codec as wire_format
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.session import StatusError

MLP = {"d_in": 4, "d_hidden": 64, "n_layers": 1, "n_classes": 3}
MLP_FLAGS = ["--model", "mlp", "--d-in", "4", "--d-hidden", "64", "--n-layers", "1",
             "--n-classes", "3"]


def connect(servers: str, worker: int = 0, params=None, wire: str = "fp32",
            transport: str = "session", shm: bool = True) -> PSClient:
    """A client of the tiny MLP's shards registered as `worker`, tensors as `wire`."""
    params = params or initial_params()
    c = PSClient(build(ClientConfig, {"servers": servers, "connect_timeout_s": 20.0,
                                      "rpc_timeout_s": 20.0}),
                 transport=transport, shm=shm, wire_dtype=wire)
    c.connect(worker, "mlp", params.size, wire_format.layout_crc(params.specs))
    return c


@pytest.mark.parametrize("transport", ["session", "calls"])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_half_pull_and_push_round_once_and_move_half_the_bytes(wire, transport):
    """A pull returns the float32 values rounded to the wire dtype; a pushed half gradient
    is applied as float32 (SGD lr 1: params - g exactly); the client counts 2 bytes a value,
    a float32 client 4."""
    half = PRECISIONS[wire]
    with serve(shards=2) as daemons:
        start = np.concatenate([d.store.params for d in daemons]).copy()
        c = connect(addresses(daemons), wire=wire, transport=transport)
        full = connect(addresses(daemons), worker=1, transport=transport, shm=False)
        try:
            got = np.empty(start.size, np.float32)
            assert c.pull(got) == 2
            np.testing.assert_array_equal(got, start.astype(half).astype(np.float32))
            g = np.random.default_rng(0).standard_normal(start.size).astype(np.float32)
            replies, changed = c.push_pull(g, 0, got)
            assert [r.version for r in replies] == [1, 1] and changed == 2
            want = start - g.astype(half).astype(np.float32)
            held = np.concatenate([d.store.params for d in daemons])
            np.testing.assert_array_equal(held, want)  # float32 on the server
            np.testing.assert_array_equal(got, want.astype(half).astype(np.float32))
            assert (c.pushed_bytes, c.pulled_bytes) == (2 * start.size, 2 * 2 * start.size)
            ref = np.empty(start.size, np.float32)
            full.pull(ref)
            full.push(g, 0)
            assert (full.pushed_bytes, full.pulled_bytes) == (4 * start.size, 4 * start.size)
            assert c.pushed_bytes * 2 == full.pushed_bytes
        finally:
            c.close()
            full.close()


def test_a_dtype_the_shard_cannot_take_is_refused_by_name():
    """A float64 shard takes no half tensors: the pull and the push are refused naming
    both dtypes, and nothing changes."""
    with serve(shards=1, dtype="float64") as daemons:
        params = initial_params(dtype="float64")
        before = daemons[0].store.params.copy()
        c = connect(addresses(daemons), params=params, wire="fp16", transport="calls")
        try:
            with pytest.raises(StatusError, match="FLOAT16.*holds FLOAT64"):
                c.pull(np.empty(params.size))
            c.versions = [0]
            with pytest.raises(StatusError, match="FLOAT16.*holds FLOAT64"):
                c.push(np.zeros(params.size), 0)
        finally:
            c.close()
        np.testing.assert_array_equal(daemons[0].store.params, before)
        assert daemons[0].store.version == 0


def bsp_final_params(tmp_path, name: str, worker_flags: list[str], W: int = 2, K: int = 20):
    optim = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "warmup": 0}
    with serve(shards=2, model_cfg=MLP, optim=optim, consistency="bsp",
               num_workers=W) as daemons:
        out = tmp_path / name
        out.mkdir()
        paths = run_workers(addresses(daemons), W, [*MLP_FLAGS, "--clip", "0", "--steps",
                                                    str(K), "--batch-size", "16",
                                                    *worker_flags], out)
        return np.concatenate([d.store.params for d in daemons]), paths


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_bsp_training_over_a_half_wire_matches_the_float32_wire(tmp_path, wire):
    """The same BSP run over the float32 and the half wire: the roundings (u relative,
    once per pull and per push) touch the values the workers read and the gradients, never
    the float32 values the servers hold, so the final parameters differ by less than one
    rounding of their own (and by more than nothing); every step moved half the bytes."""
    K = 20
    want, _ = bsp_final_params(tmp_path, "fp32", ["--no-shm"], K=K)
    got, paths = bsp_final_params(tmp_path, wire, ["--wire", wire], K=K)
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    u = UNIT_ROUNDOFF[wire]
    assert 0 < rel < u, f"{rel / u:.2f} u"
    header, records = read_metrics(str(paths[0]))
    assert header["wire"] == wire
    n = want.size
    assert all(r["push_bytes"] == 2 * n for r in records)
    assert all(r["pull_bytes"] in (0, 2 * n) for r in records)


def test_mixed_precision_worker_skips_the_push_of_an_overflowed_step(tmp_path):
    """--precision fp16 with a loss scale that overflows at first: those steps push
    nothing (the servers apply fewer updates than steps), say so in the metrics, and the
    scale shrinks until the steps go through."""
    K = 30
    with serve(shards=2, model_cfg=MLP, consistency="asp", num_workers=1,
               optim={"optimizer": "adam", "lr": 1e-2, "warmup": 0}) as daemons:
        paths = run_workers(addresses(daemons), 1,
                            [*MLP_FLAGS, "--steps", str(K), "--batch-size", "32",
                             "--precision", "fp16", "--loss-scale", "1e12", "--wire", "fp16"],
                            tmp_path)
        updates = [d.store.stats().updates for d in daemons]
    _, records = read_metrics(str(paths[0]))
    skipped = [r for r in records if r["skipped"]]
    assert skipped and all(r["push_bytes"] == 0 and r["staleness"] == [] for r in skipped)
    assert updates == [K - len(skipped)] * 2
    assert records[-1]["loss_scale"] < 1e12 and not records[-1]["skipped"]
    assert records[-1]["skipped_steps"] == len(skipped)


@pytest.mark.parametrize("precision, wire", [("fp16", "fp16"), ("bf16", "bf16")])
def test_async_training_in_half_precision_over_a_half_wire_reaches_the_floor(
        tmp_path, precision, wire):
    """Two ASP workers computing in half precision, pushing and pulling half tensors:
    the training loss still lands near the data's floor (as the float32 run of
    test_pserver_training does), with half the bytes on every push."""
    optim = {"optimizer": "adam", "lr": 1e-2, "warmup": 10, "schedule": "constant"}
    with serve(shards=2, model_cfg=MLP, optim=optim, consistency="asp",
               num_workers=2) as daemons:
        paths = run_workers(addresses(daemons), 2,
                            [*MLP_FLAGS, "--batch-size", "64", "--steps", "400", "--clip", "0",
                             "--precision", precision, "--wire", wire], tmp_path)
    tails, n = [], initial_params(model_cfg=MLP).size
    for path in paths:
        header, records = read_metrics(str(path))
        tails += [r["loss"] for r in records[-40:]]
        assert all(r["push_bytes"] == 2 * n for r in records if not r["skipped"])
    assert np.mean(tails) - header["floor"] < 0.15, (np.mean(tails), header["floor"])
