"""Local SGD / DiLoCo on the parameter servers: workers with --local-steps H push outer
gradients, servers with --outer-optimizer apply them (models/outer.py).

Real servers and worker processes against single-process twins that run the same
arithmetic: bit for bit with one worker (ASP) and with two under BSP (the round's mean of
two outer gradients does not depend on their order), and, for one worker with H = 1 and
outer SGD lr 1, against plain training with no outer step at all (models.outer,
Exactness).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from support.pserver_util import (
    ONE_BLAS_THREAD,
    ROOT,
    TINY_MLP_FLAGS,
    addresses,
    run_workers,
    serve,
)

from dtlab.models.config import ConfigError, add_flags, build
from dtlab.models.outer import OuterConfig, make_outer, round_ends
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import build_session, parse
from dtlab.pserver.__main__ import SERVER_OPTIM_FLAGS, server_config
from dtlab.pserver.common.config import ServerConfig, refuse_unused_optim_flags
from dtlab.pserver.worker.loop import check_outer, parse_args

K, B = 10, 8


def inner_step(session, step: int) -> None:
    """One step of plain training (models.run.trainer's order: grads, schedule, clip, step)."""
    session.replica.compute_grads(session.loader.next())
    lr = session.schedule(step)
    session.replica.finish_grads()
    session.model.clip_grad_norm(session.params, session.setup.optim.clip)
    session.optimizer.step(session.params.data, session.params.grad, lr)


def twin(flags: list[str], workers: int, H: int, outer: dict) -> np.ndarray:
    """The W workers one after another, each H inner steps per round on its data shard,
    then the outer step on the mean change, summed in the order a BSP round sums."""
    sessions = [build_session(parse(flags, prog="twin"), rank=w, world=workers)
                for w in range(workers)]
    anchor = sessions[0].params.data.copy()
    opt = make_outer(build(OuterConfig, outer), anchor)
    for step in range(K):
        for s in sessions:
            inner_step(s, step)
        if round_ends(step, H, K):
            total = anchor - sessions[0].params.data
            for s in sessions[1:]:
                total += anchor - s.params.data
            total /= workers
            opt.step(anchor, total)
            for s in sessions:
                s.params.data[...] = anchor
    return anchor


def run(tmp_path, workers: int, H: int, inner: list[str], outer: dict, **server):
    """The servers' final parameters, each worker's metrics, the shards' stats and the
    flags the twin takes (the worker's but --local-steps)."""
    flags = [*TINY_MLP_FLAGS, "--steps", str(K), "--batch-size", str(B), "--clip", "0", *inner]
    with serve(shards=2, num_workers=workers, **outer, **server) as daemons:
        paths = run_workers(addresses(daemons), workers, [*flags, "--local-steps", str(H)],
                            tmp_path)
        got = np.concatenate([d.store.params for d in daemons])
        stats = [d.store.stats() for d in daemons]
    return got, [read_metrics(str(p)) for p in paths], stats, flags


NESTEROV = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
ADAM = ["--optimizer", "adam", "--lr", "0.01", "--warmup", "2"]


def test_one_worker_diloco_equals_its_twin_and_counts_rounds_and_bytes(tmp_path):
    H = 3  # rounds end at steps 3, 6, 9 and 10 (a shorter last one)
    got, [(header, records)], stats, flags = run(tmp_path, 1, H, ADAM, NESTEROV)
    np.testing.assert_array_equal(got, twin(flags, 1, H, NESTEROV))
    assert header["local_steps"] == H and header["outer_optim"]["nesterov"]
    assert header["config"]["optim"]["optimizer"] == "adam"  # the inner one, this worker's
    rounds = [r for r in records if "outer_round" in r]
    assert [r["step"] for r in rounds] == [3, 6, 9, 10] and len(records) == K
    n_bytes = 4 * got.size
    assert all(r["push_bytes"] == n_bytes and r["outer_lr"] == 0.7 for r in rounds)
    assert [r["pull_bytes"] for r in rounds] == [n_bytes] * 3 + [0]  # the last pushes alone
    assert all(r["push_bytes"] == r["pull_bytes"] == 0 and not r["version"]
               for r in records if "outer_round" not in r)
    assert [r["version"] for r in rounds] == [[v, v] for v in (1, 2, 3, 4)]
    assert all(st.version == st.pushes == 4 and st.staleness.max == 0 for st in stats)


def test_h_1_with_outer_sgd_lr_1_is_plain_training_bit_for_bit(tmp_path):
    """No outer step in the reference: every round trip theta - (theta - theta_1) gives
    the inner step's parameters back exactly."""
    inner = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--warmup", "3"]
    got, _, _, flags = run(tmp_path, 1, 1, inner, {"outer_optimizer": "sgd"})
    s = build_session(parse(flags, prog="plain"))
    for step in range(K):
        inner_step(s, step)
    np.testing.assert_array_equal(got, s.params.data)


def test_two_workers_under_bsp_are_synchronous_local_sgd_bit_for_bit(tmp_path):
    H = 4
    outer = {"outer_optimizer": "sgd", "outer_lr": 1.0}
    got, metrics, stats, flags = run(tmp_path, 2, H, ADAM, outer, consistency="bsp")
    np.testing.assert_array_equal(got, twin(flags, 2, H, outer))
    assert all(st.version == 3 and st.pushes == 6 for st in stats)  # rounds 4, 8, 10
    for _, records in metrics:
        assert [r["outer_round"] for r in records if "outer_round" in r] == [1, 2, 3]


def test_a_local_worker_needs_servers_running_an_outer_optimizer(tmp_path):
    with pytest.raises(ConfigError, match="--outer-optimizer sgd or nesterov"):
        check_outer({"optimizer": "adamw", "warmup": 50, "schedule": "cosine",
                     "weight_decay": 0.0})
    check_outer(build(OuterConfig, NESTEROV).as_optim().__dict__)
    setup = parse_args(["--servers", "127.0.0.1:1", "--local-steps", "2", "--lr", "0.5"])
    assert setup.optim.lr == 0.5  # the inner optimizer's flags are the worker's here
    with serve(shards=1, optim={"optimizer": "adam", "lr": 0.01}) as daemons:
        out = subprocess.run(
            [sys.executable, "-m", "dtlab.pserver.worker", "--servers", addresses(daemons),
             *TINY_MLP_FLAGS, "--steps", "2", "--local-steps", "2", "--worker-id", "0",
             "--num-workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
            env=ONE_BLAS_THREAD)
    assert out.returncode == 2 and "the servers run adam" in out.stderr, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dtlab.pserver.worker", "--servers", "127.0.0.1:1",
         *TINY_MLP_FLAGS, "--local-steps", "3", "--eval-every", "4"], cwd=ROOT,
        capture_output=True, text=True, timeout=60, env=ONE_BLAS_THREAD)
    assert out.returncode == 2 and "multiple of --local-steps 3" in out.stderr, out.stderr


def serve_flags(argv: list[str]):
    """`dtlab-pserver serve ARGV` parsed as the daemon parses it: (its ServerConfig, flags)."""
    setup = parse(argv, prog="serve", flags={"data": None, "optim": SERVER_OPTIM_FLAGS},
                  add_extra=lambda p: add_flags(p, ServerConfig, "server"))
    return server_config(setup), setup.extra


@pytest.mark.parametrize("flag, value", [("--optimizer", "adam"), ("--lr", "0.1"),
                                         ("--momentum", "0.9"), ("--warmup", "0")])
def test_a_shard_with_an_outer_optimizer_refuses_the_optimizer_flags_it_would_not_use(
        flag, value):
    cfg, ns = serve_flags([*TINY_MLP_FLAGS, "--outer-optimizer", "nesterov", "--outer-lr", "0.7",
                           "--outer-momentum", "0.9", flag, value])
    with pytest.raises(ConfigError, match=f"^{flag} {value}: this shard runs --outer-optimizer "
                                          "nesterov in place of --optimizer"):
        refuse_unused_optim_flags(cfg, ns, SERVER_OPTIM_FLAGS)
    cfg, ns = serve_flags([*TINY_MLP_FLAGS, flag, value])  # without one: its own optimizer's
    refuse_unused_optim_flags(cfg, ns, SERVER_OPTIM_FLAGS)
    cfg, ns = serve_flags([*TINY_MLP_FLAGS, "--outer-optimizer", "sgd"])  # none given
    refuse_unused_optim_flags(cfg, ns, SERVER_OPTIM_FLAGS)


def test_a_config_files_optimizer_goes_with_an_outer_optimizer(tmp_path):
    """A --config file's optim section is the workers' inner optimizer: no flag, no refusal."""
    path = tmp_path / "run.json"
    path.write_text('{"optim": {"optimizer": "adamw", "lr": 0.001}}')
    cfg, ns = serve_flags(["--config", str(path), *TINY_MLP_FLAGS, "--outer-optimizer", "sgd"])
    refuse_unused_optim_flags(cfg, ns, SERVER_OPTIM_FLAGS)


def test_the_daemon_refuses_an_optimizer_flag_beside_an_outer_optimizer():
    r = subprocess.run([sys.executable, "-m", "dtlab.pserver", "serve", *TINY_MLP_FLAGS,
                        "--outer-optimizer", "sgd", "--lr", "0.5", "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--lr 0.5: this shard runs --outer-optimizer sgd" in r.stderr, \
        r.stderr
