"""ZeRO stages 1-3 (dtlab-sync --zero S) train exactly what plain data parallelism trains.

Each launch trains every case in one mpiexec (tests/support/mpi_progs/zero_cases.py) and
saves the whole final parameters. At dp 2 with one micro-batch and no clipping the
order of every sum is plain DP's (the ring adds two contributions, a + b = b + a; each
unit's reduce-scatter is the all-reduce's first half), so stages 1, 2 and 3 end bit for
bit on its parameters, in float32 and in bf16 and fp16 mixed precision (loss-scaled), with
the parameters resharded after forward or not, with and without the helper thread. With accumulation
(stages 2 and 3 reduce every micro-batch, plain DP sums them locally first), clipping (the
norm from the shards' squares) or dp 3 (units cut in uneven segments, so the ring's order
of additions differs from the all-reduce's) the sums are reordered: float64 runs then agree
with plain DP and with one process on the global batch within 1e-12 relative (the largest
difference measured: 3e-16).

Checkpoints (collective/zero/checkpoint.py): a run stopped after 2 of 4 steps (the warm-up
spans both, so the lr schedule does not depend on --steps) and resumed ends bit for bit on
the uninterrupted run, every stage and plain DP, in float64 with accumulation and clipping
and in fp16 (its loss scale saved); a stage-1 checkpoint resumes into stage 3 and a plain
DP one into stage 2. At another dp size (2 -> 3 -> 2) the resumed parameters are exactly
the saved ones, and the run then trains as plain DP resumed at that size does.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from mpi4py import MPI
from support.mpirun import mpirun

from dtlab.collective.comm import Communicator
from dtlab.collective.train import parse_args
from dtlab.collective.zero.checkpoint import recut
from dtlab.collective.zero.layout import Layout, units_of
from dtlab.collective.zero.trainer import ZeroTrainer, shard_session
from dtlab.models.config import ConfigError
from dtlab.models.cost import zero_traffic
from dtlab.models.run import checkpoint
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.metrics import MetricsLog, read_metrics
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.trainer import Trainer

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/zero_cases.py"
MLP = ["--model", "mlp", "--d-in", "7", "--d-hidden", "10", "--n-layers", "2",
       "--n-classes", "5", "--n-samples", "512"]
LM = ["--model", "transformer", "--vocab", "11", "--seq-len", "6", "--d-model", "8",
      "--n-heads", "2", "--n-layers", "2", "--d-ff", "12", "--n-tokens", "3000"]
RUN = ["--steps", "4", "--seed", "3", "--warmup", "2", "--lr", "3e-3", "--log-every", "100"]
B = 4  # examples per micro-batch and rank
EXACT = {"clip": ["--clip", "0"],
         "bf16": ["--clip", "0", "--precision", "bf16"],
         "fp16": ["--clip", "0", "--precision", "fp16", "--loss-scale", "1e6"]}
# reordered sums: float64, two micro-batches, a clip that acts (the norms are above it)
REORDERED = ["--dtype", "float64", "--grad-accum", "2", "--clip", "0.05"]
STAGES = ("0", "1", "2", "3")


def case(name: str, model: list, extra: list, zero: str, metrics=None) -> dict:
    argv = [*model, *RUN, "--batch-size", str(B), *extra, "--zero", zero]
    return {"name": name, "argv": argv + (["--metrics", str(metrics)] if metrics else [])}


def resumed(name: str, zero: str, directory, steps: int, model=MLP, extra=REORDERED,
            resume: bool = True, copy=None) -> dict:
    """A case checkpointing every 2 steps into `directory` (after copying `copy` there)."""
    c = case(name, model, [*extra, "--steps", str(steps), "--checkpoint-dir", str(directory),
                           "--checkpoint-every", "2", *(["--resume"] if resume else [])], zero)
    return {**c, "copy": [str(copy), str(directory)]} if copy else c


def launch(tmp_path, n: int, cases: list[dict], timeout: float = 90,
           name: str = "") -> tuple[dict, str]:
    """(every case's final parameters, the launch's stderr)."""
    path, out = tmp_path / f"cases{n}{name}.json", tmp_path / f"out{n}{name}.npz"
    path.write_text(json.dumps(cases))
    r = mpirun(n, PROG, str(path), str(out), timeout=timeout)
    assert r.rc == 0, r
    with np.load(out) as f:
        return dict(f), r.stderr


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    cases = []
    for label, model in (("mlp", MLP), ("lm", LM)):
        for kind, extra in (*EXACT.items(), ("f64", REORDERED)):
            cases += [case(f"{label}-{kind}-z{z}", model, extra, z, tmp / f"{label}-{kind}-{z}")
                      for z in STAGES]
    cases += [case("lm-clip-z3-keep", LM, EXACT["clip"] + ["--no-zero-reshard-after-forward"],
                   "3"),
              case("mlp-clip-z3-inline", MLP, EXACT["clip"] + ["--no-overlap"], "3")]
    # checkpoints: C<z> stopped after 2 steps, then (copied) into another stage, resumed to 4
    cases += [resumed(f"half-z{z}", z, tmp / f"C{z}", 2, resume=False) for z in STAGES]
    cases += [resumed("x-0to2", "2", tmp / "X0", 4, copy=tmp / "C0"),
              resumed("x-1to3", "3", tmp / "X1", 4, copy=tmp / "C1")]
    cases += [resumed(f"resume-z{z}", z, tmp / f"C{z}", 4) for z in STAGES]
    cases += [resumed(f"{kind}-fp16-z1", "1", tmp / "F", steps, LM, EXACT["fp16"], resume)
              for kind, steps, resume in (("half", 2, False), ("resume", 4, True))]
    return tmp, launch(tmp, 2, cases)[0]


@pytest.fixture(scope="module")
def dp3(tmp_path_factory, dp2):
    """Also: dp 2's checkpoints C<z> (newest: step 4) resumed at dp 3, as they are and
    trained on to step 6 (saved)."""
    tmp, ck = tmp_path_factory.mktemp("dp3"), dp2[0]
    cases = [case(f"{label}-f64-z{z}", model, REORDERED, z, tmp / f"{label}-f64-{z}")
             for label, model in (("mlp", MLP), ("lm", LM)) for z in STAGES]
    cases += [resumed(f"same3-z{z}", z, ck / f"C{z}", 4) for z in STAGES[1:]]
    cases += [resumed(f"u3-z{z}", z, ck / f"C{z}", 6) for z in STAGES]
    out, stderr = launch(tmp, 3, cases)
    assert "(its ZeRO shards over dp 2 cut again for dp 3)" in stderr
    return tmp, out


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp4")
    cases = [case(f"{label}-f64-z{z}", model, REORDERED, z, tmp / f"{label}-f64-{z}")
             for label, model in (("mlp", MLP), ("lm", LM)) for z in STAGES]
    return tmp, launch(tmp, 4, cases)[0]


@pytest.fixture(scope="module")
def back2(tmp_path_factory, dp2, dp3):
    """dp 3's checkpoints of step 6 (newer than dp 2's of step 4) resumed at dp 2."""
    tmp, ck = tmp_path_factory.mktemp("back2"), dp2[0]
    out, stderr = launch(tmp, 2, [resumed(f"back2-z{z}", z, ck / f"C{z}", 6)
                                  for z in STAGES[1:]])
    assert "(its ZeRO shards over dp 3 cut again for dp 2)" in stderr
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process on the global batch of dp N: all N B k examples in one batch."""
    tmp = tmp_path_factory.mktemp("single")
    cases = []
    for n in (2, 3, 4):
        for label, model in (("mlp", MLP), ("lm", LM)):
            c = case(f"{label}-{n}", model, REORDERED, "0")
            argv = c["argv"][:-2]  # no --zero: the single-process trainer
            argv[argv.index("--batch-size") + 1] = str(n * B * 2)
            argv[argv.index("--grad-accum") + 1] = "1"
            cases.append({"name": c["name"], "argv": argv, "single": True})
    return launch(tmp, 1, cases)[0]


@pytest.mark.parametrize("label", ["mlp", "lm"])
@pytest.mark.parametrize("kind", list(EXACT))
def test_stages_end_bit_for_bit_on_plain_dp_at_dp2(dp2, label, kind):
    _, out = dp2
    plain = out[f"{label}-{kind}-z0"]
    for z in STAGES[1:]:
        assert np.array_equal(out[f"{label}-{kind}-z{z}"], plain), (label, kind, z)
    assert not np.array_equal(plain, out[f"{label}-f64-z0"].astype(plain.dtype))  # it trained


def test_stage3_kept_after_forward_and_inline_are_bit_for_bit(dp2):
    _, out = dp2
    assert np.array_equal(out["lm-clip-z3-keep"], out["lm-clip-z0"])
    assert np.array_equal(out["mlp-clip-z3-inline"], out["mlp-clip-z0"])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("label", ["mlp", "lm"])
def test_reordered_sums_agree_in_float64(dp2, dp3, dp4, single, n, label):
    out = {2: dp2, 3: dp3, 4: dp4}[n][1]
    plain, one = out[f"{label}-f64-z0"], single[f"{label}-{n}"]
    assert rel(plain, one) < 1e-12
    for z in STAGES[1:]:
        got = out[f"{label}-f64-z{z}"]
        assert got.dtype == np.float64
        assert rel(got, plain) < 1e-12, (n, label, z, rel(got, plain))
        assert rel(got, one) < 1e-12, (n, label, z, rel(got, one))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sent_bytes_and_memory_against_the_formulas(dp2, dp3, dp4, n):
    tmp = {2: dp2, 3: dp3, 4: dp4}[n][0]
    for label in ("mlp", "lm"):
        for z in STAGES:
            header, records = read_metrics(str(tmp / f"{label}-f64-{z}"))
            psi, sent = header["n_params"], records[-1]["sent_bytes"]
            formula = zero_traffic(psi, int(z), n, micro_batches=2, itemsize=8)
            assert header["zero"] == int(z)
            # segments differ by at most one element: a few elements per unit and call
            assert abs(sent - formula) <= 8 * 3 * 2 * 8, (label, z, sent, formula)
            if z == "0":
                continue
            # fp32-style accounting at 8 bytes: weights 8, grads 8, Adam's two states 16 per
            # parameter, this rank's segments at most one element over Psi / N per unit
            memory, units = header["zero_bytes"], len(header["zero_units"])
            for key, kind, per in (("weight_bytes", "weights", 8), ("grad_bytes", "grads", 8),
                                   ("optimizer_bytes", "optimizer", 16),
                                   ("total_bytes", "total", 32)):
                assert abs(memory[key] - memory["formula"][kind]) <= units * per, key


@pytest.mark.parametrize("reshard", [True, False])
def test_stage3_holds_only_what_a_unit_needs(reshard):
    """One rank (a real world of size 1): after a step no unit's parameters or gradient
    remain gathered; the pools held two units at most when resharding, all of them when
    the parameters are kept from forward to backward; a read outside a unit is named."""
    setup = parse_args([*LM, "--zero", "3", "--batch-size", "2"]
                       + ([] if reshard else ["--no-zero-reshard-after-forward"]))
    session, reducer, zero = shard_session(build_session(setup),
                                           Communicator(MPI.COMM_SELF, name="self"), 3, reshard)
    try:
        session.replica.compute_grads(session.loader.next(), reducer.ready)
        reducer.wait()
        P, hooks, largest = zero.P, zero.hooks, zero.layout.largest
        assert P.params == {} and P.grads == {} and hooks.gathered == {}
        units = len(zero.layout.units)
        assert hooks.param_pool.made == (2 if reshard else units)
        assert hooks.grad_pool.made <= 2 and hooks.nbytes <= (units + 2) * largest * 4
        with pytest.raises(RuntimeError, match="parameter wte.W is not gathered"):
            P["wte.W"]
    finally:
        reducer.close()


@pytest.mark.parametrize("flags, words", [
    (["--zero", "3", "--pp", "2"], "--zero 3 with --pp 2"),
    (["--zero", "2", "--model", "transformer", "--moe-experts", "4", "--moe-bias-rate",
      "1e-3"], "--moe-bias-rate 0.001: the router's selection-bias steps"),
    (["--zero", "3", "--allreduce", "mpi"], "--allreduce mpi has no effect"),
    (["--zero", "1", "--bucket-mb", "5"], "--bucket-mb 5.0 has no effect"),
    (["--zero", "2", "--no-zero-reshard-after-forward"], "without --zero 3"),
    (["--zero-reshard-after-forward"], "--zero-reshard-after-forward has no effect"),
])
def test_unsupported_combinations_are_refused_by_name(flags, words):
    with pytest.raises(ConfigError, match=words):
        parse_args(flags)


def test_refusal_ends_the_job_with_one_line():
    r = mpirun(2, "-m", "dtlab.collective.train", *MLP, "--zero", "3", "--pp", "2",
               timeout=60)
    assert r.rc == 2 and not r.timed_out, r
    assert "--zero 3 with --pp 2" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("z", STAGES)
def test_a_stopped_run_resumes_bit_for_bit(dp2, z):
    _, out = dp2
    full = out[f"mlp-f64-z{z}"]
    assert not np.array_equal(out[f"half-z{z}"], full)
    assert np.array_equal(out[f"resume-z{z}"], full), z
    if z == "1":
        assert np.array_equal(out["resume-fp16-z1"], out["lm-fp16-z1"])


def test_resume_into_another_stage_and_from_plain_dp(dp2):
    _, out = dp2
    assert rel(out["x-0to2"], out["mlp-f64-z2"]) < 1e-12
    assert rel(out["x-1to3"], out["mlp-f64-z3"]) < 1e-12
    assert not np.array_equal(out["x-1to3"], out["half-z1"])


@pytest.mark.parametrize("z", STAGES[1:])
def test_resume_at_another_dp_size_holds_the_saved_parameters(dp2, dp3, back2, z):
    assert np.array_equal(dp3[1][f"same3-z{z}"], dp2[1][f"resume-z{z}"])  # dp 2 -> 3
    assert np.array_equal(back2[f"back2-z{z}"], dp3[1][f"u3-z{z}"])  # dp 3 -> 2
    # trained on at dp 3 from the re-cut optimizer state: as plain DP resumed at dp 3
    plain = dp3[1]["u3-z0"]
    assert not np.array_equal(plain, dp2[1]["resume-z0"])
    assert rel(dp3[1][f"u3-z{z}"], plain) < 1e-12


def gathered(path: str) -> dict:
    """Every buffer of a ZeRO checkpoint's step directory under each shard's `path`
    (one per rank: dp<q>of<n>/step-...), put whole by each shard's own ranges."""
    out = {}
    for q in range(checkpoint.load(path.format(q=0))[1]["zero"]["dp"]):
        arrays, meta = checkpoint.load(path.format(q=q))
        at = 0
        for lo, hi in meta["zero"]["ranges"]:
            for name, a in arrays.items():
                out.setdefault(name, np.full(meta["n_params"], np.nan))[lo:hi] = a[at:at + hi - lo]
            at += hi - lo
    return out


def shard_path(ck, n: int, step: int) -> str:
    return str(ck / f"dp{{q}}of{n}" / checkpoint.step_dir(step))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_recut_puts_every_saved_element_in_its_new_place(dp2, dp3, n):
    """dp 3's shards of step 6 cut for each rank of n: every buffer's every element is the
    saved one (put whole by each shard's own ranges)."""
    path = shard_path(dp2[0] / "C1", 3, 6)
    whole = gathered(path)
    assert set(whole) == {"params", "opt.m", "opt.v"} and not np.isnan(whole["params"]).any()
    ranges = [[tuple(r) for r in rank]
              for rank in checkpoint.load(path.format(q=0))[1]["zero"]["every_rank"]]
    session = build_session(parse_args([*MLP, "--zero", "1"]))
    units = units_of(session.model.body.modules, session.params.offsets, session.params.size)
    for r in range(n):
        layout = Layout(units, r, n)
        got = recut(ranges, layout.mine, list(whole),
                    lambda q: checkpoint.load(path.format(q=q))[0], np.float64)
        for (lo, hi), (at, end) in zip(layout.mine, layout.packed, strict=True):
            for name in whole:
                assert np.array_equal(got[name][at:end], whole[name][lo:hi]), (n, r, name)


def resume_here(ck, flags: tuple = ()):
    """A ZeRO stage-1 trainer on a real world of size 1 resuming the MLP's float64 run from
    `ck` (its step 6) with `flags`: its parameters."""
    setup = parse_args([*resumed("", "1", ck, 6, extra=[*REORDERED, *flags])["argv"]])
    session, reducer, zero = shard_session(build_session(setup),
                                           Communicator(MPI.COMM_SELF, name="self"), 1)
    log = MetricsLog("", {})
    try:
        ZeroTrainer(session, log, reducer)
        return zero.full_values()
    finally:
        log.close()
        reducer.close()


def test_dp3_shards_resume_into_one_process(dp2, dp3):
    assert np.array_equal(resume_here(dp2[0] / "C1"), dp3[1]["u3-z1"])


def drop_shard(ck):
    shutil.rmtree(ck / "dp1of3")


def foreign_grid(ck):
    os.mkdir(ck / "pp0of2-tp1of2")


def other_ranges(ck):
    meta_path = ck / "dp1of3" / checkpoint.step_dir(6) / checkpoint.MANIFEST
    meta = json.loads(meta_path.read_text())
    meta["zero"]["ranges"][0][1] -= 1
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, flags, words", [
    (drop_shard, [], "holds ZeRO shards of --dp 3 without dp1of3: they cannot be re-sliced"),
    (foreign_grid, [], "holds checkpoints of a run with --pp 2 --tp 2; this run has ZeRO "
                       "--dp 1"),
    (other_ranges, [], r"dp1of3/step-00000006: its ranges .* disagree with the manifest"),
    (None, ["--d-hidden", "12"], "another config: model.d_hidden: 10 -> 12"),
])
def test_what_cannot_be_resliced_is_refused_by_name(dp2, dp3, tmp_path, damage, flags, words):
    ck = tmp_path / "ck"
    shutil.copytree(dp2[0] / "C1", ck)
    if damage:
        damage(ck)
    before = sorted(str(p) for p in ck.rglob("*"))
    with pytest.raises(CheckpointError, match=words):
        resume_here(ck, flags)
    assert sorted(str(p) for p in ck.rglob("*")) == before


def test_plain_dp_refuses_zero_shards_by_name(dp2, dp3):
    setup = parse(resumed("", "0", dp2[0] / "C1", 6)["argv"][:-2], prog="plain")
    with pytest.raises(CheckpointError, match="a run with ZeRO --dp 2 and ZeRO --dp 3; this "
                                              "run has --pp 1 --tp 1"):
        Trainer(build_session(setup), MetricsLog("", {}))
