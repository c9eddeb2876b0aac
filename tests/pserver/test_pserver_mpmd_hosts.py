"""The async topology's one launch across two emulated hosts (lab/compare/cluster.py:
network namespaces on a shaped bridge, Hydra's ssh launcher into them): the MPMD job of
servers and workers ends bit for bit on the parameters of the run launched by hand on one
host, with the addresses exchanged over MPI and through a shared rendezvous directory;
each server listens on the address the other host reaches (the rule of
pserver/common/rendezvous.py, never a wildcard); a host that dies ends the job with a
message within seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.mpirun import ROOT, mpirun
from support.pserver_util import ONE_BLAS_THREAD
from test_pserver_launch import SERVER, STEPS, S, W, by_hand, config, final_params

from dtlab.lab.compare import cluster as emulated
from dtlab.models.config import ConfigError, build
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics
from dtlab.pserver.common.config import ServerConfig

pytestmark = [pytest.mark.usefixtures("mpiexec"),
              pytest.mark.skipif(bool(emulated.check()), reason=emulated.check() or "-")]
assert by_hand  # the fixture of the run launched by hand, shared with test_pserver_launch
N_PARAMS = 4 * 16 + 16 + 16 * 3 + 3  # the tiny MLP of test_pserver_launch.CONFIG
RULE = """
from dtlab.models.config import ConfigError, build
from dtlab.pserver.common.rendezvous import bind_address
print(bind_address(None, "", ["h1"]), bind_address(None, "", None))
try:
    bind_address(None, "", ["nosuch-host"])
except ConfigError as e:
    print(e)
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two emulated hosts at 1 Gbit/s; removed after the module, also when a test fails."""
    with emulated.EmulatedCluster(2, 1.0, tmp_path_factory.mktemp("hosts")) as made:
        yield made


def job(hosts, tmp, server: list[str], worker: list[str]) -> list[str]:
    """The MPMD line across `hosts`: S servers (ranks 0, 1: hosts h0, h1), then W workers
    (ranks 2, 3: h0, h1), the servers logging the address they give the job."""
    c = config(tmp)
    return [*hosts.mpiexec_args(), "-n", str(S), sys.executable, "-m", "dtlab.pserver", "serve",
            "--config", c, "--checkpoint-dir", str(tmp / "ckpt"), *SERVER, "--log-level", "info",
            *server, ":", "-n", str(W), sys.executable, "-m", "dtlab.pserver.worker",
            "--config", c, "--servers", "auto", "--metrics", str(tmp / "w{worker}.jsonl"),
            *worker]


def run_job(hosts, tmp, server: list[str], worker: list[str]):
    sent = hosts.bytes_sent()
    args = job(hosts, tmp, server, worker)
    r = mpirun(S, *args[args.index("-n") + 3:], wrap=False, timeout=60,
               launcher_args=tuple(args[:args.index("-n")]), env={**ONE_BLAS_THREAD,
                                                                **hosts.env})
    assert r.rc == 0, r
    return r, [b - a for a, b in zip(sent, hosts.bytes_sent(), strict=True)]


def losses(path) -> list[float]:
    return [r["loss"] for r in read_metrics(str(path))[1]]


def left_on(hosts, host: int) -> list[str]:
    """The pids of the processes still running in emulated host `host`."""
    return subprocess.run(["ip", "netns", "pids", hosts.namespace(host)], capture_output=True,
                          text=True).stdout.split()


def test_the_bind_rule_picks_the_address_the_other_host_reaches(hosts):
    """In a host: the route to the other host's name (resolved as a cluster's DNS would),
    the default route's interface without the job's hosts, a name that does not resolve
    named; never 127.0.0.1 or a wildcard."""
    # one try of one second at the resolver the host cannot reach (glibc's default: 5 s, twice)
    env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
    r = subprocess.run(["ip", "netns", "exec", hosts.namespace(0), sys.executable, "-c", RULE],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{hosts.address(0)} {hosts.address(0)}"
    assert lines[1].startswith("cannot resolve the job's host 'nosuch-host'")
    assert "--bind ADDR or --bind-interface NAME" in lines[1]


def test_mpmd_job_across_two_hosts_equals_the_run_by_hand(hosts, tmp_path, by_hand):
    r, sent = run_job(hosts, tmp_path, ["--rendezvous", "auto", "--port", "0"], [])
    np.testing.assert_array_equal(final_params(tmp_path / "ckpt"), by_hand)
    given = re.findall(r"shard (\d): .*address ([\d.]+):\d+ given to the job", r.stderr)
    assert sorted(given) == [("0", hosts.address(0)), ("1", hosts.address(1))], r.stderr
    # every step pulls and pushes half the model across each host's shaped link
    assert all(b > STEPS * N_PARAMS * 4 for b in sent), sent
    headers = [json.loads((tmp_path / f"w{w}.jsonl").read_text().splitlines()[0])
               for w in range(W)]
    assert sorted(h["worker"] for h in headers) == list(range(W))


def test_a_shared_rendezvous_directory_across_two_hosts_equals_the_run_by_hand(
        hosts, tmp_path, by_hand):
    rv = tmp_path / "rv"
    r, _ = run_job(hosts, tmp_path, ["--rendezvous", str(rv), "--num-shards", str(S),
                                     "--port", "0"], ["--rendezvous", str(rv)])
    np.testing.assert_array_equal(final_params(tmp_path / "ckpt"), by_hand)
    written = re.findall(r"shard (\d): .*address ([\d.]+):\d+ written to", r.stderr)
    assert sorted(written) == [("0", hosts.address(0)), ("1", hosts.address(1))], r.stderr
    assert not list(rv.glob("shard-*.json"))


def test_a_host_that_dies_ends_the_job_with_a_message_within_seconds(hosts, tmp_path):
    args = job(hosts, tmp_path, ["--rendezvous", "auto", "--port", "0", "--schedule-steps", "0"],
               ["--steps", "1000000", "--retries", "2"])  # no lr horizon: any --steps
    proc = subprocess.Popen([mpiexec_path(), *args], cwd=ROOT, env={**ONE_BLAS_THREAD, **hosts.env,
                                                "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = tmp_path / "w0.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        assert hosts.kill(1) >= 3  # its Hydra proxy, its server and its worker
        killed = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    # Hydra's proxy on host 0 loses mpiexec and ends its ranks (the server, the worker)
    while left_on(hosts, 0) and time.monotonic() < killed + 15:
        time.sleep(0.1)
    gone = time.monotonic() - killed
    print(f"mpiexec ended {took:.1f} s after host 1 died (rc {proc.returncode}), host 0's "
          f"processes {gone:.1f} s after")
    assert proc.returncode != 0 and took < 15, (took, err[-3000:])
    assert re.search(r"\[mpiexec@.*\] .*error", err), err[-3000:]  # says why it ended
    assert not left_on(hosts, 0)


def refuses_replicas() -> str:
    """Why ServerConfig refuses --rendezvous auto with --replicas 2 ('' once it takes it)."""
    try:
        build(ServerConfig, {"rendezvous": "auto", "replicas": 2})
    except ConfigError as e:
        return f"pserver/common/config.py still refuses it: {e}"
    return ""


@pytest.mark.skipif(bool(refuses_replicas()), reason=refuses_replicas() or "-")
def test_replicated_shards_put_their_two_replicas_on_different_hosts(hosts, tmp_path):
    """4 servers round-robin on h0, h1 keep 2 shards: each shard's primary on one host, its
    backup on the other (the rule of pserver/common/rendezvous.py); the workers train as
    an unreplicated job does, to the last bit."""
    plain, replicated = tmp_path / "plain", tmp_path / "replicated"
    for folder, servers, extra in ((plain, S, []), (replicated, 2 * S, ["--replicas", "2"])):
        folder.mkdir()
        args = job(hosts, folder, ["--rendezvous", "auto", "--port", "0", *extra], [])
        args.remove("--checkpoint-dir")
        args.remove(str(folder / "ckpt"))
        r = mpirun(servers, *args[args.index("-n") + 3:], wrap=False, timeout=60,
                   launcher_args=tuple(args[:args.index("-n")]),
                   env={**ONE_BLAS_THREAD, **hosts.env})
        assert r.rc == 0, r
    given = re.findall(r"shard (\d): .*address ([\d.]+):\d+ given to the job", r.stderr)
    assert sorted(given) == sorted((str(k), hosts.address(h)) for k in range(S)
                                   for h in range(2)), r.stderr
    joined = re.findall(r"shard (\d): .*backup ([\d.]+):\d+ joined", r.stderr)
    assert sorted(joined) == [(str(k), hosts.address(1)) for k in range(S)], r.stderr
    for w in range(W):
        assert losses(replicated / f"w{w}.jsonl") == losses(plain / f"w{w}.jsonl")
