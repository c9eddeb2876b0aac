"""ZeRO composed with tensor and pipeline parallelism (Megatron-LM's distributed optimizer:
each (pp, tp) shard's optimizer state, gradients and, stage 3 with --tp, parameters sliced
over that shard's dp ranks) trains exactly what plain data parallelism on the same grid
trains.

One 4-rank launch (tests/support/mpi_progs/zero_grid_cases.py) trains every case on
dp 2 x tp 2 and dp 2 x pp 2 and keeps every rank's final parameters of its (pp, tp) shard.
Where the order of every sum is plain DP's, the stages end bit for bit on it: float32,
bf16 mixed precision and float32 with --wire bf16 (the reduce-scatter in bfloat16, as
plain DP's all-reduce with --wire bf16) without clipping, one micro-batch under --tp
(stages 2 and 3 reduce each micro-batch, plain DP sums them first), two under --pp (a
pipeline stage's gradient accumulates whole over the step, then is reduce-scattered, in
every stage). Float64 with two micro-batches
and a clip that acts reorders the sums (the norm from the dp slices' squares, then over
tp with replicated tensors counted once, then over the stages): the parameters agree
within 1e-6 relative and the logged global norm within 1e-12 of plain DP's.

A Mixture-of-Experts transformer (no --ep) at dp 2 ends bit for bit on plain DP in
float32 and within 1e-6 in float64 with accumulation and clipping, and resumes bit for bit
(its router noise steps saved).

Checkpoints: each (pp, tp, dp) slice saved; a run stopped after 2 steps and resumed ends
bit for bit on the uninterrupted one; the dp 2 x tp 2 slices resume at dp 1 x tp 2 holding
exactly the saved parameters; a checkpoint of another grid is refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.collective.train import parse_args
from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/zero_grid_cases.py"
MODELS = {"mlp": ["--model", "mlp", "--d-in", "7", "--d-hidden", "10", "--n-layers", "2",
                  "--n-classes", "6", "--n-samples", "512"],
          "lm": ["--model", "transformer", "--vocab", "12", "--seq-len", "6", "--d-model", "8",
                 "--n-heads", "2", "--n-layers", "2", "--d-ff", "12", "--n-tokens", "3000"]}
RUN = ["--steps", "4", "--seed", "3", "--warmup", "2", "--lr", "3e-3", "--log-every", "100",
       "--batch-size", "4"]
GRIDS = {"tp": ["--dp", "2", "--tp", "2"],
         "pp": ["--dp", "2", "--pp", "2", "--grad-accum", "2"]}
SCHEDULE = {"mlp": [], "lm": ["--pp-schedule", "zb-h1"]}  # under --pp
EXACT = {"f32": ["--clip", "0"], "bf16": ["--clip", "0", "--precision", "bf16"],
         "wire": ["--clip", "0", "--wire", "bf16"]}
CLIP = 0.05
REORDERED = ["--dtype", "float64", "--grad-accum", "2", "--clip", str(CLIP)]
STAGES = {"tp": ("0", "1", "2", "3"), "pp": ("0", "1", "2")}


def argv(label: str, grid: str, extra: list, zero: str) -> list:
    more = SCHEDULE[label] if grid == "pp" else []
    out = [*MODELS[label], *RUN, *GRIDS[grid], *more, *extra, "--zero", zero]
    if "--grad-accum" in extra and "--grad-accum" in GRIDS[grid]:  # the later one wins
        out[out.index("--grad-accum") + 1] = extra[extra.index("--grad-accum") + 1]
    return out


def launch(tmp_path, n: int, cases: list[dict], name: str) -> dict:
    """Every case's parameters by "<case>@<world rank>"."""
    path, out = tmp_path / f"{name}.json", tmp_path / f"{name}.npz"
    path.write_text(json.dumps(cases))
    r = mpirun(n, PROG, str(path), str(out), timeout=180)
    assert r.rc == 0, r
    with np.load(out) as f:
        return dict(f)


def resumed(name: str, zero: str, grid: str, directory, steps: int, resume: bool) -> dict:
    extra = [*REORDERED, "--steps", str(steps), "--checkpoint-dir", str(directory),
             "--checkpoint-every", "2", *(["--resume"] if resume else [])]
    return {"name": name, "argv": argv("mlp", grid, extra, zero)}


@pytest.fixture(scope="module")
def grid4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grid4")
    cases = []
    for label in MODELS:
        for grid, stages in STAGES.items():
            kinds = {**EXACT, "f64": REORDERED} if label == "lm" else \
                {"f32": EXACT["f32"], "wire": EXACT["wire"], "f64": REORDERED}
            for kind, extra in kinds.items():
                for z in stages:
                    name = f"{label}-{grid}-{kind}-z{z}"
                    metrics = ["--metrics", str(tmp / name)] if kind == "f64" else []
                    cases.append({"name": name, "argv": argv(label, grid, extra + metrics, z)})
    for grid, z in (("tp", "1"), ("tp", "3"), ("pp", "2")):
        directory = tmp / f"C-{grid}-{z}"
        cases += [resumed(f"half-{grid}-z{z}", z, grid, directory, 2, False),
                  resumed(f"resume-{grid}-z{z}", z, grid, directory, 4, True)]
    return tmp, launch(tmp, 4, cases, "grid4")


def ranks(out: dict, name: str) -> list:
    return [out[f"{name}@{r}"] for r in range(4)]


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("label, kind", [("mlp", "f32"), ("lm", "f32"), ("lm", "bf16"),
                                         ("mlp", "wire"), ("lm", "wire")])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_stages_end_bit_for_bit_on_plain_dp_of_the_same_grid(grid4, grid, label, kind):
    _, out = grid4
    plain = ranks(out, f"{label}-{grid}-{kind}-z0")
    assert not np.array_equal(plain[0], plain[1])  # world ranks 0, 1: two (pp, tp) shards
    if kind == "wire":  # the bf16 wire rounds the gradients: not the fp32-wire run
        assert not np.array_equal(plain[0], out[f"{label}-{grid}-f32-z0@0"])
    for z in STAGES[grid][1:]:
        for r, (got, want) in enumerate(zip(ranks(out, f"{label}-{grid}-{kind}-z{z}"), plain,
                                            strict=True)):
            assert np.array_equal(got, want), (grid, label, kind, z, r)


@pytest.mark.parametrize("label", list(MODELS))
@pytest.mark.parametrize("grid", list(GRIDS))
def test_accumulated_and_clipped_float64_agree_with_plain_dp(grid4, grid, label):
    tmp, out = grid4
    plain = ranks(out, f"{label}-{grid}-f64-z0")
    _, records = read_metrics(str(tmp / f"{label}-{grid}-f64-z0"))
    norms = [rec["grad_norm"] for rec in records]
    assert min(norms) > CLIP  # the clip acts on every step
    for z in STAGES[grid][1:]:
        name = f"{label}-{grid}-f64-z{z}"
        for r, (got, want) in enumerate(zip(ranks(out, name), plain, strict=True)):
            assert got.dtype == np.float64
            assert rel(got, want) < 1e-6, (grid, label, z, r, rel(got, want))
        _, records = read_metrics(str(tmp / name))
        for rec, norm in zip(records, norms, strict=True):
            assert abs(rec["grad_norm"] - norm) <= 1e-12 * norm, (grid, label, z, rec, norm)


@pytest.mark.parametrize("grid, z", [("tp", "1"), ("tp", "3"), ("pp", "2")])
def test_a_stopped_run_resumes_bit_for_bit(grid4, grid, z):
    _, out = grid4
    whole = ranks(out, f"mlp-{grid}-f64-z{z}")
    assert not np.array_equal(out[f"half-{grid}-z{z}@0"], whole[0])
    for r, want in enumerate(whole):
        assert np.array_equal(out[f"resume-{grid}-z{z}@{r}"], want), (grid, z, r)


def test_slices_resume_at_another_dp_size(grid4):
    """dp 2 x tp 2's stage-1 and stage-3 slices of step 4 resumed at dp 1 x tp 2: each tp
    rank holds exactly the saved parameters of its shard (world ranks 0 and 1 of the
    4-rank run are dp rank 0's tp shards)."""
    tmp, out = grid4
    cases = []
    for z in ("1", "3"):
        c = resumed(f"dp1-z{z}", z, "tp", tmp / f"C-tp-{z}", 4, True)
        c["argv"][c["argv"].index("--dp") + 1] = "1"
        cases.append(c)
    got = launch(tmp, 2, cases, "dp1")
    for z in ("1", "3"):
        for r in range(2):
            assert np.array_equal(got[f"dp1-z{z}@{r}"], out[f"mlp-tp-f64-z{z}@{r}"]), (z, r)


def test_a_checkpoint_of_another_grid_is_refused_by_name(grid4):
    tmp, _ = grid4
    c = resumed("", "1", "pp", tmp / "C-tp-1", 4, True)
    c["argv"][c["argv"].index("--dp") + 1] = "1"
    r = mpirun(2, "-m", "dtlab.collective.train", *c["argv"], timeout=60)
    assert r.rc == 1 and not r.timed_out, r
    assert "holds checkpoints of a run with ZeRO --dp 2 --tp 2; this run has ZeRO --dp 1 " \
           "--pp 2" in r.stderr, r


MOE = [*MODELS["lm"], "--moe-experts", "4", "--moe-noise", "jitter"]


@pytest.fixture(scope="module")
def moe2(tmp_path_factory):
    """A Mixture-of-Experts transformer (router noise on) at dp 2: every stage and plain
    DP, and stage 2 stopped after 2 steps and resumed."""
    tmp = tmp_path_factory.mktemp("moe2")
    cases = [{"name": f"moe-{kind}-z{z}", "argv": [*MOE, *RUN, *extra, "--zero", z]}
             for kind, extra in (("f32", EXACT["f32"]), ("f64", REORDERED)) for z in STAGES["tp"]]
    for steps, more in ((2, []), (4, ["--resume"])):
        extra = [*REORDERED, "--steps", str(steps), "--checkpoint-dir", str(tmp / "C"),
                 "--checkpoint-every", "2", *more]
        cases.append({"name": f"moe-{steps}", "argv": [*MOE, *RUN, *extra, "--zero", "2"]})
    return launch(tmp, 2, cases, "moe2")


def test_moe_at_dp_only_trains_as_plain_dp(moe2):
    for r in range(2):
        plain, f64 = moe2[f"moe-f32-z0@{r}"], moe2[f"moe-f64-z0@{r}"]
        for z in STAGES["tp"][1:]:
            assert np.array_equal(moe2[f"moe-f32-z{z}@{r}"], plain), (z, r)
            assert rel(moe2[f"moe-f64-z{z}@{r}"], f64) < 1e-6, (z, r)
        assert not np.array_equal(moe2[f"moe-2@{r}"], moe2[f"moe-f64-z2@{r}"])
        assert np.array_equal(moe2[f"moe-4@{r}"], moe2[f"moe-f64-z2@{r}"]), r


@pytest.mark.parametrize("flags, words", [
    (["--zero", "3", "--pp", "2"], "--zero 3 with --pp 2: stage 3 gathers"),
    (["--zero", "1", "--model", "transformer", "--moe-experts", "4", "--ep", "2"],
     "--zero 1 with --ep 2"),
    ([*MOE, "--zero", "2", "--moe-bias-rate", "1e-3"],
     "--zero 2 with --moe-bias-rate 0.001: the router's selection-bias steps"),
])
def test_what_does_not_compose_is_refused_by_name(flags, words):
    with pytest.raises(ConfigError, match=words):
        parse_args(flags)
