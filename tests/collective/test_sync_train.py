"""Sync data-parallel training under real mpiexec.

The seeds' second exercise done for real: N ranks with per-rank batch B end
K steps with the same parameters as one process with batch N*B.
"""

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.models.run import checkpoint
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP = ["--model", "mlp", "--d-in", "12", "--d-hidden", "32", "--n-classes", "5",
       "--n-samples", "4096"]
LM = ["--model", "transformer", "--vocab", "16", "--seq-len", "16", "--d-model", "32",
      "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--n-tokens", "40000"]
STEPS = 5


def final_params(tmp_path, name, argv, n=None):
    """Run K steps (mpiexec -n n dtlab.collective.train, or dtlab.models.run.train when n is None)
    checkpointing at the end, and return the final flat parameters."""
    ck = str(tmp_path / name)
    args = [*argv, "--steps", str(STEPS), "--seed", "3", "--checkpoint-dir", ck,
            "--checkpoint-every", str(STEPS), "--warmup", "2", "--lr", "3e-3"]
    module = "dtlab.models.run.train" if n is None else "dtlab.collective.train"
    r = mpirun(n or 1, "-m", module, *args, timeout=120)
    assert r.rc == 0, r
    arrays, _ = checkpoint.load(checkpoint.latest(ck))
    return arrays["params"]


def rel_diff(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_n_ranks_batch_b_equal_one_process_batch_nb(tmp_path, model):
    argv, B = (MLP, 8) if model == "mlp" else (LM, 4)
    for n in (1, 2, 3, 4):
        single = final_params(tmp_path, f"single{n}", [*argv, "--batch-size", str(n * B)])
        sync = final_params(tmp_path, f"sync{n}", [*argv, "--batch-size", str(B),
                                                   "--bucket-mb", "0.004"], n=n)
        assert rel_diff(sync, single) < 1e-5, f"{model} n={n}: {rel_diff(sync, single):.2e}"


def test_gradient_accumulation_and_every_algorithm_agree(tmp_path):
    single = final_params(tmp_path, "single", [*MLP, "--batch-size", "32"])
    for algo in ("ring", "naive", "mpi"):
        sync = final_params(tmp_path, algo, [*MLP, "--batch-size", "4", "--grad-accum", "2",
                                             "--allreduce", algo, "--no-overlap"], n=4)
        assert rel_diff(sync, single) < 1e-5, f"{algo}: {rel_diff(sync, single):.2e}"


def test_metrics_split_compute_and_communication(tmp_path):
    path = tmp_path / "sync.jsonl"
    r = mpirun(2, "-m", "dtlab.collective.train", *MLP, "--steps", "4", "--metrics", str(path),
               timeout=120)
    assert r.rc == 0, r
    assert r.stdout.count("final training loss") == 1  # rank 0 only
    header, records = read_metrics(str(path))
    assert header["topology"] == "sync" and header["world"] == 2
    assert header["allreduce"] == "ring" and header["floor"] > 0
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]
    for rec in records:
        assert rec["comm_s"] > 0 and rec["wait_s"] >= 0 and rec["compute_s"] > 0


def test_bad_flag_ends_every_rank_with_the_message():
    r = mpirun(2, "-m", "dtlab.collective.train", "--bucket-mb", "0", timeout=60)
    assert r.rc != 0 and not r.timed_out
    assert "--bucket-mb must be positive" in r.stderr and "Traceback" not in r.stderr
