"""One launch for the async topology (pserver.common.rendezvous): an mpiexec MPMD job of
servers and workers, and a rendezvous directory without MPI, each ending on the exact
parameters of the same BSP run launched by hand; a dead server ends its workers; the
launcher's environment (Slurm's, given here) read into roles and shards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from support.mpirun import mpirun
from support.pserver_util import ONE_BLAS_THREAD, ROOT, DaemonProcess, run_workers

from dtlab.models.config import ConfigError
from dtlab.models.run import checkpoint
from dtlab.pserver.common import rendezvous
from dtlab.pserver.common.rendezvous import Place, place_from_env, place_in

pytestmark = pytest.mark.usefixtures("mpiexec")

S, W, STEPS = 2, 2, 6  # two workers: a BSP round's sum a + b is the same in either order
CONFIG = {"model_name": "mlp", "model": {"d_in": 4, "d_hidden": 16, "n_layers": 1,
                                         "n_classes": 3},
          "optim": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "clip": 0.0, "warmup": 0},
          "run": {"steps": STEPS, "batch_size": 8, "seed": 3}}
SERVER = ["--consistency", "bsp", "--grace-s", "2", "--log-level", "warning"]


def config(tmp) -> str:
    path = tmp / "run.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def final_params(ckpt) -> np.ndarray:
    """The parameters of every shard's newest checkpoint, in shard order."""
    return np.concatenate([checkpoint.load(checkpoint.latest(str(ckpt / f"shard-{k}-of-{S}")))
                           [0]["params"] for k in range(S)])


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory) -> np.ndarray:
    """The run launched by hand: --shard / --num-shards / --port per daemon, --servers listed."""
    tmp = tmp_path_factory.mktemp("by_hand")
    c, ckpt = config(tmp), tmp / "ckpt"
    daemons = [DaemonProcess(tmp, ["--config", c, "--shard", str(k), "--num-shards", str(S),
                                   "--num-workers", str(W), "--checkpoint-dir", str(ckpt),
                                   *SERVER], env=ONE_BLAS_THREAD, wait=False) for k in range(S)]
    try:
        for d in daemons:  # started together, waited for together
            d.wait_ready()
        run_workers(",".join(d.address for d in daemons), W, ["--config", c], tmp)
        assert [d.terminate() for d in daemons] == [0] * S
    finally:
        for d in daemons:
            d.close()
    return final_params(ckpt)


def test_mpmd_job_equals_the_run_launched_by_hand(tmp_path, by_hand):
    c, ckpt = config(tmp_path), tmp_path / "ckpt"
    r = mpirun(S, "-m", "dtlab.pserver", "serve", "--config", c, "--rendezvous", "auto",
               "--checkpoint-dir", str(ckpt), *SERVER,
               ":", "-n", str(W), sys.executable, "-m", "dtlab.pserver.worker", "--config", c,
               "--servers", "auto", "--metrics", str(tmp_path / "w{worker}.jsonl"),
               wrap=False, timeout=60, env=ONE_BLAS_THREAD)
    assert r.rc == 0, r  # the servers end by themselves once their workers left
    np.testing.assert_array_equal(final_params(ckpt), by_hand)
    headers = [json.loads((tmp_path / f"w{w}.jsonl").read_text().splitlines()[0])
               for w in range(W)]
    assert sorted(h["worker"] for h in headers) == list(range(W))  # ids from the job, not ranks
    assert all(h["world"] == W for h in headers)


def test_rendezvous_directory_without_mpi_equals_the_run_by_hand(tmp_path, by_hand):
    c, ckpt, rv = config(tmp_path), tmp_path / "ckpt", tmp_path / "rv"
    daemons = [DaemonProcess(tmp_path, ["--config", c, "--rendezvous", str(rv), "--shard", str(k),
                                        "--num-shards", str(S), "--num-workers", str(W),
                                        "--checkpoint-dir", str(ckpt), *SERVER],
                             env=ONE_BLAS_THREAD, wait=False) for k in range(S)]
    try:
        for d in daemons:
            d.wait_ready()
        rendezvous.read_addresses(str(rv), 10)  # written just after the ready file
        files = [json.loads((rv / f"shard-{k}.json").read_text()) for k in range(S)]
        chosen = rendezvous.bind_address(None, "", None)  # the default route's interface
        assert [f["address"] for f in files] == [f"{chosen}:{d.port}" for d in daemons]
        assert chosen not in ("0.0.0.0", "::") and not list(rv.glob(".*tmp"))
        run_workers("auto", W, ["--config", c, "--rendezvous", str(rv)], tmp_path)
        assert [d.proc.wait(timeout=30) for d in daemons] == [0] * S  # ended with the job
    finally:
        for d in daemons:
            d.close()
    np.testing.assert_array_equal(final_params(ckpt), by_hand)
    assert not list(rv.glob("shard-*.json"))  # no later job reads them as live


def test_a_server_that_dies_ends_the_workers_with_a_message(tmp_path):
    c, rv = config(tmp_path), tmp_path / "rv"
    daemons = [DaemonProcess(tmp_path, ["--config", c, "--rendezvous", str(rv), "--shard", str(k),
                                        "--num-shards", str(S), "--log-level", "warning",
                                        "--schedule-steps", "0"],  # no horizon: any --steps
                             env=ONE_BLAS_THREAD, wait=False) for k in range(S)]
    try:
        for d in daemons:
            d.wait_ready()
        metrics = tmp_path / "w.jsonl"
        worker = subprocess.Popen(
            [sys.executable, "-m", "dtlab.pserver.worker", "--config", c, "--servers", "auto",
             "--rendezvous", str(rv), "--steps", "1000000", "--retries", "2",
             "--metrics", str(metrics)], cwd=ROOT, env=ONE_BLAS_THREAD,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > 3):
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        daemons[1].proc.kill()
        killed = time.monotonic()
        _, err = worker.communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        for d in daemons:
            d.close()
    assert worker.returncode == 1 and took < 10, (took, err)
    assert "error: UNAVAILABLE" in err, err


def test_a_worker_waits_for_the_missing_shards_bounded_and_names_them(tmp_path):
    rendezvous.write_address(str(tmp_path), 0, 3, "10.0.0.1:5000")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still no shard-1\.json, shard-2\.json"):
        rendezvous.read_addresses(str(tmp_path), timeout_s=0.3)
    assert time.monotonic() - t0 < 2
    for k in (1, 2):
        rendezvous.write_address(str(tmp_path), k, 3, f"10.0.0.{k + 1}:5000")
    assert rendezvous.read_addresses(str(tmp_path), 0.3) == [f"10.0.0.{k}:5000" for k in (1, 2, 3)]
    rendezvous.write_address(str(tmp_path), 2, 4, "10.0.0.9:5000")  # an earlier job's
    with pytest.raises(ConfigError, match="disagree on --num-shards"):
        rendezvous.read_addresses(str(tmp_path), 0.3)


def test_slurm_environment_gives_roles_and_shards():
    job = {"SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "3"}
    assert place_from_env("server", 2, {**job, "SLURM_PROCID": "1"}) == Place("server", 1, 2, 4)
    assert place_from_env("worker", 2, {**job, "SLURM_PROCID": "4"}) == Place("worker", 2, 2, 4)
    assert place_from_env("server", None, {**job, "SLURM_PROCID": "0",
                                           "DTLAB_NUM_SERVERS": "2"}) == Place("server", 0, 2, 4)
    assert place_from_env("server", 2, {"SLURM_LOCALID": "0"}) is None  # no launcher
    with pytest.raises(ConfigError, match="put the servers first"):
        place_from_env("server", 2, {**job, "SLURM_PROCID": "3"})
    with pytest.raises(ConfigError, match="put the workers after them"):
        place_from_env("worker", 2, {**job, "SLURM_PROCID": "1"})
    with pytest.raises(ConfigError, match="how many of the job's ranks are servers"):
        place_from_env("server", None, {**job, "SLURM_PROCID": "0"})
    with pytest.raises(ConfigError, match="leaves no worker"):
        place_from_env("server", 6, {**job, "SLURM_PROCID": "0"})


def test_mpi_roles_come_from_the_program_each_rank_runs():
    roles = ["server", "worker", "server", "worker", "worker"]  # any order of the MPMD line
    assert [place_in(roles, r) for r in range(5)] == [
        Place("server", 0, 2, 3), Place("worker", 0, 2, 3), Place("server", 1, 2, 3),
        Place("worker", 1, 2, 3), Place("worker", 2, 2, 3)]
    with pytest.raises(ConfigError, match="0 workers"):
        place_in(["server", "server"], 0)


def test_bind_address_by_rule():
    assert rendezvous.bind_address("10.1.2.3", "lo", ["x"]) == "10.1.2.3"  # --bind wins
    assert rendezvous.bind_address(None, "lo", None) == "127.0.0.1"  # --bind-interface
    assert rendezvous.bind_address(None, "", []) == "127.0.0.1"  # the job on this host only
    assert rendezvous.bind_address(None, "", ["localhost"]) == "127.0.0.1"  # the route to it
    with pytest.raises(ConfigError, match="--bind-interface nosuch0: no IPv4 address"):
        rendezvous.bind_address(None, "nosuch0", None)


def test_the_job_gives_the_shard_flags_are_refused():
    r = subprocess.run([sys.executable, "-m", "dtlab.pserver", "serve", "--model", "mlp",
                        "--rendezvous", "auto", "--shard", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines()[-1].endswith(
        "--rendezvous auto takes --shard from the job: leave it out")


def test_the_two_replicas_of_a_shard_go_to_different_hosts():
    """--rendezvous auto --replicas 2: the servers sorted by host, the j-th keeps shard
    j mod S, its primary when j < S (pserver/common/rendezvous.py)."""
    hosts = ["a", "a", "b", "b"]  # Hydra's -ppn 2: servers 0, 1 on a, 2, 3 on b
    assert rendezvous.replica_places(hosts) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    hosts = ["a", "b", "c", "a", "b", "c"]  # round-robin over three hosts
    places = rendezvous.replica_places(hosts)
    assert sorted(places) == [(k, r) for k in range(3) for r in (0, 1)]
    for k in range(3):
        assert len({hosts[i] for i, (shard, _) in enumerate(places) if shard == k}) == 2
    assert rendezvous.replica_places(["x"] * 4) == [(0, 0), (1, 0), (0, 1), (1, 1)]  # one host
    with pytest.raises(ConfigError, match="host a runs 3 of the job's 4 servers"):
        rendezvous.replica_places(["a", "a", "a", "b"])
    with pytest.raises(ConfigError, match="an even number of servers"):
        rendezvous.replica_places(["a", "b", "c"])
    roles = ["server"] * 4 + ["worker"] * 3
    assert place_in(roles, 2, ["a", "a", "b", "b", "a", "b", "a"], 2) == \
        Place("server", 0, 2, 3, replica=1)
    assert place_in(roles, 5, ["a"] * 7, 2) == Place("worker", 1, 2, 3)
