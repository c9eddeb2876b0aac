"""dtlab installs under one namespace (dtlab.models, dtlab.collective, dtlab.pserver,
dtlab.protos, dtlab.lab): a user's own `models` package neither shadows ours nor is
shadowed; a wheel installed (not editable) into a fresh venv runs the lab from outside
the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["dtlab-train", "dtlab-sync", "dtlab-pserver", "dtlab-worker", "dtlab-cost",
            "dtlab-compare", "dtlab-simulate", "dtlab-bench", "dtlab-replay"]


def test_a_users_models_package_does_not_shadow_ours(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("raise SystemExit('the user models')\n")
    (tmp_path / "models" / "train.py").write_text("raise SystemExit('the user train')\n")
    out = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", "--model", "mlp",
                          "--d-in", "4", "--d-hidden", "8", "--n-classes", "2",
                          "--n-samples", "64", "--batch-size", "4", "--steps", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "final training loss" in out.stdout
    mine = subprocess.run([sys.executable, "-c", "import models"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert "the user models" in mine.stderr  # theirs is still theirs


@pytest.mark.parametrize("command", COMMANDS)
def test_console_scripts_answer_help(command, tmp_path):
    args = ["serve", "--help"] if command == "dtlab-pserver" else ["--help"]
    out = subprocess.run([str(BIN / command), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {command}") or command == "dtlab-bench", out.stdout


@pytest.mark.usefixtures("mpiexec")
def test_a_wheel_installed_into_a_fresh_venv_runs_the_lab_outside_the_checkout(tmp_path):
    """The wheel (not an editable install) into a new venv whose only other packages are
    this environment's dependencies (a .pth naming its site-packages: no dtlab there is
    seen, the editable install's finder is not loaded); run from a folder outside the
    checkout: the simulator without mpi4py or a calibration, the comparison's help, a
    preset config by name, and a tiny comparison."""
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next(wheels.glob("dtlab-*.whl"))
    installed = subprocess.run([sys.executable, "-m", "pip", "--python",
                                str(venv / "bin" / "python"), "install", "--no-deps", "-q",
                                str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    away = tmp_path / "elsewhere"
    away.mkdir()
    # this environment's MPI: its launcher, and the library the mpich wheel put in its lib/
    libs = ":".join(filter(None, [str(Path(sys.prefix) / "lib"),
                                  os.environ.get("LD_LIBRARY_PATH")]))
    env = {**os.environ, "LD_LIBRARY_PATH": libs,
           "DTLAB_MPIEXEC": os.environ.get("DTLAB_MPIEXEC") or str(BIN / "mpiexec")}

    def run(*cmd, timeout=180):
        return subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:]], cwd=away, env=env,
                              capture_output=True, text=True, timeout=timeout)

    where = run("python", "-c", "import dtlab.lab, dtlab.models; print(dtlab.lab.__file__, "
                "dtlab.models.__file__)")
    assert where.returncode == 0 and str(ROOT) not in where.stdout, where.stdout + where.stderr
    simulate = run("python", "-c", "import sys; sys.argv = ['dtlab-simulate']\n"
                   "from dtlab.lab.simulate.cli import main\n"
                   "rc = main([])\n"
                   "assert 'mpi4py' not in sys.modules, 'the simulator imported mpi4py'\n"
                   "sys.exit(rc)")
    assert simulate.returncode == 0, simulate.stderr
    assert "nominal constants" in simulate.stdout and "--calibrate" in simulate.stdout
    assert run("dtlab-compare", "--help").returncode == 0
    out = away / "cmp"
    tiny = run("dtlab-compare", "--config", "emulated-mlp", "--steps", "6", "--runs",
               "sync-ring,async-asp", "--tune", "none", "--seeds", "1", "--target-loss", "5",
               "--out", str(out))
    assert tiny.returncode == 0, tiny.stderr
    assert (out / "report.md").exists() and (out / "summary.json").exists()
