"""Workers as a person launches them: ids, run config, what a worker reports and says.

Real worker processes against real shards on loopback: workers launched
without ids get distinct ids (the same on every shard) and distinct data,
and every push is applied; a second live process with a taken id is
refused, a restarted one takes its id over; a worker whose run config
differs is refused naming the fields; the metrics header records the
optimizer the servers run; a worker whose servers are not up says so while
it waits; every error is one line.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from support.pserver_util import (
    ONE_BLAS_THREAD,
    ROOT,
    TINY_MLP,
    TINY_MLP_FLAGS,
    addresses,
    connect,
    run_workers,
    serve,
)
from test_pserver_store import N, store

from dtlab.models.run.metrics import read_metrics
from dtlab.pserver.common import runconfig
from dtlab.pserver.common.errors import AlreadyExists, FailedPrecondition

ADAM = {"optimizer": "adam", "lr": 3e-3, "warmup": 0, "schedule": "constant", "clip": 0.0}
WORKER = [*TINY_MLP_FLAGS, "--n-samples", "256", "--label-noise", "0.1", "--batch-size", "8",
          "--clip", "0.5", "--log-every", "1"]
DATA = {"n_samples": 256, "label_noise": 0.1}


def worker(servers: str, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtlab.pserver.worker", "--servers", servers,
                           *WORKER, *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ONE_BLAS_THREAD)


def error_line(stderr: str) -> str:
    """The one error line of a failed worker; nothing else on stderr is an error."""
    lines = stderr.strip().splitlines()
    assert all(w not in stderr for w in ("Traceback", "_InactiveRpcError", "debug_error_string",
                                         "add_port.cc")), stderr
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]], stderr
    return lines[-1]


def test_workers_without_ids_get_their_own_ids_data_and_steps(tmp_path):
    """Two workers launched apart without --worker-id: ids 0 and 1 on both shards, each
    reads its own data shard, every one of their pushes is applied; a third worker
    joining later runs all of its steps. Headers record what the servers run."""
    K = 12
    with serve(shards=2, optim=ADAM, data=DATA, num_workers=2) as daemons:
        servers = addresses(daemons)
        paths = run_workers(servers, 2, [*WORKER, "--steps", str(K)], tmp_path, ids=False)
        late = run_workers(servers, 1, [*WORKER, "--steps", str(K)], tmp_path, ids=False,
                           name="late")
        stats = [d.store.stats() for d in daemons]
    headers = [read_metrics(str(p))[0] for p in paths + late]
    assert sorted(h["worker"] for h in headers[:2]) == [0, 1] and headers[2]["worker"] == 2
    for st in stats:  # every push of every worker applied, none taken for a duplicate
        assert st.pushes == st.updates == 3 * K and st.duplicates == 0
        # every worker ran all its steps (a late joiner's clock starts at the slowest's)
        assert {w: ws.next_step for w, ws in st.workers.items()} == {0: K, 1: K, 2: K}
    losses = [[r["loss"] for r in read_metrics(str(p))[1]] for p in paths]
    assert len(losses[0]) == len(losses[1]) == K and losses[0] != losses[1]  # not one worker
    for h in headers:
        assert h["world"] == 2  # the servers' --num-workers
        assert h["config"]["optim"] == {**h["config"]["optim"], **ADAM, "clip": 0.5}
        assert (h["consistency"], h["schedule_steps"], h["staleness_lr"]) == ("asp", 0, "none")
    err = (tmp_path / "late0.err").read_text()
    assert "worker 2: " in err and "reads data shard 0 of 2" in err
    assert all(" worker" in line for line in err.splitlines() if " INFO " in line)


def test_a_live_id_is_refused_and_a_restarted_worker_takes_it_over(tmp_path):
    with serve(data=DATA, num_workers=1, allow_takeover=True) as daemons:
        servers, store_ = addresses(daemons), daemons[0].store
        first = subprocess.Popen(
            [sys.executable, "-m", "dtlab.pserver.worker", "--servers", servers, *WORKER,
             "--worker-id", "0", "--steps", "1000000"], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=ONE_BLAS_THREAD)
        try:
            deadline = time.monotonic() + 30
            while store_.stats().pushes < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            second = worker(servers, "--worker-id", "0", "--steps", "3")
            assert second.returncode == 1
            line = error_line(second.stderr)
            assert "ALREADY_EXISTS" in line and "worker 0 is taken" in line, line
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
            while store_.clocks.workers[0].live and time.monotonic() < deadline:
                time.sleep(0.02)  # the killed process's session ends with its connection
            done = store_.stats().workers[0].next_step
            again = worker(servers, "--worker-id", "0", "--steps", str(done + 3),
                           "--metrics", str(tmp_path / "again.jsonl"))
            assert again.returncode == 0, again.stderr
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(timeout=30)
        assert f"rejoins at step {done}" in again.stderr
        assert [r["step"] for r in read_metrics(str(tmp_path / "again.jsonl"))[1]] == [
            done + 1, done + 2, done + 3]
        assert store_.stats().workers[0].next_step == done + 3


def test_a_second_registration_is_refused_while_the_first_is_live():
    s = store()
    assert s.register(None, "toy", N, 0, registration=11)[0] == 0  # assigned
    assert s.register(None, "toy", N, 0, registration=11)[0] == 0  # a retry: the same id
    assert s.register(None, "toy", N, 0, registration=12)[0] == 1  # another process: a new id
    with s.holding(0, 11), pytest.raises(AlreadyExists, match="worker 0 is taken"):
        s.register(0, "toy", N, 0, registration=13)
    s.register(0, "toy", N, 0, registration=13)  # not live: taken over (a restart)
    with pytest.raises(FailedPrecondition, match="registered by another process"), \
            s.holding(0, 11):  # a call of the process that held it before
        pass
    s.push(0, 0, 0, np.ones(N, np.float32))
    assert s.stats().workers[0].next_step == 1


def test_a_worker_whose_run_config_differs_is_refused_naming_the_fields():
    with serve(data=DATA) as daemons:
        out = worker(addresses(daemons), "--label-noise", "0.2", "--seed", "4", "--steps", "2")
        assert out.returncode == 1
        line = error_line(out.stderr)
        assert "FAILED_PRECONDITION" in line and "run config" in line
        assert "data.label_noise: worker 0.2, server 0.1" in line and "run.seed: worker 4" in line
        assert not daemons[0].store.clocks.workers  # nothing registered


def test_a_model_mismatch_is_said_once_on_one_line():
    with serve(model_cfg={**TINY_MLP, "d_hidden": 9}, data=DATA) as daemons:
        out = worker(addresses(daemons), "--steps", "2")
        assert out.returncode == 1
        line = error_line(out.stderr)
        assert line.count("model.d_hidden: worker 8, server 9") == 1, line
        assert "FAILED_PRECONDITION" in line
        assert f"127.0.0.1:{daemons[0].port}" in line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_waiting_for_its_servers_says_so():
    port = free_port()
    out = worker(f"127.0.0.1:{port}", "--connect-timeout-s", "5.5", "--steps", "1")
    assert out.returncode == 1
    waits = [line for line in out.stderr.splitlines() if "waiting for" in line]
    assert len(waits) == 2, out.stderr  # at once, and 5 s later
    assert f"waiting for 127.0.0.1:{port} (connection refused), 0 s of 5.5" in waits[0]
    assert "worker: " in waits[0]
    assert "(connection refused), 5 s of 5.5" in waits[1]
    line = error_line(out.stderr)
    assert f"127.0.0.1:{port}: not serving after 5.5 s (connection refused)" in line


def test_register_reports_what_the_servers_run():
    with serve(optim=ADAM, consistency="ssp", staleness=2, num_workers=3,
               schedule_steps=40) as daemons:
        client = connect(addresses(daemons))
        try:
            info = client.server
            assert json.loads(info.optim_config)["optimizer"] == "adam"
            assert (info.num_workers, info.schedule_steps, info.staleness_bound) == (3, 40, 2)
        finally:
            client.close()


COSINE = {"optimizer": "sgd", "lr": 0.1, "warmup": 0, "schedule": "cosine", "clip": 0.0}


def test_the_servers_horizon_in_worker_steps():
    """schedule_steps over the updates one worker step makes: one under BSP, one per push of
    --num-workers otherwise; none where the lr does not depend on it."""
    def record(consistency, workers, updates, optim=COSINE):
        return {"server": {"consistency": consistency, "num_workers": workers,
                           "schedule_steps": updates, "seed": 0, "dtype": "float32"},
                "optim": optim}
    assert runconfig.horizon(record("bsp", 4, 600)) == 600
    assert runconfig.horizon(record("asp", 4, 600)) == 150
    assert runconfig.horizon(record("ssp", 3, 100)) == 100 / 3  # no whole number: no match
    assert runconfig.horizon(record("asp", 0, 600)) == 600
    assert runconfig.horizon(record("bsp", 2, 0)) is None  # constant after warm-up
    assert runconfig.horizon(record("bsp", 2, 600, {**COSINE, "schedule": "constant"})) is None
    assert runconfig.horizon(record("bsp", 2, 40, {**COSINE, "warmup": 50})) is None
    server = runconfig.of_record(record("bsp", 2, 600))
    assert server["run"] == {"seed": 0, "dtype": "float32", "steps": 600}
    mine = {"run": {"seed": 0, "dtype": "float32", "steps": 60}}
    assert runconfig.differences(server, mine)[0].startswith("run.steps: worker 60, server 600")
    assert not runconfig.differences(server, {"run": {"seed": 0, "dtype": "float32"}})
    assert not runconfig.differences(runconfig.of_record(record("bsp", 2, 0)), mine)


def test_a_worker_whose_run_length_differs_from_the_servers_schedule_is_refused():
    """Servers whose cosine schedule spans 3 BSP rounds: a worker of 2 steps would train
    another schedule than a sync run of 2 steps, and is refused naming both numbers; one
    of 3 steps runs."""
    with serve(optim=COSINE, data=DATA, consistency="bsp", num_workers=1,
               schedule_steps=3) as daemons:
        servers = addresses(daemons)
        short = worker(servers, "--steps", "2", "--worker-id", "0")
        assert short.returncode == 1
        line = error_line(short.stderr)
        assert "FAILED_PRECONDITION" in line and "run.steps: worker 2, server 3" in line, line
        assert not daemons[0].store.clocks.workers
        assert worker(servers, "--steps", "3", "--worker-id", "0").returncode == 0
        assert daemons[0].store.version == 3
