"""Held-out evaluation (--eval-every): fresh draws of the data source, the same for every
run and topology, evaluated with the forward pass only."""

import subprocess
import sys

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.models.data import DataConfig, make_dataset, make_heldout
from dtlab.models.mlp import MLPConfig
from dtlab.models.run.metrics import read_metrics
from dtlab.models.transformer import TransformerConfig

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP = ["--model", "mlp", "--d-in", "8", "--n-classes", "4", "--d-hidden", "32", "--seed", "6",
       "--n-samples", "4096", "--eval-every", "4", "--eval-samples", "256"]
LM = ["--model", "transformer", "--vocab", "8", "--seq-len", "8", "--d-model", "16",
      "--n-heads", "2", "--n-layers", "2", "--d-ff", "32", "--n-tokens", "20000", "--seed", "6",
      "--eval-every", "4", "--eval-samples", "64"]


@pytest.mark.parametrize("model,cfg", [("mlp", MLPConfig(d_in=8, n_classes=4)),
                                       ("transformer", TransformerConfig(vocab=8, seq_len=8))])
def test_heldout_examples_are_fresh_draws_of_the_same_source(model, cfg):
    data = DataConfig(n_samples=512, n_tokens=4096)
    train, cfg = make_dataset(data, model, cfg)
    held = make_heldout(data, model, cfg, 100)
    again = make_heldout(data, model, cfg, 100)
    x, _ = held.batch(np.arange(100))
    np.testing.assert_array_equal(x, again.batch(np.arange(100))[0])  # the same every time
    assert not np.array_equal(x, train.batch(np.arange(100))[0])  # another draw
    if model == "mlp":  # continuous inputs: a training example would be the same draw
        seen = {row.tobytes() for row in train.batch(np.arange(train.n))[0]}
        assert not any(row.tobytes() in seen for row in x)
    assert held.floor == train.floor and held.describe()["source"] == train.describe()["source"]


def test_real_data_has_no_heldout_split_yet():
    r = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", "--model", "mlp",
                        "--data", "digits", "--eval-every", "5", "--steps", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--eval-every needs --data teacher or markov" in r.stderr, r


def eval_losses(path):
    _, records = read_metrics(str(path))
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


@pytest.mark.parametrize("argv,grid", [(MLP, ["--dp", "2"]), (LM, ["--pp", "2"])],
                         ids=["mlp-dp2", "lm-pp2"])
def test_every_topology_evaluates_the_same_examples_at_the_same_steps(tmp_path, argv, grid):
    """A sync run and its single-process twin on the same global batch report equal
    held-out losses at steps 4, 8 and the last."""
    dp = 2 if grid[0] == "--dp" else 1
    run = ["--steps", "10", "--batch-size", "8"]
    single = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *argv, *run[:2],
                             "--batch-size", str(8 * dp), "--metrics", tmp_path / "one.jsonl"],
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    r = mpirun(2, "-m", "dtlab.collective.train", *argv, *grid, *run,
               "--metrics", tmp_path / "sync.jsonl", timeout=120)
    assert r.rc == 0, r
    one, sync = eval_losses(tmp_path / "one.jsonl"), eval_losses(tmp_path / "sync.jsonl")
    assert sorted(one) == sorted(sync) == [4, 8, 10]
    for step in one:
        assert sync[step] == pytest.approx(one[step], rel=1e-5), (step, one, sync)
