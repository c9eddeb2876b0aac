"""The parameter-server worker's exchanges (pserver/worker/exchange.py) driven by the
trainer's one step (models/run/trainer.py) against a real server on loopback: what the
interface says of them (models/run/exchange.py) holds. A plain worker's optimizer never
runs (the servers' does) and an evaluation after the last push, which pulls nothing,
reads the servers' values; a local-SGD worker's optimizer takes every inner step and
its exchange pushes once a round."""

from __future__ import annotations

import numpy as np
from support.pserver_util import SGD1, TINY_MLP_FLAGS, addresses, serve

from dtlab.models.config import from_namespace
from dtlab.models.run.metrics import MetricsLog, read_metrics
from dtlab.models.run.session import build_session
from dtlab.models.run.trace import Trace
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.exchange import OuterPushPull, PushPull
from dtlab.pserver.worker.flags import parse_args
from dtlab.pserver.worker.loop import Worker, connect, leave

STEPS = 4


def run_worker(daemons, flags: list[str], exchange, path):
    """One registered worker of STEPS steps through `Worker` with `exchange(session,
    client, trace)`; its session and metrics records."""
    setup = parse_args(["--servers", addresses(daemons), *TINY_MLP_FLAGS, "--worker-id", "0",
                        "--num-workers", "1", "--steps", str(STEPS), "--batch-size", "4",
                        "--eval-every", str(STEPS), *flags])
    session = build_session(setup)
    cfg = from_namespace(ClientConfig, setup.extra)
    client = PSClient(cfg, transport=cfg.transport, shm=cfg.shm)
    try:
        first = connect(client, setup, 0, session.params)
        trace = Trace("", pid=0, process="test worker")
        metrics = MetricsLog(str(path), {"type": "header"})
        try:
            Worker(session, metrics, exchange(session, client, trace), client, 0, trace,
                   first).run()
        finally:
            metrics.close()
            leave(client)
    finally:
        client.close()
    return session, read_metrics(str(path))[1]


def test_a_plain_workers_optimizer_never_runs_and_it_ends_on_the_servers_values(tmp_path):
    with serve(1, optim=SGD1) as daemons:
        session, records = run_worker(daemons, [], PushPull, tmp_path / "w.jsonl")
        assert session.optimizer.steps == 0  # optimizer_here is False: the servers step
        assert daemons[0].store.version == STEPS
        # the last step pushed alone; the evaluation after it pulled the servers' values
        assert np.array_equal(session.params.data, daemons[0].store.params)
    assert [r["version"] for r in records] == [[v] for v in range(1, STEPS + 1)]
    assert all(r["lr"] == SGD1["lr"] and r["staleness"] == [0] and r["pull_s"] >= 0
               and r["push_bytes"] == session.params.data.nbytes for r in records)
    assert [r["pull_bytes"] for r in records] == [session.params.data.nbytes] * (STEPS - 1) + [0]
    assert "eval_loss" in records[-1]


def test_a_local_sgd_workers_optimizer_takes_every_inner_step_and_pushes_once_a_round(
        tmp_path):
    with serve(1, optim=SGD1, outer_optimizer="sgd") as daemons:
        session, records = run_worker(
            daemons, ["--local-steps", "2", "--optimizer", "sgd", "--lr", "0.1"],
            lambda s, c, t: OuterPushPull(s, c, t, local_steps=2), tmp_path / "w.jsonl")
        assert session.optimizer.steps == STEPS  # optimizer_here: every inner step
        assert daemons[0].store.version == STEPS // 2  # one outer update a round
        assert np.array_equal(session.params.data, daemons[0].store.params)
    assert [r.get("outer_round") for r in records] == [None, 1, None, 2]
    # the inner schedule's lr in every record, the servers' outer lr at a round's end
    assert [r["lr"] for r in records] == [session.schedule(i) for i in range(STEPS)]
    assert [r.get("outer_lr") for r in records] == [None, 1.0, None, 1.0]
