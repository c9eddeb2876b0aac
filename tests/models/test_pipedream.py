"""PipeDream-Flush, PipeDream-2BW and weight stashing (models/pipedream.py).

One real 2-rank job (tests/support/mpi_progs/pipedream_twins.py) trains `dtlab-sync --pp 2`
plainly and with --pipedream flush, 2bw (in windows without flushes: 3 steps, 1 ended
by an evaluation, 2 ended by the last step) and 2bw step by step, stash, the same 2BW
steps as one cross-step list (TwoBufferedWindow), and the one-process twins; here the
parameters are compared bit for bit (--clip 0: the clip norm sums the stages' squares
in another order) and the metrics read for the losses, the staleness of every update,
the bytes each stage keeps and the replayed bubble. The rest runs in this process: the
version ring, the cross-step schedule's replay against its formula and the versions it
needs, the window's size, the refusals.
"""

import json

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.models.config import ConfigError, build
from dtlab.models.pipedream import (
    PipeDreamConfig,
    WeightVersions,
    bubble_2bw,
    live_versions,
    steady_state,
)
from dtlab.models.pipeline import MAX_MESSAGES
from dtlab.models.schedule import bubble_formula, simulate, validate

MLP = ["--model", "mlp", "--d-in", "12", "--d-hidden", "32", "--n-classes", "6",
       "--n-samples", "4096", "--steps", "6", "--seed", "3", "--warmup", "2", "--lr", "3e-3",
       "--clip", "0", "--batch-size", "4", "--grad-accum", "4"]
STEPS = 6


def metrics(path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], lines[1:]


@pytest.mark.usefixtures("mpiexec")
def test_pipedream_runs_equal_their_one_process_twins_bit_for_bit(tmp_path):
    r = mpirun(2, "tests/support/mpi_progs/pipedream_twins.py", tmp_path, *MLP, timeout=120)
    assert r.rc == 0 and "PASS pipedream runs" in r.stdout, r
    run = {name: np.load(tmp_path / f"{name}.npy") for name in
           ("1f1b", "flush", "2bw", "2bw-steps", "stash", "sim", "stash-twin", "window")}
    # 2BW: W_{t+1} = W_t - lr grad f(W_{t-1}), as the one-stale simulated worker computes it
    np.testing.assert_array_equal(run["2bw"], run["sim"])
    # ... and as the 4 steps run as one list without flushes, on two weight buffers
    np.testing.assert_array_equal(run["window"], run["2bw"])
    _, records = metrics(tmp_path / "2bw.jsonl")
    assert np.load(tmp_path / "window-losses.npy").tolist() == [r["loss"] for r in records]
    # dtlab-sync's windows equal its step-by-step 2BW run: updates, losses, norms, evals
    np.testing.assert_array_equal(run["2bw"], run["2bw-steps"])
    _, steps = metrics(tmp_path / "2bw-steps.jsonl")
    for key in ("step", "loss", "grad_norm", "eval_loss", "lr", "staleness"):
        assert [r.get(key) for r in records] == [r.get(key) for r in steps], key
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 6]
    np.testing.assert_array_equal(run["stash"], run["stash-twin"])
    # delay 0: PipeDream-Flush is the 1F1B run; the delay does change the run
    np.testing.assert_array_equal(run["flush"], run["1f1b"])
    assert np.abs(run["2bw"] - run["1f1b"]).max() > 1e-6

    param_bytes = {}
    for name, delays, staleness in (("flush", [0, 0], [[0, 0]] * STEPS),
                                    ("2bw", [1, 1], [[0, 0]] + [[1, 1]] * (STEPS - 1)),
                                    ("2bw-steps", [1, 1], [[0, 0]] + [[1, 1]] * (STEPS - 1)),
                                    ("stash", [1, 0], [[0, 0]] + [[1, 0]] * (STEPS - 1))):
        header, records = metrics(tmp_path / f"{name}.jsonl")
        assert header["pipedream"] == name.split("-")[0]
        assert header["pipedream_delays"] == delays
        assert [rec["staleness"] for rec in records] == staleness, name
        kept = header["stage_weight_version_bytes"]  # each stage: d copies of its parameters
        assert header["weight_version_bytes"] == kept[0] == delays[0] * header["param_bytes"]
        assert all(rec["weight_version_bytes"] == kept[0] for rec in records)
        param_bytes[name] = kept
    assert param_bytes["flush"] == [0, 0] and param_bytes["stash"][1] == 0
    assert min(param_bytes["2bw"]) > 0 and param_bytes["2bw"] == param_bytes["2bw-steps"]

    # the bubble recorded per step, replayed with unit passes (m 4, p 2): the flushed
    # step's (p-1)/(m+p-1) every step, a window's (p-1)/(Km+p-1), lower from K = 2 on
    _, flush = metrics(tmp_path / "flush.jsonl")
    _, steps = metrics(tmp_path / "2bw-steps.jsonl")
    _, records = metrics(tmp_path / "2bw.jsonl")
    assert {r["bubble_replay"] for r in flush + steps} == {bubble_formula("1f1b", 2, 4)}
    assert [r["pipedream_window"] for r in records] == [3, 3, 3, 1, 2, 2]
    for r, f in zip(records, flush, strict=True):
        assert r["bubble_replay"] == pytest.approx(bubble_2bw(2, 4, r["pipedream_window"]))
        assert r["bubble_replay"] < f["bubble_replay"] or r["pipedream_window"] == 1
    assert all(r["step_s"] > 0 and 0 <= r["bubble"] < 1 for r in records)
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and len(set(elapsed)) == STEPS
    header, records = metrics(tmp_path / "1f1b.jsonl")
    assert "pipedream" not in header and "staleness" not in records[0]


def test_weight_versions_read_the_version_d_updates_back():
    data = np.zeros(5)
    versions = WeightVersions(data, 2)
    read = []
    for t in range(5):  # the "optimizer" writes W_{t+1} = t + 1 after each step
        versions.read_past()
        read.append(data[0])
        versions.put_back()
        assert data[0] == t  # W_t back in place for the update
        data[...] = t + 1
    assert read == [0, 0, 0, 1, 2]  # W_{max(t - 2, 0)}
    assert versions.nbytes == 2 * data.nbytes


@pytest.mark.parametrize("p,m,steps", [(2, 4, 3), (4, 8, 1), (4, 4, 5), (4, 3, 2)])
def test_the_cross_step_schedule_idles_once_not_every_step(p, m, steps):
    """K steps of 2BW are one 1F1B list over K m micro-batches: the replay idles the
    start-up's p - 1 passes once (the formula), where the flushed schedule idles them
    every step; each stage holds two weight versions."""
    ops = steady_state(p, m, steps)
    validate(ops, steps * m)
    replay = simulate(ops)  # t_F = t_B = t_W = 1
    assert replay.bubble == pytest.approx(bubble_2bw(p, m, steps))
    assert bubble_2bw(p, m, 1) == pytest.approx(bubble_formula("1f1b", p, m))
    assert replay.idle == pytest.approx([3 * (p - 1)] * p)  # once, at start-up
    flushed = simulate(steady_state(p, m, 1)).idle  # every step
    assert flushed == pytest.approx([3 * (p - 1)] * p)
    assert live_versions(ops, m) == [2 if steps > 1 else 1] * p


def test_two_versions_need_m_at_least_p_minus_1():
    with pytest.raises(ValueError, match="stage 0: the forward of micro-batch 2 .step 2. "
                                         "needs W_1"):
        live_versions(steady_state(4, 1, 4), 1)


BASE = {"pipedream": "2bw", "pp": 2, "grad_accum": 4}


@pytest.mark.parametrize("values,message", [
    ({"pp": 1}, "--pipedream 2bw needs a pipeline: give --pp 2 or more"),
    ({"pp_schedule": "zb-h1"}, "--pipedream 2bw runs PipeDream's 1F1B: not with --pp-schedule "
                               "zb-h1"),
    ({"zero": 3}, "--pipedream 2bw with --zero 3:"),
    ({"precision": "bf16"}, "--pipedream 2bw with --precision bf16:"),
    ({"resume": True}, "--pipedream 2bw with --resume: a checkpoint holds the current"),
    ({"checkpoint_every": 5}, "--pipedream 2bw with --checkpoint-every 5:"),
    ({"moe_bias_rate": 0.01}, "--pipedream 2bw with --moe-bias-rate 0.01:"),
    ({"pp": 8, "grad_accum": 4}, "--pipedream 2bw --pp 8 --grad-accum 4: stage 0: the forward"),
    ({"pipedream": "stash"}, "--pipedream stash updates after every micro-batch "
                             "(PipeDream 2019): --grad-accum 1, not 4"),
    ({"pipedream": "pipedream"}, "--pipedream must be one of off, flush, 2bw, stash"),
    ({"clip": 1.0}, "--pipedream 2bw with --clip 1: inside a window each stage updates on "
                    "its own, with no global gradient norm to clip to; give --clip 0, or "
                    "--pipedream-window 1 (step by step, each step flushed)"),
    ({"pipedream_window": 2000}, "--pipedream 2bw --pipedream-window 2000 --grad-accum 4 "
                                 "--pp 2: 16000 (micro-batch, stage) pairs in one list"),
    ({"pipedream": "flush", "pipedream_window": 2}, "--pipedream-window 2 runs PipeDream-2BW's "
                                                    "steps as one list: not with --pipedream "
                                                    "flush"),
    ({"pipedream_window": -1}, "--pipedream-window must not be negative"),
    ({"moe_experts": 4}, "--pipedream 2bw with --moe-experts 4: a window runs the next "
                         "step's forwards before this step's last backwards.*give "
                         "--pipedream-window 1"),
])
def test_bad_combinations_are_refused_by_name(values, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        build(PipeDreamConfig, {**BASE, **values})


def test_the_modes_that_combine_are_accepted():
    for values in ({}, {"pipedream": "flush", "grad_accum": 1, "resume": True,
                        "precision": "bf16"},
                   {"pipedream": "stash", "grad_accum": 1},
                   {"pipedream_window": 1, "clip": 1.0},  # step by step
                   {"pipedream": "off", "pp": 1, "zero": 3}):
        cfg = build(PipeDreamConfig, {**BASE, **values})
        assert len(cfg.delays()) == cfg.pp


def test_a_window_runs_from_one_evaluation_to_the_next_unless_told():
    cfg = build(PipeDreamConfig, BASE)
    assert cfg.windowed and cfg.window_steps(eval_every=30, steps=600) == 30
    assert cfg.window_steps(eval_every=0, steps=600) == 600
    assert cfg.window_steps(eval_every=0, steps=10**6) == MAX_MESSAGES // (4 * 2)
    told = build(PipeDreamConfig, {**BASE, "pipedream_window": 7})
    assert told.window_steps(eval_every=30, steps=600) == 7
    assert not build(PipeDreamConfig, {**BASE, "pipedream_window": 1}).windowed


@pytest.mark.usefixtures("mpiexec")
def test_windows_over_two_data_parallel_replicas_equal_the_steps_bit_for_bit(tmp_path):
    """dp 2 x pp 2: each stage's gradient averaged over its replicas at its update, inside
    the list, as the trainer's step does; the losses averaged over the replicas."""
    r = mpirun(4, "tests/support/mpi_progs/pipedream_twins.py", tmp_path, *MLP, timeout=120)
    assert r.rc == 0 and "PASS pipedream dp runs" in r.stdout, r
    np.testing.assert_array_equal(np.load(tmp_path / "dp-2bw.npy"),
                                  np.load(tmp_path / "dp-2bw-steps.npy"))
    (header, windows), (_, steps) = (metrics(tmp_path / f"dp-{name}.jsonl")
                                     for name in ("2bw", "2bw-steps"))
    assert header["dp"] == 2 and header["pipedream"] == "2bw"
    for key in ("loss", "grad_norm", "eval_loss"):
        assert [r.get(key) for r in windows] == [r.get(key) for r in steps], key
    assert all(r["comm_s"] >= 0 and "wait_s" in r for r in windows)


@pytest.mark.usefixtures("mpiexec")
def test_dtlab_sync_refuses_a_bad_combination_on_every_rank_by_name():
    r = mpirun(2, "-m", "dtlab.collective.train", *MLP, "--pp", "2", "--pipedream", "2bw",
               "--pp-schedule", "zb-h1", timeout=60)
    assert r.rc == 2 and not r.timed_out, r
    assert "--pipedream 2bw runs PipeDream's 1F1B: not with --pp-schedule zb-h1" in r.stderr
    assert "Traceback" not in r.stderr, r
