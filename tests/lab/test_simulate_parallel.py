"""dtlab-simulate's dp x pp x ep x tp predictions: the pipeline replay against the
schedule's bubble formula, the p2p / tp / all-to-all byte counts against the models'
formulas and code, the all-to-all calibration recovering known constants, bad flags named
(exit 2), and a tiny end-to-end prediction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtlab.lab.bench.parallel_formulas import HEADER_BYTES, p2p_bytes, tp_payload
from dtlab.lab.simulate import calibration_fit, moe, parallel, pipeline, tensor
from dtlab.lab.simulate.formulas import Network
from dtlab.lab.simulate.links import Link
from dtlab.lab.simulate.step import Host
from dtlab.models.cost import estimate
from dtlab.models.mlp import MLPConfig
from dtlab.models.moe import dispatch_groups
from dtlab.models.schedule import bubble_formula, make
from dtlab.models.schedule import simulate as simulate_replay
from dtlab.models.transformer import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]

SMALL = dict(vocab=32, seq_len=16, d_model=32, n_heads=4, n_layers=4, d_ff=64)


def simulate(*args: str, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "dtlab.lab.simulate", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v",
                                      "dualpipev"])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_free_communication_uniform_stages_give_the_bubble_formula(schedule, p, m):
    times = [{"F": 1.0, "B": 1.0, "W": 1.0}] * p
    step = pipeline.pipeline_step(make(schedule, p, m), times)
    assert step.bubble == pytest.approx(bubble_formula(schedule, p, m), abs=1e-12)
    assert step.p2p_s == 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v",
                                      "dualpipev"])
def test_uniform_model_stages_with_free_links_give_the_bubble_formula(schedule):
    """An MLP of equal square layers, one Linear per stage (F = B = W = 2 B d^2 FLOPs),
    except that the first computes no input gradient (its input is data): with free links
    the step is the schedule's replay of those pass times, and with the first stage's
    backward as long as the others' it is the bubble formula."""
    c, b, p, m = MLPConfig(d_in=16, d_hidden=16, n_layers=3, n_classes=16), 4, 4, 8
    bounds = tuple(pipeline.stage_bounds("mlp", c, b, p))
    work = parallel.Work("mlp", c, b, m, schedule, 4, bounds, estimate("mlp", c, b).flops_step)
    free = Link("free", 0.0, 0.0)
    row = parallel.parallel_step(work, parallel.Layout(1, p, 1, 1),
                                 parallel.Fabric(Network(free, free, 8)), 1e-9, Host(0), 25e6)
    assert row["p2p_s"] == row["tp_s"] == row["a2a_s"] == row["allreduce_s"] == 0.0
    flops = pipeline.stage_flops("mlp", c, b, list(bounds))
    assert all(f == flops[1] for f in flops[1:])
    assert flops[0]["F"] == flops[0]["W"] == flops[1]["F"] and flops[0]["B"] == 0
    times = [{k: v * 1e-9 for k, v in f.items()} for f in flops]
    ops = make(schedule, p, m)
    assert row["bubble"] == pytest.approx(pipeline.pipeline_step(ops, times).bubble, abs=1e-12)
    uniform = pipeline.pipeline_step(ops, [times[1]] * p).bubble
    assert uniform == pytest.approx(bubble_formula(schedule, p, m), abs=1e-12)


def test_interleaved_receives_one_message_per_chunk():
    """Interleaved 1F1B (v = 2, loop layout) crosses v p - 1 = 3 boundaries a way:
    rank 0 (stages 0, 2) receives 1 activation and 2 gradients a micro-batch, rank 1
    (stages 1, 3) 2 and 1; each chunk takes half its rank's pass times."""
    p, m, v = 2, 4, 2
    ops, times = make("interleaved", p, m, v), [{"F": 1.0, "B": 2.0, "W": 0.0}] * p
    step = pipeline.pipeline_step(ops, times, pipeline.P2P(0.25, 0.5, 1))
    assert step.compute_s == [12.0, 12.0]
    assert step.p2p_s == m * (0.25 + 2 * 0.5)  # rank 0's, the most
    halves = [{"F": 0.5, "B": 1.0, "W": 0.0}] * (v * p)
    charged = pipeline.with_receives(halves, pipeline.P2P(0.25, 0.5, 1), p)
    assert charged == [{"F": 0.5, "B": 1.5, "W": 0.0}, {"F": 0.75, "B": 1.5, "W": 0.0},
                       {"F": 0.75, "B": 1.5, "W": 0.0}, {"F": 0.75, "B": 1.0, "W": 0.0}]
    assert step.makespan_s == simulate_replay(ops, stage_times=charged).makespan
    with pytest.raises(ValueError, match="3 pass times for 2 ranks of 2 chunks"):
        pipeline.pipeline_step(ops, times[:1] * 3)


def test_a_v_keeps_its_bottom_on_one_rank():
    """ZB-V's stages p - 1 and p sit on rank p - 1: that hand-over is free, so a V of p
    ranks receives across 2p - 2 boundaries a way, not 2p - 1."""
    p, m = 2, 4
    ops = make("zb-v", p, m)
    charged = pipeline.with_receives([{"F": 1.0, "B": 1.0, "W": 1.0}] * 4,
                                     pipeline.P2P(0.25, 0.5, 1), p, "v")
    assert [t["F"] for t in charged] == [1.0, 1.25, 1.0, 1.25]  # stage 2 from stage 1: local
    assert [t["B"] for t in charged] == [1.5, 1.0, 1.5, 1.0]  # stage 1 from stage 2: local
    step = pipeline.pipeline_step(ops, [{"F": 2.0, "B": 2.0, "W": 2.0}] * p,
                                  pipeline.P2P(0.25, 0.5, 1))
    assert step.p2p_s == m * (0.25 + 0.5)  # each rank: one activation, one gradient
    assert step.makespan_s == simulate_replay(ops, stage_times=charged).makespan


def test_receives_lengthen_the_step_and_count_as_idle():
    ops, times = make("1f1b", 2, 4), [{"F": 1.0, "B": 2.0, "W": 0.0}] * 2
    free = pipeline.pipeline_step(ops, times)
    paid = pipeline.pipeline_step(ops, times, pipeline.P2P(0.25, 0.5, 1))
    # the receiving passes take longer: stage 1's forwards (an activation each), stage 0's
    # backwards (a gradient each)
    charged = [{"F": 1.0, "B": 2.5, "W": 0.0}, {"F": 1.25, "B": 2.0, "W": 0.0}]
    assert paid.makespan_s == simulate_replay(ops, stage_times=charged).makespan
    # at least one activation and one gradient on the critical path, at most all of them
    assert free.makespan_s + 0.75 <= paid.makespan_s <= free.makespan_s + 4 * 0.75
    assert paid.compute_s == free.compute_s == [12.0, 12.0]
    # idle = makespan - compute: the receives count as idle, as the executor measures
    assert paid.bubble == pytest.approx(1 - 12.0 / paid.makespan_s)
    assert paid.p2p_s == pytest.approx(4 * 0.5)  # stage 0: four gradients; stage 1: 4 x 0.25


@pytest.mark.parametrize("p,t,m", [(2, 1, 4), (3, 2, 8), (4, 4, 2)])
def test_p2p_bytes_equal_the_pipeline_formula(p, t, m):
    c, b = TransformerConfig(**SMALL), 2
    per = pipeline.P2P.over(Link("bytes", 0.0, 1.0), pipeline.activation_bytes(c, b, 4))
    # a byte a second: the receive times are the bytes of the messages; the shape header
    # goes once a step and boundary
    sent = t * (p - 1) * (m * (per.activation_s + per.gradient_s) + HEADER_BYTES)
    assert sent == p2p_bytes(c, b, m, p, t)


@pytest.mark.parametrize("p,t", [(1, 2), (2, 2), (3, 4), (6, 2)])
def test_tp_bytes_equal_the_megatron_formula(p, t):
    c, b = TransformerConfig(**SMALL), 2
    bounds = pipeline.stage_bounds("transformer", c, b, p)
    groups = pipeline.module_groups("transformer", c, b)
    msgs = [tensor.stage_messages([q for g in groups[lo:hi] for q in g], c, b, t, 4)
            for lo, hi in zip(bounds, bounds[1:], strict=False)]
    allreduce, allgather = tp_payload(c, b, t)
    assert sum(x.allreduce_bytes for x in msgs) == allreduce
    assert sum(sum(x.allgather) for x in msgs) == allgather
    # 2 forward + 2 backward of (b, T, d) per block, the embedding's and the head's
    act = b * c.seq_len * c.d_model * 4
    assert sum(x.forward.count(act) for x in msgs) == 2 * c.n_layers + 1
    assert sum(x.backward.count(act) for x in msgs) == 2 * c.n_layers + 1


@pytest.mark.parametrize("dropless,factor,kept", [(True, 1.25, 1.0), (False, 1.25, 1.0),
                                                   (False, 0.5, 0.5)])
def test_alltoall_rows_equal_the_layers_dispatch(dropless, factor, kept):
    c = TransformerConfig(**SMALL, moe_experts=4, moe_top_k=2, moe_dropless=dropless,
                          moe_capacity_factor=factor)
    b, E, k = 4, 4, 2
    n = b * c.seq_len
    tokens = np.arange(n)
    sel = np.stack([tokens % E, (tokens + 1) % E], axis=1)  # (n, k) balanced choices
    d = dispatch_groups(sel, None, E, None if dropless else factor, 1)
    assert moe.dispatched_rows(c, b) == int(d.counts.sum()) == kept * k * n
    assert moe.alltoall_bytes(c, b, 4) == int(d.counts.sum()) * c.d_model * 4


def test_alltoall_time_is_four_exchanges_and_the_counts():
    c = TransformerConfig(**SMALL, moe_experts=4, moe_top_k=2)
    link = Link("t", 1e-5, 1e-9)
    fwd, bwd = moe.layer_alltoall_s(c, 2, 4, 2, link)
    rows = 1e-5 + 0.5 * moe.alltoall_bytes(c, 2, 4) * 1e-9
    assert bwd == pytest.approx(2 * rows)
    assert fwd == pytest.approx(2 * rows + 1e-5 + 0.5 * 4 * 8 * 1e-9)
    assert moe.layer_alltoall_s(c, 2, 4, 1, link) == (0.0, 0.0)


def test_parallel_step_replays_the_schedule_with_flops_per_stage():
    c, b, m = TransformerConfig(**SMALL), 2, 6
    bounds = tuple(pipeline.stage_bounds("transformer", c, b, 2))
    flops = estimate("transformer", c, b).flops_step
    work = parallel.Work("transformer", c, b, m, "gpipe", 4, bounds, flops)
    free = Link("free", 0.0, 0.0)
    fabric = parallel.Fabric(Network(free, free, 8))
    row = parallel.parallel_step(work, parallel.Layout(1, 2, 1, 1), fabric, 1e-9, Host(0), 25e6)
    per_stage = pipeline.stage_flops("transformer", c, b, list(bounds))
    # the stages' FLOPs add up to the model's, W is part of backward
    assert sum(sum(f.values()) for f in per_stage) == pytest.approx(flops)
    times = [{k: v * 1e-9 for k, v in f.items()} for f in per_stage]
    expect = pipeline.pipeline_step(make("gpipe", 2, m), times)
    assert row["makespan_s"] == pytest.approx(expect.makespan_s)
    assert row["bubble"] == pytest.approx(expect.bubble)
    assert row["step_s"] == pytest.approx(expect.makespan_s)  # free links, one replica


def test_gradient_bytes_split_dense_over_dp_ep_and_experts_over_dp():
    c, b = TransformerConfig(**SMALL, moe_experts=4, moe_top_k=2), 2
    bounds = tuple(pipeline.stage_bounds("transformer", c, b, 1))
    work = parallel.Work("transformer", c, b, 1, "1f1b", 4, bounds,
                         estimate("transformer", c, b).flops_step)
    (dense, experts), = parallel.gradient_bytes(work, parallel.Layout(1, 1, 2, 1))
    total = estimate("transformer", c, b).params_total * 4
    assert dense + 2 * experts == total
    assert experts == c.n_layers * 4 * (2 * 32 * 64 + 64 + 32) * 4 / 2  # GELU experts


def test_alltoall_fit_recovers_known_constants():
    alpha, beta = 20e-6, 1 / 5e9
    rows = [{"ranks": n, "bytes": B, "ours_s": (n - 1) * alpha + (n - 1) / n * B * beta,
             "mpi_s": 2 * ((n - 1) * alpha + (n - 1) / n * B * beta)}
            for n in (2, 4) for B in (65536, 1_000_000, 4_000_000)]
    fit = calibration_fit.fit_alltoall(rows, cores=8)
    assert fit["ours"]["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["ours"]["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fit["mpi"]["alpha_s"] == pytest.approx(2 * alpha, rel=1e-6)
    assert fit["ours"]["ranks"] == [2, 4] and fit["ours"]["max_rel_err"] < 1e-9


PRESET = ["--link", "100gbit", "--intra-link", "nvlink", "--gpus-per-node", "8", "--tflops",
          "100"]


@pytest.mark.parametrize("flags,message", [
    (["--pp", "99"], "--pp 99 is more stages than the model's"),
    (["--moe-experts", "4", "--ep", "3"], "--moe-experts 4 is not divisible by --ep 3"),
    (["--ep", "2"], "--ep 2 needs a model with experts"),
    (["--tp", "16"], "--tp 16 exceeds --gpus-per-node 8"),
    (["--pp", "2", "--grad-accum", "0"], "--grad-accum must be positive"),
    (["--pp", "2", "--microbatches", "4"], "unrecognized arguments: --microbatches"),
    (["--stages", "2,2"], "--stages 2,2 has no effect without --pp"),
    (["--pp", "2", "--workers", "3"], "no N is a multiple of pp x ep x tp"),
    (["--pp-schedule", "zb-h1"], "--pp-schedule zb-h1 has no effect"),
    (["--moe-experts", "4", "--ep", "2", "--moe-alltoall", "mpi"],
     "--moe-alltoall mpi has no effect"),
    (["--pp", "2", "--pp-schedule", "dualpipev", "--grad-accum", "3"],
     "--grad-accum 3: DualPipeV needs at least 2p = 4 micro-batches"),
])
def test_bad_parallel_flags_are_named(flags, message):
    r = simulate(*PRESET, *flags)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_tiny_parallel_prediction_end_to_end(tmp_path):
    out = tmp_path / "pred.json"
    r = simulate(*PRESET, "--pp", "2", "--pp-schedule", "zb-h1", "--grad-accum", "4",
                 "--tp", "2", "--moe-experts", "4", "--ep", "2", "--workers", "4,8,16",
                 "--json", str(out))
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[1]
    for column in ("bubble", "p2p", "tp", "a2a", "allreduce", "step"):
        assert column in head
    data = json.loads(out.read_text())
    cost = estimate("transformer", TransformerConfig(**{
        k: v for k, v in data["config"].items() if k in TransformerConfig.__dataclass_fields__}),
        data["batch_size"] * data["microbatches"])
    # the data-parallel path's figures: parameters, FLOPs, gradient bytes
    assert (data["params"], data["flops_step"], data["grad_bytes"]) == (
        cost.params_total, cost.flops_step, 4 * cost.params_total)
    assert [row["n"] for row in data["rows"]] == [8, 16]  # 4 is below pp ep tp = 8
    assert [row["dp"] for row in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert 0 < row["bubble"] < 1 and row["a2a_s"] > 0 and row["tp_s"] > 0
        assert row["step_s"] > row["compute_s"]
    # the dense gradient is averaged over dp x ep (2 ranks at dp 1), the experts' over dp
    # too from dp 2
    assert 0 < data["rows"][0]["allreduce_s"] < data["rows"][1]["allreduce_s"]


def test_columns_only_for_the_dimensions_used():
    r = simulate(*PRESET, "--pp", "2", "--workers", "2,4")
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[1]
    assert "bubble" in head and "p2p" in head
    assert " tp " not in head + " " and "a2a" not in head


def test_validate_parallel_names_a_missing_fit_before_measuring(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"allreduce": {"ring": {"alpha_s": 1e-6,
                                                      "beta_s_per_byte": 1e-10}},
                               "compute": [], "pserver": {}}))
    out = tmp_path / "runs"
    r = simulate("--validate-parallel", "--calibration", str(cal), "--out", str(out))
    assert r.returncode == 2
    assert "no ours all-to-all fit" in r.stderr and "bench moe" in r.stderr
    assert not out.exists() or not any(out.iterdir())
