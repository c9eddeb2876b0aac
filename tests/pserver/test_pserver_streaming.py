"""Streaming DiLoCo on the parameter servers (dtlab-worker --local-steps H --fragments F;
pserver.worker.streaming) on real servers and a real worker process: F = 2 fragments (the
first straddling the two shards) equal the per-fragment schedule replayed in one process
bit for bit, held-out losses included; F = 1 is async DiLoCo's run bit for bit; the flags
are refused by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support.pserver_util import TINY_MLP_FLAGS, addresses, run_workers, serve

from dtlab.models.config import ConfigError, build
from dtlab.models.outer import OuterConfig, make_outer
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import build_session, parse
from dtlab.models.streaming import fragment_ranges, syncing
from dtlab.pserver.worker.flags import parse_args, worker_configs

NESTEROV = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
H, K = 4, 10
FLAGS = [*TINY_MLP_FLAGS, "--optimizer", "adam", "--lr", "0.01", "--warmup", "2", "--clip",
         "0", "--batch-size", "8", "--steps", str(K), "--eval-every", str(H)]


def run(tmp_path, name: str, extra: list[str]) -> tuple[np.ndarray, list[dict]]:
    """One worker on 2 shards running outer Nesterov: the servers' final parameters and
    the worker's records."""
    with serve(shards=2, num_workers=1, **NESTEROV) as daemons:
        [path] = run_workers(addresses(daemons), 1, [*FLAGS, "--local-steps", str(H), *extra],
                             tmp_path, name=name)
        got = np.concatenate([d.store.params for d in daemons])
    return got, read_metrics(str(path))[1]


def replayed(F: int) -> tuple[np.ndarray, list[float]]:
    """The schedule in one process: inner steps, and after each step the outer Nesterov
    step of every fragment due, on its own slice of the global parameters (its anchor),
    the new global values copied into the local ones; the held-out losses of the global
    parameters at every H-th step and the last."""
    s = build_session(parse(FLAGS, prog="replay"))
    p = s.params.data
    frags = fragment_ranges([s.params.offsets[spec.name] for spec in s.params.specs], F)
    anchor = p.copy()
    outer = [make_outer(build(OuterConfig, NESTEROV), anchor[lo:hi]) for lo, hi in frags]
    evals = []
    for step in range(K):
        s.replica.compute_grads(s.loader.next())
        lr = s.schedule(step)
        s.replica.finish_grads()
        s.optimizer.step(p, s.params.grad, lr)
        for f in syncing(step, H, F, K):
            lo, hi = frags[f]
            outer[f].step(anchor[lo:hi], anchor[lo:hi] - p[lo:hi])
            p[lo:hi] = anchor[lo:hi]
        if (step + 1) % H == 0 or step + 1 == K:
            local = p.copy()
            p[...] = anchor
            evals.append(s.replica.evaluate(s.heldout))
            p[...] = local
    return anchor, evals


def test_fragments_on_the_servers_equal_the_schedule_replayed_and_f1_is_diloco(tmp_path):
    with ThreadPoolExecutor(3) as pool:  # each run with its own servers, at once
        runs = {name: pool.submit(run, tmp_path, name, extra)
                for name, extra in (("f2", ["--fragments", "2"]), ("f1", ["--fragments", "1"]),
                                    ("diloco", []))}
        (f2, f2_records), (f1, f1_records), (diloco, diloco_records) = \
            (runs[n].result() for n in ("f2", "f1", "diloco"))
    want, want_evals = replayed(2)
    np.testing.assert_array_equal(f2, want)
    assert [r["eval_loss"] for r in f2_records if "eval_loss" in r] == want_evals
    syncs = [(r["step"], r["fragments"]) for r in f2_records if "outer_round" in r]
    assert syncs == [(2, [0]), (4, [1]), (6, [0]), (8, [1]), (10, [0, 1])]
    n = f2.size
    lo, hi = fragment_ranges([(0, 40), (40, 67)], 2)[0]  # the tiny MLP's: l0 | out
    assert [r["push_bytes"] for r in f2_records if "outer_round" in r] == \
        [4 * (hi - lo), 4 * (n - hi), 4 * (hi - lo), 4 * (n - hi), 4 * n]
    np.testing.assert_array_equal(f1, diloco)
    assert [r["loss"] for r in f1_records] == [r["loss"] for r in diloco_records]
    assert [r.get("eval_loss") for r in f1_records] == \
        [r.get("eval_loss") for r in diloco_records]


@pytest.mark.parametrize("flags, why", [
    (["--fragments", "2"], "--fragments 2 needs --local-steps H: it cuts"),
    (["--fragments", "3", "--local-steps", "4"],
     "--local-steps 4 must be a multiple of --fragments 3"),
    (["--fragments", "2", "--local-steps", "4", "--dylu"], "--fragments 2 with --dylu"),
    (["--fragments", "-1", "--local-steps", "4"], "--fragments must not be negative")])
def test_its_flags_are_refused_by_name(flags, why):
    with pytest.raises(ConfigError, match=why):
        worker_configs(parse_args(["--servers", "127.0.0.1:1", *flags]))
