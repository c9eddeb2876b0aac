"""Tensor-split (Megatron-LM) layers, models and training under real mpiexec.

The serial twins (tests/support/mpi_progs/tp_twins.py) compare every split layer and
model with its dense twin in float64 at tp = 1, 2, 4; the training tests run
`dtlab.collective.train --dp a --tp b` and compare the dense parameters its
shards make up with single-process training on the same global batch.
"""

import inspect

import numpy as np
import pytest
from support.mpirun import mpirun
from support.twins import single_params

from dtlab.collective.comm import Communicator
from dtlab.models.comm import Comm
from dtlab.models.params import ParamSpec, initial_value
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

LM = ["--model", "transformer", "--vocab", "16", "--seq-len", "16", "--d-model", "32",
      "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--n-tokens", "40000"]
MLP = ["--model", "mlp", "--d-in", "12", "--d-hidden", "32", "--n-classes", "6",
       "--n-samples", "4096"]
RUN = ["--steps", "5", "--seed", "3", "--warmup", "2", "--lr", "3e-3"]


def test_collective_communicator_satisfies_the_models_protocol():
    members = [m for m in dir(Comm) if not m.startswith("_")]
    assert {"allreduce", "allgather", "broadcast", "send", "recv"} <= set(members)
    for name in members:
        want = inspect.signature(getattr(Comm, name))
        have = inspect.signature(getattr(Communicator, name))
        for p in want.parameters.values():
            q = have.parameters.get(p.name)
            assert q is not None, f"Communicator.{name} has no parameter {p.name}"
            assert (q.kind, q.default) == (p.kind, p.default), f"Communicator.{name}({p.name})"
    for attr in Comm.__annotations__:
        assert attr in inspect.getsource(Communicator.__init__), f"Communicator.{attr}"


@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_layers_and_models_equal_their_dense_twins(n):
    r = mpirun(n, "tests/support/mpi_progs/tp_twins.py", timeout=120)
    assert r.rc == 0 and f"PASS tp twins {n}" in r.stdout, r


def split_params(tmp_path, name, argv, dp, tp):
    out = tmp_path / f"{name}.npy"
    r = mpirun(dp * tp, "tests/support/mpi_progs/grid_train.py", out, "--dp", dp, "--tp", tp, *argv,
               *RUN, "--metrics", tmp_path / f"{name}.jsonl", timeout=120)
    assert r.rc == 0, r
    header, _ = read_metrics(str(tmp_path / f"{name}.jsonl"))
    return np.load(out), header


@pytest.mark.parametrize("argv,B,dp,tp", [
    (LM, 4, 1, 2),
    ([*LM, "--clip", "0.05"], 4, 2, 2),
    ([*LM, "--ffn", "swiglu", "--norm", "rmsnorm"], 4, 2, 2),
    (MLP, 8, 1, 2),
], ids=["lm-dp1-tp2", "lm-dp2-tp2", "lm-swiglu-dp2-tp2", "mlp-dp1-tp2"])
def test_dp_tp_training_equals_one_process_on_the_global_batch(tmp_path, argv, B, dp, tp):
    single = single_params(tmp_path, [*argv, *RUN, "--batch-size", str(dp * B)], 5)
    split, header = split_params(tmp_path, "split", [*argv, "--batch-size", str(B)], dp, tp)
    err = float(np.linalg.norm(split - single) / np.linalg.norm(single))
    assert err < 1e-5, f"dp {dp} tp {tp}: relative difference {err:.2e}"
    print(f"dp {dp} tp {tp}: relative difference {err:.2e}")
    assert header["tp"] == tp and header["dp"] == dp
    for key in ("param", "grad", "optimizer"):  # each rank holds about 1/tp of every buffer
        share = header[f"{key}_bytes"] / header[f"dense_{key}_bytes"]
        assert 1 / tp <= share < 1 / tp + 0.05, f"{key}: {share:.3f} of dense"


@pytest.mark.parametrize("n,flags,message", [
    (4, ["--dp", "3", "--tp", "2"], "--dp 3 --pp 1 --tp 2: grid dp=3"),
    (4, ["--tp", "3"], "--tp 3: pp=1 x ep=1 x tp=3 = 3 does not divide"),
    (2, ["--tp", "2", *LM, "--d-model", "24", "--n-heads", "3"],
     "--n-heads 3 is not divisible by --tp 2"),
    (2, ["--tp", "2", *LM, "--vocab", "15"], "--vocab 15 is not divisible by --tp 2"),
    (2, ["--tp", "2", *MLP, "--d-hidden", "33"], "--d-hidden 33 is not divisible by --tp 2"),
])
def test_bad_grids_and_splits_end_every_rank_with_a_named_error(n, flags, message):
    r = mpirun(n, "-m", "dtlab.collective.train", *flags, "--steps", "2", timeout=60)
    assert r.rc != 0 and not r.timed_out, r
    assert message in r.stderr and "Traceback" not in r.stderr, r


def test_a_split_run_resumes_exactly_from_its_per_rank_checkpoints(tmp_path):
    """Each tp rank saves its own shard (<dir>/tp<r>of<n>/); a resumed run ends with the
    parameters of an uninterrupted one, bit for bit; another split is refused by name."""
    argv = [*LM, "--batch-size", "4"]
    whole = tmp_path / "whole.npy"
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", whole, "--tp", "2", *argv, *RUN,
               timeout=120)
    assert r.rc == 0, r
    ck = ["--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "2"]
    first = [*argv, "--seed", "3", "--warmup", "2", "--lr", "3e-3"]
    r = mpirun(4, "-m", "dtlab.collective.train", "--dp", "2", "--tp", "2", *first,
               "--batch-size", "2", "--steps", "2", *ck, timeout=120)
    assert r.rc == 0, r
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["tp0of2", "tp1of2"]
    resumed = tmp_path / "resumed.npy"
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", resumed, "--tp", "2", *first,
               "--steps", "5",
               *ck, "--resume", timeout=120)
    assert r.rc != 0 and "config" in r.stderr, r  # dp 2 x batch 2 is not dp 1 x batch 4
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", resumed, "--tp", "2", *argv, *RUN,
               "--checkpoint-dir", tmp_path / "ck2", "--checkpoint-every", "2", "--steps", "2",
               timeout=120)
    assert r.rc == 0, r
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", resumed, "--tp", "2", *argv, *RUN,
               "--checkpoint-dir", tmp_path / "ck2", "--checkpoint-every", "2", "--resume",
               timeout=120)
    assert r.rc == 0 and "resumed from step 2" in r.stderr, r
    np.testing.assert_array_equal(np.load(resumed), np.load(whole))
    r = mpirun(2, "-m", "dtlab.collective.train", "--tp", "1", *argv, *RUN,
               "--checkpoint-dir", tmp_path / "ck2", "--resume", timeout=60)
    assert r.rc != 0 and "holds checkpoints of a run with --tp 2; this run has --pp 1 --tp 1" \
        in r.stderr, r


def test_a_fused_qkv_shard_starts_from_its_heads_columns_of_the_dense_tensor():
    d, heads, hs = 4, 4, 1  # (d, 3d) viewed as (d, q|k|v, heads, d_head); rank 1 of 2: heads 2, 3
    dense = initial_value(ParamSpec("a.qkv.W", (d, 3 * d)), seed=1)
    spec = ParamSpec("a.qkv.W", (d, 3 * 2 * hs), full_shape=(d, 3 * d), view=(d, 3, heads, hs),
                     index=(slice(None), slice(None), slice(2, 4), slice(None)), split="tp")
    want = np.concatenate([dense[:, 2:4], dense[:, 6:8], dense[:, 10:12]], axis=1)
    assert np.array_equal(initial_value(spec, seed=1), want)
    bad = ParamSpec("a.qkv.W", (d, 5), full_shape=(d, 3 * d), view=(d, 3, heads, hs),
                    index=(slice(None), slice(None), slice(2, 4), slice(None)))
    with pytest.raises(ValueError, match="parameter a.qkv.W: index of view"):
        initial_value(bad, seed=1)
