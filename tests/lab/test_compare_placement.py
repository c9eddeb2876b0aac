"""dtlab-compare --launcher (compare/placement.py): the placement rule, the srun command
lines built from a Slurm allocation's environment (given here: no srun on this machine)
and refused cleanly without one, and the comparison through mpiexec over "ssh" to two
emulated hosts (Hydra's launcher replaced by the namespace launcher through
HYDRA_LAUNCHER_EXEC): the links probed and named in the report, BSP equal to sync."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.mpirun import mpirun
from test_compare import TINY, compare, left_behind, losses

from dtlab.lab.compare import cluster, placement
from dtlab.lab.compare.placement import async_hosts, expand_nodelist, rank_hosts
from dtlab.models.config import ConfigError

pytestmark = pytest.mark.usefixtures("mpiexec")
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_the_placement_rule():
    assert rank_hosts(5, 1, 2) == [0, 1, 0, 1, 0]  # rank r on host r mod H
    assert rank_hosts(8, 2, 2) == [0, 0, 1, 1, 0, 0, 1, 1]  # a tp 2 group on one host
    assert async_hosts(2, 2, 1, 2) == [0, 1, 0, 1]  # shards first, then the workers
    assert async_hosts(3, 2, 1, 2) == [0, 1, 0, 0, 1]  # worker w on host w mod H


def test_slurm_node_lists_are_expanded():
    assert expand_nodelist("gpu[07-08,10],login1") == ["gpu07", "gpu08", "gpu10", "login1"]
    assert expand_nodelist("n[1-2]-ib[3-4]") == ["n1-ib3", "n1-ib4", "n2-ib3", "n2-ib4"]
    with pytest.raises(ConfigError, match="cannot read range 'a-b'"):
        expand_nodelist("n[a-b]")


def test_srun_lines_from_the_allocation(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 97\n")  # found on PATH, never run here
    (bin_dir / "srun").chmod(0o755)
    hosts = placement.srun_hosts({**SLURM, "PATH": str(bin_dir)})
    assert hosts.names == ["gpu07", "gpu08"] and "Slurm job 4242" in hosts.describe()
    sync, env = hosts.line([(4, ["dtlab-sync", "--config", "c.json"])],
                           rank_hosts(4, 1, 2), tmp_path, "sync-ring")
    assert sync == ["srun", "-n", "4", "--distribution=arbitrary", "--overcommit",
                    "--kill-on-bad-exit=1", "dtlab-sync", "--config", "c.json"]
    assert Path(env["SLURM_HOSTFILE"]).read_text().split() == ["gpu07", "gpu08"] * 2
    job, env = hosts.line([(2, ["dtlab-pserver", "serve", "--rendezvous", "rv"]),
                           (2, ["dtlab-worker", "--metrics", "w{worker}.jsonl"])],
                          async_hosts(2, 2, 1, 2), tmp_path, "async-bsp")
    assert job[-2:] == ["--multi-prog", str(tmp_path / "async-bsp.conf")]
    assert (tmp_path / "async-bsp.conf").read_text().splitlines() == [
        "0-1 dtlab-pserver serve --rendezvous rv", "2-3 dtlab-worker --metrics 'w{worker}.jsonl'"]
    assert Path(env["SLURM_HOSTFILE"]).read_text().split() == ["gpu07", "gpu08"] * 2


def test_mpiexec_lines_place_every_rank_by_the_rule(tmp_path):
    hosts = placement.mpiexec_hosts("a, b", "/x/mpiexec")
    cmd, env = hosts.line([(2, ["serve"]), (3, ["worker"])], async_hosts(2, 3, 1, 2),
                          tmp_path, "async-bsp")
    assert cmd == ["/x/mpiexec", "-launcher", "ssh", "-hosts", "a,b", "-rankmap", "0,1,0,1,0",
                   "-n", "2", "serve", ":", "-n", "3", "worker"] and env == {}
    with pytest.raises(ConfigError, match="give the hosts' names"):
        placement.mpiexec_hosts("2", "/x/mpiexec")


@pytest.mark.parametrize("args, env, named", [
    (["--launcher", "srun"], {"PATH": "/usr/bin:/bin"},
     "--launcher srun runs inside a Slurm allocation"),
    (["--launcher", "srun"], {**SLURM, "PATH": "/usr/bin:/bin"},
     "--launcher srun: no srun on PATH"),
    (["--launcher", "srun", "--hosts", "a,b"], SLURM, "leave --hosts out"),
    (["--launcher", "local", "--hosts", "2"], {}, "--launcher local runs on this host"),
    (["--launcher", "emulated", "--hosts", "a,b"], {}, "takes a number of hosts"),
    (["--launcher", "mpiexec", "--hosts", "a,b", "--tp", "2", "--runs", "async-bsp"], {},
     "a worker group (--tp/--pp) cannot have"),
])
def test_a_launcher_that_cannot_run_is_refused_before_anything_starts(tmp_path, args, env,
                                                                      named):
    r = compare(*TINY, *args, "--out", str(tmp_path / "o"), env=env, timeout=60)
    assert r.returncode == 2 and named in r.stderr, r.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.skipif(bool(cluster.check()), reason=cluster.check() or "-")
def test_the_comparison_through_mpiexec_on_two_emulated_hosts(tmp_path):
    out = tmp_path / "out"
    with cluster.EmulatedCluster(2, 1.0, tmp_path / "hosts") as hosts:
        # Hydra's ssh launcher, replaced by the one that enters the emulated hosts
        ssh = {"HYDRA_LAUNCHER_EXEC": str(hosts.launcher), "HYDRA_IFACE": hosts.bridge,
               **hosts.env}
        r = compare("--config", "emulated-mlp", "--steps", "6", "--eval-every", "3",
                    "--runs", "sync-ring,async-bsp", "--launcher", "mpiexec",
                    "--hosts", ",".join(hosts.host_names), "--out", str(out), env=ssh,
                    timeout=180)
        print(r.stderr[-3000:])
        left = [subprocess.run(["ip", "netns", "pids", hosts.namespace(i)], capture_output=True,
                               text=True).stdout.split() for i in range(2)]
    assert r.returncode == 0, r.stderr
    assert left == [[], []]  # every process of every run ended, on both hosts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cluster"].startswith("2 hosts h0, h1 (mpiexec: Hydra over ssh); links "
                                         "measured at the start (links.json): MPI all-reduce")
    links = json.loads((out / "links.json").read_text())
    assert links["hosts"] == ["h0", "h1"] and links["mpi"]["bus_gbit"] > 0
    assert [(g["from"], g["to"]) for g in links["grpc"]] == [("h1", "h0")]
    assert links["grpc"][0]["address"].startswith(hosts.address(0) + ":")
    header = (out / "report.md").read_text().split("\n## ")[0]
    assert "network: 2 hosts h0, h1" in header and "gRPC h1 -> h0" in header
    sync, bsp = summary["runs"]
    assert sync["status"] == bsp["status"] == "ok", (sync["error"], bsp["error"])
    assert "-rankmap" in sync["commands"][0] and ":" in bsp["commands"][0]
    workers = [losses(out / f"async-bsp.w{w}.jsonl") for w in (0, 1)]
    assert list(np.mean(workers, axis=0)) == losses(out / "sync-ring.jsonl")  # to the last bit
    assert not left_behind(tmp_path)


def test_the_probe_refuses_two_ranks_on_one_host(tmp_path):
    r = mpirun(2, "-m", "dtlab.lab.compare.probe", str(tmp_path / "l.json"), timeout=60)
    assert r.rc != 0 and "one rank per host" in r.stderr + r.stdout, r
    assert not (tmp_path / "l.json").exists()
