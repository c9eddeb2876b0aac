"""Pipelined models and training under real mpiexec (models/pipeline.py).

The serial twins (tests/support/mpi_progs/pp_twins.py) compare each stage's loss,
gradients and the global gradient norm with the dense model in float64, for
every schedule (interleaved 1F1B, ZB-V and DualPipeV with 2 chunks per rank), at
pp = 2 and 4 and at pp 2 x tp 2; the training tests run
`dtlab.collective.train --dp a --pp c --tp b` and compare the dense
parameters its stages and shards make up with single-process training on the
same global batch.
"""

import numpy as np
import pytest
from support.mpirun import mpirun
from support.twins import single_params

from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

LM = ["--model", "transformer", "--vocab", "16", "--seq-len", "16", "--d-model", "32",
      "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--n-tokens", "40000"]
MLP = ["--model", "mlp", "--d-in", "12", "--d-hidden", "32", "--n-classes", "6",
       "--n-samples", "4096"]
RUN = ["--steps", "5", "--seed", "3", "--warmup", "2", "--lr", "3e-3"]


@pytest.mark.parametrize("n,tp", [(2, 1), (4, 1), (4, 2)])
def test_pipelined_models_equal_their_dense_twins(n, tp):
    r = mpirun(n, "tests/support/mpi_progs/pp_twins.py", "--tp", tp, timeout=120)
    assert r.rc == 0 and "PASS pp twins" in r.stdout, r
    print(r.stdout)


def grid_params(tmp_path, argv, dp, pp, tp):
    out, metrics = tmp_path / "grid.npy", tmp_path / "grid.jsonl"
    r = mpirun(dp * pp * tp, "tests/support/mpi_progs/grid_train.py", out, "--dp", dp, "--pp", pp,
               "--tp", tp, *argv, *RUN, "--metrics", metrics, timeout=240)
    assert r.rc == 0, r
    header, records = read_metrics(str(metrics))
    return np.load(out), header, records


@pytest.mark.parametrize("argv,B,m,dp,pp,tp", [
    ([*LM, "--clip", "0.05", "--pp-schedule", "zb-h1"], 2, 4, 2, 2, 2),
    ([*LM, "--pp-schedule", "gpipe", "--ffn", "swiglu"], 4, 2, 1, 2, 1),
    ([*MLP, "--pp-schedule", "1f1b", "--stages", "1,2,1,1"], 4, 3, 1, 4, 1),
], ids=["lm-dp2-pp2-tp2-zb", "lm-pp2-gpipe", "mlp-pp4-1f1b-stages"])
def test_grid_training_equals_one_process_on_the_global_batch(tmp_path, argv, B, m, dp, pp,
                                                              tp):
    single_argv = [a for a in argv if a not in ("--pp-schedule", "zb-h1", "gpipe", "1f1b")]
    if "--stages" in single_argv:
        i = single_argv.index("--stages")
        del single_argv[i:i + 2]
    single = single_params(tmp_path, [*single_argv, *RUN, "--batch-size", str(dp * m * B)], 5)
    split, header, records = grid_params(
        tmp_path, [*argv, "--batch-size", str(B), "--grad-accum", str(m)], dp, pp, tp)
    err = float(np.linalg.norm(split - single) / np.linalg.norm(single))
    print(f"dp {dp} pp {pp} tp {tp}: relative difference {err:.2e}")
    assert err < 1e-5, f"dp {dp} pp {pp} tp {tp}: relative difference {err:.2e}"
    assert (header["dp"], header["pp"], header["tp"]) == (dp, pp, tp)
    assert all(0.0 <= r["bubble"] < 1.0 for r in records)


@pytest.mark.parametrize("schedule", [["interleaved", "--virtual-stages", "2"], ["zb-v"],
                                      ["dualpipev"]], ids=lambda s: s[0])
def test_two_chunk_schedules_train_as_one_process_bit_for_bit(tmp_path, schedule):
    """`dtlab-sync --pp 2 --pp-schedule S`: the model in 4 stages, 2 chunks on each rank
    (interleaved: stages r and 2 + r; ZB-V and DualPipeV: r and 3 - r), against dtlab-train
    on the same micro-batches (--grad-accum m). Each gradient accumulates the
    micro-batches in the dense order and the optimizer is elementwise, so with --clip 0
    (the clip norm sums the stages' squares in another order) the parameters are equal
    bit for bit."""
    argv = [*LM, "--n-layers", "3", "--clip", "0", "--batch-size", "2", "--grad-accum", "4"]
    single = single_params(tmp_path, [*argv, *RUN], 5)
    split, header, records = grid_params(tmp_path, [*argv, "--pp-schedule", *schedule],
                                         1, 2, 1)
    np.testing.assert_array_equal(split, single)
    assert all(0.0 <= r["bubble"] < 1.0 for r in records)


@pytest.mark.parametrize("n,flags,message", [
    (4, ["--pp", "3"], "--pp 3 --tp 1: pp=3 x ep=1 x tp=1 = 3 does not divide"),
    (2, ["--pp", "2", *MLP, "--n-layers", "0"], "--pp 2 is more stages than the model's 1"),
    (2, ["--pp", "2", *MLP, "--stages", "1,1"], "--stages '1,1': needs 2 positive counts"),
    (2, [*MLP, "--stages", "2,3"], "--stages 2,3 has no effect without --pp"),
    (2, ["--pp", "2", *MLP, "--pp-schedule", "pipedream"], "invalid choice: 'pipedream'"),
    (2, ["--pp", "2", *MLP, "--virtual-stages", "2"],
     "--virtual-stages 2: 1f1b runs 1 model chunk(s) per rank, not 2 virtual stages"),
    (2, ["--pp", "2", *MLP, "--pp-schedule", "interleaved", "--grad-accum", "3"],
     "--pp-schedule interleaved runs micro-batches in groups of --pp 2: --grad-accum 3"),
    (2, ["--pp", "2", *MLP, "--pp-schedule", "dualpipev", "--grad-accum", "3"],
     "--pp-schedule dualpipev --pp 2 --grad-accum 3: DualPipeV needs at least 2p = 4"),
])
def test_bad_pipelines_end_every_rank_with_a_named_error(n, flags, message):
    r = mpirun(n, "-m", "dtlab.collective.train", *flags, "--steps", "2", timeout=60)
    assert r.rc == 2 and not r.timed_out, r
    assert message in r.stderr and "Traceback" not in r.stderr, r


def test_a_pipelined_run_resumes_exactly_from_its_per_rank_checkpoints(tmp_path):
    """Each (pp, tp) rank saves its own part (<dir>/pp<r>of<n>/); a resumed run ends with
    the parameters of an uninterrupted one, bit for bit; another grid is refused by name."""
    argv = [*MLP, "--batch-size", "4", "--grad-accum", "2", "--pp", "2", *RUN]
    whole, resumed = tmp_path / "whole.npy", tmp_path / "resumed.npy"
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", whole, *argv, timeout=120)
    assert r.rc == 0, r
    ck = ["--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "2"]
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", resumed, *argv, *ck, "--steps", "2",
               timeout=120)
    assert r.rc == 0, r
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["pp0of2", "pp1of2"]
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", resumed, *argv, *ck, "--resume",
               timeout=120)
    assert r.rc == 0 and "resumed from step 2" in r.stderr, r
    np.testing.assert_array_equal(np.load(resumed), np.load(whole))
    r = mpirun(2, "-m", "dtlab.collective.train", *argv[:-len(RUN) - 2], "--tp", "2",
               "--d-hidden", "32", *RUN, *ck, "--resume", timeout=60)
    assert r.rc != 0 and "holds checkpoints of a run with --pp 2; this run has --tp 2" \
        in r.stderr, r
