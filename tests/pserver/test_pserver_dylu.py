"""Speed-aware local steps (dtlab-worker --local-steps H --dylu; pserver.worker.dylu, DyLU of
Liu et al. 2024) on real servers and worker processes: a worker alone is the fixed-H run
bit for bit (it is the fastest: H_i = H); beside a worker slowed k times by --straggler,
the slow one's rounds take about H / k steps by the rule on its own recorded times, the
fast one's H; the flags and a bad step time are refused by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support.pserver_util import addresses, connect, run_workers, serve

from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.errors import PSError
from dtlab.pserver.worker.dylu import fastest_of, speed_aware_steps
from dtlab.pserver.worker.flags import check_speed_aware, parse_args, worker_configs
from dtlab.pserver.worker.session import StatusError

NESTEROV = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
MODEL = {"d_in": 64, "d_hidden": 256, "n_layers": 2, "n_classes": 4}  # steps of ~1 ms
H, K, SLOW, STEPS = 8, 4, 1, 24  # worker SLOW is slowed K x
FLAGS = ["--model", "mlp", *(f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()),
         "--optimizer", "adam", "--lr", "0.01", "--warmup", "2", "--clip", "0",
         "--batch-size", "128", "--steps", str(STEPS), "--local-steps", str(H),
         "--num-workers", "2", "--straggler", f"{SLOW}:{K}"]


def one_worker(servers: str, tmp_path, name: str, wid: int, extra: list[str]) -> list[dict]:
    """Worker `wid` of 2 as a real process to its end: its step records."""
    [path] = run_workers(servers, 1, [*FLAGS, "--worker-id", str(wid), *extra], tmp_path,
                         ids=False, name=name)
    return read_metrics(str(path))[1]


def params(daemons) -> np.ndarray:
    return np.concatenate([d.store.params for d in daemons])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Worker 0 alone with fixed H on one set of servers and, at the same time, with --dylu
    on another; then worker 1, slowed K x, with --dylu on the latter (whose servers keep
    worker 0's step time: a worker's latest report stays after it leaves). So worker 1's
    first push already finds the fast worker's time, whatever the processes' start-up."""
    tmp = tmp_path_factory.mktemp("dylu")
    with serve(shards=2, num_workers=2, model_cfg=MODEL, **NESTEROV) as fixed_servers, \
            serve(shards=2, num_workers=2, model_cfg=MODEL, **NESTEROV) as dylu_servers:
        with ThreadPoolExecutor(2) as pool:
            alone = [pool.submit(one_worker, addresses(servers), tmp, name, 0, extra)
                     for servers, name, extra in ((fixed_servers, "fixed", []),
                                                  (dylu_servers, "fast", ["--dylu"]))]
            fixed, fast = (f.result() for f in alone)
        after_fast = {"fixed params": params(fixed_servers),
                      "dylu params": params(dylu_servers)}
        slow = one_worker(addresses(dylu_servers), tmp, "slow", SLOW,
                          ["--dylu", "--eval-every", str(H)])
    return {"fixed": fixed, "fast": fast, "slow": slow, **after_fast}


def rounds(records: list[dict]) -> list[dict]:
    return [r for r in records if "outer_round" in r]


def test_a_worker_alone_is_the_fixed_h_run_bit_for_bit(runs):
    """Alone, a worker is the fastest: the servers answer its own step time, H_i = H, and
    the run is --local-steps H's."""
    np.testing.assert_array_equal(runs["dylu params"], runs["fixed params"])
    assert [r["loss"] for r in runs["fast"]] == [r["loss"] for r in runs["fixed"]]
    assert [r["round_steps"] for r in rounds(runs["fast"])] == [H] * (STEPS // H)
    assert [r["round_steps"] for r in rounds(runs["fixed"])] == [H] * (STEPS // H)
    assert all(r["fastest_step_s"] == r["step_time_s"] > 0 for r in rounds(runs["fast"]))
    assert not any("step_time_s" in r for r in runs["fixed"])


def test_a_straggler_k_times_slower_takes_about_h_over_k_steps(runs):
    """Worker 1 slowed K = 4 x, H = 8: after its first round (H: nothing measured yet)
    each of its rounds takes H_i = round(H t_fast / t_i) steps by its own recorded
    times, within one step of H / K = 2 (the measured ratio is not exactly K: the
    straggler's own overhead, and its compute after each sleep in a cold cache). Its
    evaluations every H steps do not cut its rounds: where one falls inside a round, the
    round goes on to its H_i."""
    slow = rounds(runs["slow"])
    assert slow[0]["round_steps"] == H and len(slow) >= 4
    fast_s = rounds(runs["fast"])[-1]["step_time_s"]
    for before, r in zip(slow, slow[1:-1], strict=False):  # the last round: what is left
        assert before["fastest_step_s"] == fast_s < before["step_time_s"]
        want = speed_aware_steps(H, before["fastest_step_s"], before["step_time_s"])
        assert r["round_steps"] == want and abs(want - round(H / K)) <= 1, (before, r)
    evaluated = [r["step"] for r in runs["slow"] if r.get("eval_loss") is not None]
    assert evaluated == list(range(H, STEPS + 1, H)), evaluated


def test_the_rule_and_its_flags():
    assert speed_aware_steps(8, 1.0, 1.0) == 8
    assert speed_aware_steps(8, 1.0, 4.0) == 2 and speed_aware_steps(8, 1.0, 3.2) == 3
    assert speed_aware_steps(8, 1.0, 100.0) == 1  # at least one step
    with pytest.raises(PSError, match="predate speed-aware local steps"):
        fastest_of([pb.PushReply()])  # a server without PushReply.fastest_step_s
    assert fastest_of([pb.PushReply(fastest_step_s=0.5), pb.PushReply(fastest_step_s=0.25)]) \
        == 0.25
    with pytest.raises(ConfigError, match="--dylu needs --local-steps H: it scales"):
        parse_args(["--servers", "127.0.0.1:1", "--dylu"])
    wcfg, _ = worker_configs(parse_args(["--servers", "127.0.0.1:1", "--dylu",
                                         "--local-steps", "4"]))
    check_speed_aware(wcfg, pb.ASP)
    with pytest.raises(ConfigError, match="--dylu: the servers run BSP"):
        check_speed_aware(wcfg, pb.BSP)


def test_a_push_with_a_bad_step_time_is_refused_and_nothing_applied():
    with serve(shards=1) as daemons:
        c = connect(addresses(daemons), 0)
        try:
            flat = np.empty(daemons[0].store.params.size, np.float32)
            c.pull(flat)
            c.report_step_s(float("nan"))
            with pytest.raises(StatusError, match="INVALID_ARGUMENT: .* step_s nan: a "
                                                  "worker's step time must be"):
                c.push(np.ones_like(flat), 0)
            assert daemons[0].store.version == 0
            c.report_step_s(0.5)
            assert c.push(np.ones_like(flat), 0)[0].fastest_step_s == 0.5
        finally:
            c.close()
