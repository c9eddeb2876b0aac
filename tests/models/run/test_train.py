"""Single-process training: reaches the known floor, reproduces bit for bit,
resumes from a checkpoint exactly, and rejects bad flags by name."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dtlab.models.run import checkpoint
from dtlab.models.run.metrics import MetricsLog, read_metrics, run_header
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.trainer import Trainer

MLP = ["--model", "mlp", "--d-in", "8", "--n-classes", "4", "--d-hidden", "64",
       "--n-samples", "8192", "--batch-size", "64", "--lr", "1e-2", "--warmup", "10"]
TINY_LM = ["--model", "transformer", "--vocab", "8", "--seq-len", "16", "--d-model", "32",
           "--n-heads", "2", "--n-layers", "1", "--d-ff", "64", "--markov-order", "1",
           "--markov-support", "2", "--n-tokens", "200000", "--batch-size", "16", "--lr", "1e-2"]


def train(argv, metrics=""):
    setup = parse(argv + (["--metrics", metrics] if metrics else []), prog="test")
    session = build_session(setup)
    log = MetricsLog(setup.run.metrics, run_header(session, "single"), append=setup.run.resume)
    try:
        summary = Trainer(session, log).run()
    finally:
        log.close()
    return session, summary


def test_mlp_reaches_the_bayes_floor():
    _, summary = train(MLP + ["--steps", "400"])
    assert summary.floor is not None
    assert summary.gap < 0.15, f"final {summary.final_loss:.3f} vs floor {summary.floor:.3f}"


def test_transformer_reaches_the_entropy_rate():
    _, summary = train(TINY_LM + ["--steps", "300"])
    assert summary.gap < 0.1, f"final {summary.final_loss:.3f} vs floor {summary.floor:.3f}"


def test_fixed_seed_reproduces_bit_for_bit(tmp_path):
    argv = TINY_LM + ["--steps", "12", "--seed", "7"]
    a, _ = train(argv, str(tmp_path / "a.jsonl"))
    b, _ = train(argv, str(tmp_path / "b.jsonl"))
    c, _ = train(TINY_LM + ["--steps", "12", "--seed", "8"])
    losses = [[r["loss"] for r in read_metrics(str(tmp_path / f"{n}.jsonl"))[1]] for n in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 12
    assert a.params.checksum() == b.params.checksum() != c.params.checksum()


def test_metrics_header_and_records(tmp_path):
    path = str(tmp_path / "m.jsonl")
    train(MLP + ["--steps", "5"], path)
    header, records = read_metrics(path)
    assert header["topology"] == "single" and header["floor"] > 0
    assert header["config"]["model"]["d_hidden"] == 64 and header["versions"]["numpy"]
    assert header["hardware"]["cpu_count"] >= 1
    assert [r["step"] for r in records] == list(range(1, 6))
    assert all({"loss", "elapsed_s", "lr", "grad_norm", "step_s"} <= set(r) for r in records)


def test_resume_continues_exactly(tmp_path):
    full, _ = train(TINY_LM + ["--steps", "20", "--seed", "3"])
    ckpt = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "10"]
    train(TINY_LM + ["--steps", "10", "--seed", "3"] + ckpt)
    assert checkpoint.latest(str(tmp_path / "ck")).endswith("step-00000010")
    # the resumed run has the 20-step schedule, as if never interrupted
    resumed, _ = train(TINY_LM + ["--steps", "20", "--seed", "3", "--resume"] + ckpt)
    np.testing.assert_array_equal(resumed.params.data, full.params.data)
    assert resumed.loader.state_dict() == full.loader.state_dict()


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("args,message", [
    (["--d-model", "0"], "--d-model must be positive"),
    (["--d-model", "30", "--n-heads", "4"], "--d-model 30 is not divisible by --n-heads 4"),
    (["--steps", "-1"], "--steps must be positive"),
    (["--d-model", "abc"], "argument --d-model: invalid int value: 'abc'"),
    (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
    (["--model", "mlp", "--activation", "tanh"], "argument --activation: invalid choice"),
    (["--data", "text"], "--data text needs --path"),
    (["--resume"], "--resume and --keep need --checkpoint-dir"),
    (["--keep", "-1"], "--keep must be 0 (keep all) or a positive count"),
])
def test_bad_flags_name_the_problem(args, message):
    out = cli(*args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_corrupt_checkpoint_is_refused_by_name(tmp_path):
    args = [*TINY_LM, "--steps", "2", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    assert cli(*args).returncode == 0
    params = os.path.join(checkpoint.latest(str(tmp_path)), "params.npy")
    with open(params, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    out = cli(*args, "--resume")
    assert out.returncode == 1 and "params.npy: checksum mismatch" in out.stderr
    assert "Traceback" not in out.stderr


def test_resume_skips_a_damaged_newest_checkpoint_and_keep_prunes(tmp_path):
    """A truncated newest save is named and skipped; the run resumes from the one before
    and ends with the parameters of an uninterrupted run; --keep 1 leaves one."""
    ck = str(tmp_path / "ck")
    base = [*MLP, "--seed", "2", "--checkpoint-dir", ck]
    assert cli(*base, "--steps", "6", "--checkpoint-every", "2").returncode == 0
    whole, _ = checkpoint.load(checkpoint.latest(ck))
    shutil.rmtree(os.path.join(ck, checkpoint.step_dir(6)))
    params = os.path.join(ck, checkpoint.step_dir(4), "params.npy")
    os.truncate(params, os.path.getsize(params) // 2)
    out = cli(*base, "--steps", "6", "--checkpoint-every", "2", "--keep", "1", "--resume")
    assert out.returncode == 0, out.stderr
    assert f"skipping checkpoint {os.path.dirname(params)}: params.npy: truncated" in out.stderr
    assert "resumed from step 2" in out.stderr
    assert sorted(os.listdir(ck)) == [checkpoint.step_dir(6)]
    resumed, _ = checkpoint.load(checkpoint.latest(ck))
    np.testing.assert_array_equal(resumed["params"], whole["params"])
