"""The at-scale verdict: arrivals of N workers, the one-process N-worker simulations
against the runs they reduce to, the time-to-target cells, crossovers and the command."""

import json

import numpy as np
import pytest

from dtlab.lab.bench import harness
from dtlab.lab.simulate import clusters, verdict, verdict_check, verdict_runs, verdict_stats
from dtlab.lab.simulate.arrivals import Speeds, round_time, throughput, trace
from dtlab.lab.simulate.statistical import AsyncPushes, Method, Run, steps_to_target
from dtlab.lab.simulate.step import Host, ps_step
from dtlab.lab.simulate.verdict_time import Cell, Steps, crossover, fit, method_step_s, steps_at
from dtlab.models.config import ConfigError
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.simulated import SimulateConfig, SimulatedWorkers
from dtlab.models.transformer import TransformerConfig

TINY = ["--model", "mlp", "--d-in", "8", "--d-hidden", "16", "--n-classes", "4",
        "--n-layers", "1", "--batch-size", "4", "--eval-every", "1", "--eval-samples", "64",
        "--optimizer", "adamw", "--lr", "0.05", "--warmup", "0"]


def tiny(steps=5, *extra):
    return parse([*TINY, "--steps", str(steps), *extra], "test")


def test_equal_speeds_push_round_robin_n_minus_1_stale():
    t = trace(4, Speeds(), 20)
    assert t.worker.tolist() == [0, 1, 2, 3] * 5
    assert t.staleness.tolist() == [0, 1, 2, 3] + [3] * 16  # the first round reads version 0


def test_ssp_bound_holds_at_every_read_and_asp_runs_ahead():
    speeds = Speeds(jitter=0.3, slow_fraction=0.25, slow_factor=3.0)
    bound = 1
    t = trace(8, speeds, 400, bound, seed=3)
    for p in range(t.read.size):
        before = t.worker[: t.read[p]]  # the pushes applied when push p's worker read
        clocks = np.bincount(before, minlength=8)
        assert clocks[t.worker[p]] - clocks.min() <= bound
    asp = trace(8, speeds, 400, None, seed=3)
    assert asp.staleness.max() > t.staleness.max()
    assert throughput(8, speeds, bound) < throughput(8, speeds)


def test_round_time_backups_and_stragglers():
    assert round_time(16, Speeds()) == 1.0
    spread = Speeds(jitter=0.2)
    slowest = round_time(16, spread)
    assert slowest > 1.2
    assert round_time(16, spread, backups=2) < slowest
    assert throughput(6, Speeds()) == pytest.approx(6.0)


@pytest.mark.parametrize("text", ["jitter:x", "slow:2:3", "slow:0.5", "fast:1", "jitter:5"])
def test_bad_speeds_named(text):
    with pytest.raises(ConfigError, match=text.split(",")[0].replace(".", r"\.")):
        Speeds.parse(text)


def test_methods_parse_and_refuse():
    assert [Method.parse(x).label for x in ("sync", "asp-div", "ssp4", "local8", "topk0.5",
                                            "backup2", "sign")] == \
        ["sync", "asp-div", "ssp4", "local8", "topk0.5", "backup2", "sign"]
    for bad, why in (("ssp", "the bound"), ("topk0", "percent"), ("sync3", "no number"),
                     ("local8-div", "-div is for"), ("ring", "not one of")):
        with pytest.raises(ConfigError, match=why):
            Method.parse(bad)


def test_async_replay_is_the_simulated_workers_bit_for_bit():
    W, rounds = 3, 4
    s = build_session(tiny(rounds))
    sim = SimulatedWorkers(s, None, SimulateConfig(simulate_workers=W))
    for p in range(W * rounds):
        sim.step(p)
    r = Run(tiny(rounds), Method.parse("asp"), W, 0.0, 1)
    pushes = AsyncPushes(r.s, trace(W, Speeds(), W * rounds),
                         [r.loader(w, W) for w in range(W)], False, W * rounds)
    for p in range(W * rounds):
        pushes.push(p)
    assert np.array_equal(sim.live, r.s.params.data)


def test_one_worker_every_method_is_plain_training():
    def curve(name):
        return [loss for _, loss in steps_to_target(tiny(4), Method.parse(name), 1, 0.0,
                                                    1).curve]
    plain = curve("sync")
    assert len(plain) == 4
    assert curve("asp") == plain  # bit for bit
    np.testing.assert_allclose(curve("local1"), plain, rtol=1e-5)  # outer SGD lr 1
    np.testing.assert_allclose(curve("topk100"), plain, rtol=1e-5)  # everything sent


def test_sync_is_n_workers_mean_gradient():
    """topk100 averages N workers' own gradients; sync takes one replica on their union."""
    a = steps_to_target(tiny(3), Method.parse("sync"), 4, 0.0, 1).curve
    b = steps_to_target(tiny(3), Method.parse("topk100"), 4, 0.0, 1).curve
    np.testing.assert_allclose([x for _, x in a], [x for _, x in b], rtol=1e-4)


def test_target_reached_stops_and_counts_steps():
    r = steps_to_target(tiny(6), Method.parse("sync"), 2, 10.0, 2)  # any loss is below 10
    assert r.steps == 2 and r.samples == 2 * 2 * 4 and len(r.curve) == 1


def test_fit_recovers_a_plus_c_over_n_and_misses_propagate():
    pts = {n: 100 + 800 / n for n in (8, 16, 32)}
    a, c = fit(pts)
    assert a == pytest.approx(100) and c == pytest.approx(800)
    assert steps_at(pts, 1024).steps == pytest.approx(100 + 800 / 1024)
    assert steps_at(pts, 16) == Steps(150.0, "simulated")
    assert steps_at({8: 50, 16: None}, 64).steps is None
    with pytest.raises(ValueError, match="between"):
        steps_at(pts, 12)


def cells(times):
    return [Cell(n, Steps(1, "simulated"), 1.0, t) for n, t in zip((8, 16, 32, 64), times,
                                                                   strict=True)]


def test_crossover_names_the_first_n_of_the_lasting_lead():
    sync = cells([1, 2, 4, 8])
    assert crossover(cells([2, 3, 3, 3]), sync) == 32
    assert crossover(cells([0.5, 3, 3, 3]), sync) == 32  # an early lead that is lost
    assert crossover(cells([0.5, 1, 1, 1]), sync) == "always"
    assert crossover(cells([2, 3, 5, 9]), sync) is None
    assert crossover(cells([2, 3, 3, None]), sync) is None


def test_step_of_each_method_on_a_cluster():
    cfg, c = TransformerConfig(), "h100-eth100"
    sync = clusters.step_time("transformer", cfg, 64, c, 16, wire="bf16")
    assert method_step_s(Method("sync"), "transformer", cfg, 64, c, 16, Speeds()) == \
        pytest.approx(sync.step_s)
    worker = ps_step(sync.workload, 64, 8, clusters.server_link(c), sync.compute_s, Host(0))
    assert method_step_s(Method("asp"), "transformer", cfg, 64, c, 16, Speeds()) == \
        pytest.approx(worker.step_s)
    spread = Speeds(jitter=0.3)
    assert method_step_s(Method("sync"), "transformer", cfg, 64, c, 16, spread) > sync.step_s
    local = method_step_s(Method("local", 8), "transformer", cfg, 64, c, 16, Speeds())
    assert sync.compute_s < local < sync.step_s


def test_verdict_command_end_to_end_and_reuse(tmp_path, capsys):
    argv = ["--d-model", "8", "--n-heads", "2", "--n-layers", "1", "--d-ff", "16",
            "--seq-len", "8", "--n-tokens", "4096", "--batch-size", "2", "--eval-samples", "32",
            "--eval-every", "2",
            "--steps", "4", "--methods", "sync,asp,backup1", "--sizes", "2,4,16",
            "--simulate-up-to", "4", "--clusters", "dgx-h100-ndr", "--step-models", "same",
            "--target-loss", "1.2", "--speeds", "equal"]
    assert verdict.main([*argv, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "time to target (s)" in out and "sync" in out.split("time to target")[1]
    assert "~: extrapolated" in out
    first = json.loads((tmp_path / "a" / "verdict.json").read_text())
    assert set(first["points"]) == {"sync", "asp"} and first["simulated"] == [2, 4]
    assert [c["source"] for c in first["tables"][0]["cells"]["backup1"]][-1] == "fit, as sync"
    stored = tmp_path / "a" / "statistics.json"
    kept = json.loads(stored.read_text())
    assert len(kept["cells"]) == 4 and kept["commands"][0].endswith(str(tmp_path / "a"))
    capsys.readouterr()
    assert verdict.main([*argv, "--out", str(tmp_path / "b"), "--statistics", str(stored),
                         "--cached-only"]) == 0
    assert "# simulated" not in capsys.readouterr().err  # every cell read back, none trained
    again = json.loads((tmp_path / "b" / "verdict.json").read_text())
    assert again["tables"] == first["tables"]
    with pytest.raises(ConfigError, match="no simulation of sign at N = 2, sign at N = 4"):
        verdict.main([*argv, "--methods", "sync,sign", "--statistics", str(stored),
                      "--cached-only", "--out", str(tmp_path / "c")])
    with pytest.raises(ConfigError, match="no simulation of sync at N = 2"):  # a new budget
        verdict.main([*argv, "--steps", "6", "--statistics", str(stored), "--cached-only",
                      "--out", str(tmp_path / "c")])


def test_statistics_cells_in_processes_equal_inline_and_divergence_ends_a_cell(tmp_path):
    setup, methods = tiny(3), [Method.parse("sync"), Method.parse("local2")]
    inline = verdict_stats.measure(setup, methods, [2], 0.0, 1, Speeds(),
                                   verdict_stats.Statistics(None), jobs=1)
    store = verdict_stats.Statistics.open(tmp_path / "s.json")
    pooled = verdict_stats.measure(setup, methods, [2], 0.0, 1, Speeds(), store, jobs=2)
    assert [r["curve"] for r in pooled.runs] == [r["curve"] for r in inline.runs]
    assert verdict_stats.Statistics.open(tmp_path / "s.json").cells == store.cells
    # ran the whole budget: any target is read from the curves, none trained again
    loose = verdict_stats.measure(setup, methods, [2], 100.0, 1, Speeds(), store,
                                  simulate=False)
    assert loose.points == {"sync": {2: 1}, "local2": {2: 2}} and loose.simulated_now == 0
    reached = verdict_stats.Statistics(None)
    verdict_stats.measure(setup, methods[:1], [2], 100.0, 1, Speeds(), reached)
    with pytest.raises(ConfigError, match="no simulation of sync at N = 2"):
        verdict_stats.measure(setup, methods[:1], [2], 0.0, 1, Speeds(), reached,
                              simulate=False)  # stopped at 100: a lower target is new
    wild = verdict_stats.measure(tiny(4, "--lr", "1e30", "--optimizer", "sgd"),
                                 [Method.parse("sync")], [2], 0.0, 1, Speeds(),
                                 verdict_stats.Statistics(None))
    assert wild.points == {"sync": {2: None}} and wild.runs[0]["diverged"] is not None
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a verdict statistics file"):
        verdict_stats.Statistics.open(tmp_path / "bad.json")


def test_check_reads_comparison_names_and_measured_speeds():
    assert verdict_check.method_of("sync-ring") == Method("sync")
    assert verdict_check.method_of("async-bsp") == Method("sync")
    assert verdict_check.method_of("async-ssp3-div") == Method.parse("ssp3-div")
    assert verdict_check.method_of("async-bsp-backup2") == Method.parse("backup2")
    assert verdict_check.method_of("sync-topk1") == Method.parse("topk1")
    assert verdict_check.method_of("async-local8") is None
    recs = [[{"step_s": 1.0}] + [{"step_s": 1.0}] * 5, [{"step_s": 9.0}] + [{"step_s": 3.0}] * 5]
    s = verdict_check.measured_speeds(recs)
    assert s.bases == (0.5, 1.5) and s.jitter == 0.0


def test_check_rebuilds_a_runs_push_order_and_replays_it():
    # worker 1 pushes twice alone (versions 1, 2), then worker 0 (read 0: 2 stale), ...
    recs = [[{"version": [3], "staleness": [2]}, {"version": [4], "staleness": [0]}],
            [{"version": [1], "staleness": [0]}, {"version": [2], "staleness": [0]}]]
    order = verdict_check.order_of(recs)
    assert order.worker.tolist() == [1, 1, 0, 0] and order.read.tolist() == [0, 1, 0, 3]
    assert verdict_check.order_of([[{"version": [1, 1], "staleness": [0, 0]}]]) is None
    assert verdict_check.order_of([[{"version": [2], "staleness": [0]}]]) is None  # gap
    r = steps_to_target(tiny(2), Method.parse("asp"), 2, 0.0, 1, order=order)
    assert [s for s, _ in r.curve] == [1, 2] and r.staleness["max"] == 2


# stated constants, not this host's (the row checks the code path, not the accuracy)
SYNTHETIC_CALIBRATION = {
    "allreduce": {"ring": {"beta_s_per_byte": 0.25e-9}},
    "compute": [{"model": "mlp", "threads": t, "flops_per_s": 1e9, "overhead_s": 1e-4}
                for t in (1, 2)],
    "pserver": {"session": {op: {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}
                            for op in ("pull", "push")}},
    "apply_s_per_byte": {}}


@pytest.mark.usefixtures("mpiexec")
@pytest.mark.skipif(bool(verdict_runs.emulated_missing()),
                    reason=verdict_runs.emulated_missing() or "-")
def test_check_on_emulated_hosts_predicts_time_to_target_with_their_links(tmp_path):
    """A comparison at N = 2 across 2 emulated hosts, checked: steps simulated in one
    process against the runs', the step from the cost model with the shaped link."""
    folder = verdict_runs.compare_at(
        2, "scripts/lab/configs/emulated-mlp.json", "sync-ring,async-asp", 4, 2,
        tmp_path / "n2", hosts=2, link_gbit=1.0, timeout_s=120,
        extra=("--d-hidden", "16", "--n-samples", "512", "--target-loss", "10",
               "--eval-samples", "64", "--warmup", "0"))
    rows, stale = verdict_check.check_folder(folder, SYNTHETIC_CALIBRATION, Host(2))
    assert [r["run"] for r in rows] == ["sync-ring", "async-asp"]
    for r in rows:
        assert r["where"] == "2 emulated hosts at 1 Gbit/s"
        assert r["step_from"] == "cost model, 2 emulated hosts at 1 Gbit/s"
        assert r["pred_steps"] == 2  # any loss is below 10: the first evaluation's
        assert r["pred_ttt_s"] == pytest.approx(2 * r["pred_step_s"])
    sync, asp = rows
    assert sync["meas_steps"] == 2 and sync["meas_ttt_s"] == pytest.approx(2 * sync["meas_step_s"])
    # ASP's first evaluation is a point of the job's model in time: the steps the workers
    # had made then (one may lag at the start), its time the evaluation's own
    assert asp["meas_steps"] in (1, 2) and 0 < asp["meas_ttt_s"] < 2 * asp["meas_step_s"] * 2
    assert [s["run"] for s in stale] == ["async-asp"] and stale[0]["n"] == 2
    text = "\n".join(verdict_check.table(rows, stale))
    assert "# N = 2 on 2 emulated hosts at 1 Gbit/s" in text


def test_on_host_compute_is_n_processes_stepping_together_kept_in_the_folder(tmp_path):
    """On this host the check's step uses bench together's figures (N processes of one
    thread each), read from the folder where they are (measured there first otherwise)."""
    rows = [{"role": "rank", "ranks": 2, "wall_s_samples": [0.016, 0.018, 0.017],
             "makespan_s_samples": [0.019, 0.020, 0.021], "cpu_s_samples": [0.015] * 3}]
    harness.save(tmp_path / "together-rank-n2.json", {"bench": "together"}, rows)
    got = verdict_check.on_host_compute(tmp_path, "unused.json", 2,
                                        {"runs": [{"name": "sync-ring"}]})
    assert got[("rank", 2)].own_s == 0.017 and got[("rank", 2)].spread_s == pytest.approx(0.003)
