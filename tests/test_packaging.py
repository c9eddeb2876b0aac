"""dtlab installs under one namespace (dtlab.models, dtlab.collective, dtlab.pserver,
dtlab.protos): a user's own `models` package neither shadows ours nor is shadowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


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


@pytest.mark.parametrize("command", ["dtlab-train", "dtlab-sync", "dtlab-pserver",
                                     "dtlab-worker", "dtlab-cost"])
def test_console_scripts_answer_help(command, tmp_path):
    args = ["serve", "--help"] if command == "dtlab-pserver" else ["--help"]
    out = subprocess.run([str(BIN / command), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {command}")
