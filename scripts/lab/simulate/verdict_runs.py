"""The comparisons the at-scale verdict is checked against (simulate/verdict_check.py):
dtlab-compare at N ranks or workers with the held-out target, on this host or, one
process a host, on N emulated hosts (network namespaces joined by links shaped to a
rate: compare/cluster.py; root and iproute2).

    folder = compare_at(8, "transformer", "sync-ring,async-asp,sync-local8", steps=600,
                        eval_every=10, out=Path("runs/val8"), hosts=8, link_gbit=1.0)

The command is the one a reader would type (its own line of the log); it exits 0, or 1
when a run failed (the check leaves a failed run out). Anything else ends the check
with dtlab-compare's last words.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dtlab.lab.compare import cluster
from dtlab.models.config import ConfigError


def command(n: int, config: str, runs: str, steps: int, eval_every: int, out: Path,
            hosts: int = 1, link_gbit: float = 1.0, timeout_s: float = 1800.0,
            extra: tuple[str, ...] = ()) -> list[str]:
    """dtlab-compare's argv for one comparison at n (hosts > 1: on emulated hosts)."""
    cmd = [sys.executable, "-m", "dtlab.lab.compare", "--tune", "none", "--seeds", "1",
           "--config", config, "--runs", runs, "--ranks", str(n), "--shards", "1",
           "--steps", str(steps), "--eval-every", str(eval_every), "--out", str(out),
           "--timeout", f"{timeout_s:g}", *extra]
    if hosts > 1:
        cmd += ["--launcher", "emulated", "--hosts", str(hosts), "--link-gbit",
                f"{link_gbit:g}"]
    return cmd


def emulated_missing() -> str:
    """'' when this machine can run emulated hosts, else why not."""
    return cluster.check()


def compare_at(n: int, config: str, runs: str, steps: int, eval_every: int, out: Path,
               hosts: int = 1, link_gbit: float = 1.0, timeout_s: float = 1800.0,
               extra: tuple[str, ...] = (), log=sys.stderr) -> Path:
    """Run one comparison (module docstring); its folder."""
    if hosts > 1 and emulated_missing():
        raise ConfigError(f"--hosts {hosts}: {emulated_missing()}")
    if hosts > 1 and n > hosts:
        raise ConfigError(f"--hosts {hosts}: the check runs one process a host (N = {n})")
    cmd = command(n, config, runs, steps, eval_every, out, hosts, link_gbit, timeout_s, extra)
    print("# measuring: python " + " ".join(cmd[1:]), file=log, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=timeout_s + 120)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"dtlab-compare at N = {n} exited with {done.returncode}: "
                           f"{done.stderr.strip()[-2000:]}")
    return out
