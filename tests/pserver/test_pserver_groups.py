"""Model-parallel replicas as parameter-server workers (pserver.server.partitions, group_worker).

Real shard servers on loopback ports, real `mpiexec` worker groups: a group
of pp=2 ranks and one of tp=2 x pp=2 ranks as one BSP worker land on the
parameters of single-process training with the same global batch (the
group's gradient clipped by its global norm), and two groups of pp=2 on
those of single-process training with the doubled batch; the servers' own
rules are checked through real clients: partitions that disagree with the
servers' are refused by name, SSP counts groups (and holds each partition's
bound), a server holding partitions refuses dense workers, checkpoints and resumes them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from support.mpirun import mpirun
from support.pserver_util import ONE_BLAS_THREAD, ROOT, addresses, serve

from dtlab.models.config import build
from dtlab.models.params import FlatParams, ParamSpec
from dtlab.models.run import checkpoint
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics
from dtlab.models.zoo import build_model, config_class
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.common.partition_specs import specs_json
from dtlab.pserver.worker.client import PSClient

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP_CFG = {"d_in": 12, "d_hidden": 32, "n_layers": 2, "n_classes": 6}
DATA = {"n_samples": 4096}
MLP = ["--model", "mlp", "--d-in", "12", "--d-hidden", "32", "--n-layers", "2",
       "--n-classes", "6", "--n-samples", "4096"]
LM_CFG = {"vocab": 16, "seq_len": 16, "d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64}
LM = ["--model", "transformer", "--vocab", "16", "--seq-len", "16", "--d-model", "32",
      "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--n-tokens", "40000"]
MODELS = {"mlp": (MLP, MLP_CFG, DATA), "lm": (LM, LM_CFG, {"n_tokens": 40000})}
K = 4
RUN = ["--steps", str(K), "--seed", "3"]
OPTIM = {"optimizer": "adam", "lr": 3e-3, "warmup": 2}


def single_params(tmp_path, flags: list[str], batch: int, clip: str) -> np.ndarray:
    ck = tmp_path / "single"
    subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *flags, *RUN,
                    "--optimizer", "adam", "--lr", "3e-3", "--warmup", "2", "--clip", clip,
                    "--batch-size", str(batch), "--checkpoint-dir", str(ck),
                    "--checkpoint-every", str(K)],
                   cwd=ROOT, check=True, timeout=120, capture_output=True, env=ONE_BLAS_THREAD)
    return checkpoint.load(checkpoint.latest(str(ck)))[0]["params"]


@pytest.mark.parametrize("model,groups,tp,pp,B,m,clip,schedule", [
    ("mlp", 1, 1, 2, 4, 2, "0.05", "1f1b"),
    ("lm", 1, 2, 2, 2, 4, "0.05", "zb-h1"),
    ("mlp", 2, 1, 2, 4, 2, "0", "gpipe"),
    ("mlp", 2, 2, 2, 2, 2, "0", "1f1b"),
], ids=["1group-pp2-clip", "lm-1group-tp2-pp2-zb-clip", "2groups-pp2", "2groups-tp2-pp2"])
def test_worker_groups_under_bsp_equal_one_process_on_the_global_batch(
        tmp_path, model, groups, tp, pp, B, m, clip, schedule):
    flags, model_cfg, data = MODELS[model]
    want = single_params(tmp_path, flags, groups * m * B, clip)
    out, metrics = tmp_path / "group.npy", tmp_path / "w{worker}.jsonl"
    with serve(shards=2, model=flags[1], model_cfg=model_cfg, data=data, optim=OPTIM,
               consistency="bsp", num_workers=groups, schedule_steps=K, seed=3) as daemons:
        r = mpirun(groups * tp * pp, "tests/support/mpi_progs/ps_group_train.py", out,
                   "--servers", addresses(daemons), "--tp", tp, "--pp", pp, *flags, *RUN,
                   "--clip", clip, "--batch-size", B, "--grad-accum", m,
                   "--pp-schedule", schedule, "--metrics", metrics, timeout=120)
        assert r.rc == 0, str(r)
        held = [d.partitions.known for d in daemons]
        versions = {k: [h[k].servicer.store.version for h in held] for k in held[0]}
    got = np.load(out)
    err = float(np.abs(got - want).max())
    print(f"{model}: {groups} group(s) of tp {tp} x pp {pp} ({schedule}): max |difference| "
          f"{err:.2e}")
    assert err < 1e-5, err
    assert sorted(versions) == list(range(tp * pp))  # every partition on every shard ...
    assert all(v == [K, K] for v in versions.values())  # ... one update per BSP round
    for g in range(groups):
        header, records = read_metrics(str(tmp_path / f"w{g}.jsonl"))
        assert (header["worker"], header["tp"], header["pp"]) == (g, tp, pp)
        assert len(records) == K and all(max(rec["staleness"]) == 0 for rec in records)
        if float(clip):  # the group's global norm was over the bound: clipping took part
            assert all(rec["grad_norm"] > float(clip) for rec in records)


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_a_worker_group_in_mixed_precision_trains_as_one_process_does(tmp_path, wire_dtype):
    """A tp 2 x pp 2 group with --precision bf16 under BSP: with a float32 wire its
    parameters end as single-process bf16 training's (the servers' optimizer is the
    trainer's); with --wire bf16 the pushed gradients and pulled parameters are rounded
    once more each step, so only close to it."""
    B, m = 4, 2
    want = single_params(tmp_path, [*MLP, "--precision", "bf16", "--grad-accum", str(m)], B,
                         "0")
    out, metrics = tmp_path / "group.npy", tmp_path / "w{worker}.jsonl"
    with serve(shards=2, model="mlp", model_cfg=MLP_CFG, data=DATA, optim=OPTIM,
               consistency="bsp", num_workers=1, schedule_steps=K, seed=3) as daemons:
        r = mpirun(4, "tests/support/mpi_progs/ps_group_train.py", out, "--servers",
                   addresses(daemons), "--tp", "2", "--pp", "2", *MLP, *RUN, "--clip", "0",
                   "--batch-size", B, "--grad-accum", m, "--precision", "bf16",
                   "--wire", wire_dtype, "--metrics", metrics, timeout=120)
        assert r.rc == 0, str(r)
    err = float(np.abs(np.load(out) - want).max())
    print(f"tp 2 x pp 2 group, bf16, {wire_dtype} wire: max |difference| {err:.2e}")
    assert err < (1e-5 if wire_dtype == "fp32" else 2e-2), err
    records = read_metrics(str(tmp_path / "w0.jsonl"))[1]
    assert len(records) == K and all("loss_scale" in rec for rec in records)
    # partition 0 (tp rank 0 of stage 0: rows 0..15 of the first layer, its bias half) moves
    # its elements each way at 4 bytes, or 2 on a bf16 wire
    elements = 12 * 16 + 16
    size = 2 if wire_dtype == "bf16" else 4
    assert all(rec["push_bytes"] == rec["pull_bytes"] == elements * size for rec in records)


# -- the servers' rules, through real clients ---------------------------------------------

def dense_specs() -> list[ParamSpec]:
    return build_model("mlp", build(config_class("mlp"), dict(MLP_CFG))).specs()


def halves() -> list[list[ParamSpec]]:
    """Two partitions of the MLP: the first tensor's rows split in two (as a tp split
    indexes it), then the rest whole."""
    first, *rest = dense_specs()
    rows = first.shape[0] // 2
    top = ParamSpec(first.name, (rows, *first.shape[1:]), first.init, first.std, first.decay,
                    full_shape=first.shape, index=(slice(0, rows, None),), split="tp")
    return [[top], rest]


def client(servers: str, group: int, pid: int, specs: list[ParamSpec], count: int = 2,
           rpc_timeout_s: float = 20.0, transport: str = "session", shm: bool = True) -> PSClient:
    flat = FlatParams(specs, seed=3, xp=np)
    c = PSClient(build(ClientConfig, {"servers": servers, "connect_timeout_s": 20.0,
                                      "rpc_timeout_s": rpc_timeout_s}),
                 transport=transport, shm=shm,
                 partition=pb.PartitionLayout(id=pid, count=count, specs=specs_json(specs)))
    c.connect(group, "mlp", flat.size, wire.layout_crc(specs))
    c.flat = flat
    return c


def test_partitions_start_from_the_seeded_values_and_disagreeing_ones_are_refused():
    parts = halves()
    with serve(shards=2, model_cfg=MLP_CFG, seed=3) as daemons:
        servers = addresses(daemons)
        c0 = client(servers, 0, 0, parts[0])
        try:
            got = np.empty(c0.flat.size, np.float32)
            c0.pull(got)  # the server built partition 0 as the rank builds its own buffer
            np.testing.assert_array_equal(got, c0.flat.data)
            top = parts[0][0]
            other = [dataclasses.replace(top, index=(slice(1, 1 + top.shape[0], None),))]
            with pytest.raises(grpc.RpcError, match="partition 0 of worker group 1 differs"):
                client(servers, 1, 0, other)
            with pytest.raises(grpc.RpcError, match="worker group 1 has 4 partitions"):
                client(servers, 1, 1, parts[1], count=4)
            alien = [ParamSpec("nope", (3,))]
            with pytest.raises(grpc.RpcError, match="nope is not a tensor of the server's"):
                client(servers, 1, 1, alien)
            flat = FlatParams(dense_specs(), seed=3, xp=np)
            dense = PSClient(build(ClientConfig, {"servers": servers}))
            try:
                with pytest.raises(grpc.RpcError, match="a dense worker cannot join them"):
                    dense.connect(5, "mlp", flat.size, wire.layout_crc(flat.specs))
            finally:
                dense.close()
        finally:
            c0.close()


def test_partitions_are_checkpointed_and_a_resumed_server_holds_them_again(tmp_path):
    """SaveCheckpoint and shutdown write every partition's store; --resume makes them again
    from their specs with the saved values, clocks and versions, before any group joins."""
    parts, ck = halves(), str(tmp_path / "ck")
    pulled = []
    with serve(shards=2, model_cfg=MLP_CFG, seed=3, checkpoint_dir=ck) as daemons:
        clients = [client(addresses(daemons), 0, pid, parts[pid]) for pid in (0, 1)]
        try:
            for c in clients:
                start = np.empty(c.flat.size, np.float32)
                c.pull(start)
                c.push(np.full(c.flat.size, 0.5, np.float32), 0)
                after = np.empty_like(start)
                c.pull(after)
                assert not np.array_equal(after, start)  # the push was applied
                pulled.append(after)
            reply = clients[0].shards[0].save_checkpoint()
            assert reply.path.endswith("shard-0-of-2") and reply.version == 2  # 1 per partition
            assert sorted(os.listdir(reply.path)) == ["partition-0-of-2", "partition-1-of-2"]
        finally:
            for c in clients:
                c.close()
    with serve(shards=2, model_cfg=MLP_CFG, seed=3, checkpoint_dir=ck, resume=True) as daemons:
        flat = FlatParams(dense_specs(), seed=3, xp=np)
        dense = PSClient(build(ClientConfig, {"servers": addresses(daemons)}))
        try:
            with pytest.raises(grpc.RpcError, match="a dense worker cannot join them"):
                dense.connect(5, "mlp", flat.size, wire.layout_crc(flat.specs))
        finally:
            dense.close()
        clients = [client(addresses(daemons), 0, pid, parts[pid]) for pid in (0, 1)]
        try:
            for c, want in zip(clients, pulled, strict=True):
                got = np.empty_like(want)
                c.pull(got)
                np.testing.assert_array_equal(got, want)
                assert [s.stats().version for s in c.shards] == [1, 1]
        finally:
            for c in clients:
                c.close()


def test_a_server_that_trained_a_dense_worker_refuses_groups():
    with serve(shards=1, model_cfg=MLP_CFG, seed=3) as daemons:
        flat = FlatParams(dense_specs(), seed=3, xp=np)
        dense = PSClient(build(ClientConfig, {"servers": addresses(daemons)}))
        try:
            dense.connect(0, "mlp", flat.size, wire.layout_crc(flat.specs))
            with pytest.raises(grpc.RpcError, match="this server trains the dense model"):
                client(addresses(daemons), 1, 0, halves()[0])
        finally:
            dense.close()


@pytest.mark.parametrize("transport,shm", [("session", True), ("session", False),
                                           ("calls", False)])
def test_ssp_counts_groups_and_holds_each_partitions_bound(transport, shm):
    parts = halves()
    how = {"transport": transport, "shm": shm}
    with serve(shards=2, model_cfg=MLP_CFG, seed=3, consistency="ssp", staleness=1,
               num_workers=2) as daemons:
        servers = addresses(daemons)
        fast = [client(servers, 0, k, parts[k], rpc_timeout_s=1.0, **how) for k in range(2)]
        slow = [client(servers, 1, k, parts[k], **how) for k in range(2)]
        try:
            bufs = [np.empty(c.flat.size, np.float32) for c in fast]
            for step in range(2):  # group 0 runs 2 clocks ahead of group 1 on both partitions
                for c, b in zip(fast, bufs, strict=True):
                    c.pull(b)
                    c.push(np.ones_like(b), step)
            for c, b in zip(fast, bufs, strict=True):  # lead 2 > s = 1: held, then timed out
                with pytest.raises(grpc.RpcError, match="DEADLINE_EXCEEDED"):
                    c.pull(b)
            got = {}
            patient = client(servers, 0, 0, parts[0], **how)  # group 0's partition 0 again
            fast.append(patient)
            waiting = threading.Thread(target=lambda: got.setdefault(0, patient.pull(bufs[0])))
            waiting.start()
            sb = np.empty(slow[0].flat.size, np.float32)
            slow[0].pull(sb)
            slow[0].push(np.ones_like(sb), 0)  # group 1's partition 0: group 0 may read it
            waiting.join(20)
            assert not waiting.is_alive() and 0 in got
            with pytest.raises(grpc.RpcError, match="DEADLINE_EXCEEDED"):  # partition 1: not yet
                fast[1].pull(bufs[1])
            for d in daemons:
                for k, known in d.partitions.known.items():
                    st = known.servicer.store.stats()
                    assert sorted(st.workers) == [0, 1]  # groups, not ranks
                    assert st.max_clock_lead <= 1
                    assert st.workers[0].clock == 2
                    assert st.workers[1].clock == (1 if k == 0 else 0)
        finally:
            for c in fast + slow:
                c.close()


def test_a_launched_group_whose_partitions_differ_is_refused_and_the_job_ends(tmp_path):
    """dtlab-worker under real mpiexec: a pp=2 group trains; a tp=2 group (two partitions
    too, split otherwise) is refused by name, and every rank of its job ends."""
    with serve(shards=2, model_cfg=MLP_CFG, data=DATA, optim=OPTIM, seed=3) as daemons:
        common = ["-m", "dtlab.pserver.worker", "--servers", addresses(daemons), *MLP, *RUN,
                  "--metrics", tmp_path / "w{worker}.jsonl"]
        r = mpirun(2, *common, "--pp", "2", wrap=False, timeout=60)
        assert r.rc == 0, str(r)
        r = mpirun(2, *common, "--tp", "2", "--worker-id", "1", "--num-workers", "2",
                   wrap=False, timeout=60)
        assert r.rc != 0 and not r.timed_out, str(r)
        assert "partition 0 of worker group 1 differs from the partition 0" in r.stderr, str(r)
        assert [len(d.partitions.known) for d in daemons] == [2, 2]


def test_two_launched_groups_under_ssp_are_two_workers_within_the_bound(tmp_path):
    steps = 8
    with serve(shards=2, model_cfg=MLP_CFG, data=DATA, optim=OPTIM, seed=3, consistency="ssp",
               staleness=1, num_workers=2) as daemons:
        r = mpirun(4, "-m", "dtlab.pserver.worker", "--servers", addresses(daemons), *MLP,
                   "--steps", str(steps), "--seed", "3", "--pp", "2", "--grad-accum", "2",
                   "--metrics", tmp_path / "w{worker}.jsonl", wrap=False, timeout=90)
        assert r.rc == 0, str(r)
        for d in daemons:
            assert sorted(d.partitions.known) == [0, 1]
            for known in d.partitions.known.values():
                st = known.servicer.store.stats()
                assert sorted(st.workers) == [0, 1]  # the 2 groups, not the 4 ranks
                assert all(w.clock == steps for w in st.workers.values())
                assert st.updates == 2 * steps and st.max_clock_lead <= 1
    for g in range(2):
        header, records = read_metrics(str(tmp_path / f"w{g}.jsonl"))
        assert header["consistency"] == "ssp" and len(records) == steps


def test_sigterm_ends_a_group_after_a_whole_step_on_every_rank(tmp_path):
    """mpiexec forwards SIGTERM to every rank: the group agrees on the step to stop after,
    pushes it on every partition, leaves and exits 0."""
    metrics = tmp_path / "w.jsonl"
    with serve(shards=2, model_cfg=MLP_CFG, data=DATA, optim=OPTIM, seed=3) as daemons:
        proc = subprocess.Popen(
            [mpiexec_path(), "-n", "2", sys.executable, "-m", "dtlab.pserver.worker",
             "--servers", addresses(daemons), *MLP, "--steps", "1000000", "--seed", "3",
             "--pp", "2", "--log-every", "20", "--metrics", str(metrics)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env=ONE_BLAS_THREAD)
        try:
            deadline = time.monotonic() + 60
            while not (metrics.exists() and len(metrics.read_text().splitlines()) > 20):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        assert proc.returncode == 0, err
        assert "stopped by SIGTERM after step" in err, err
        steps = len(read_metrics(str(metrics))[1])
        for d in daemons:  # every step of the group applied on both partitions, none lost
            assert [k.servicer.store.version for k in d.partitions.known.values()] == [steps] * 2
            assert all(not w.active for k in d.partitions.known.values()
                       for w in k.servicer.store.stats().workers.values())
