"""Every async run equals its serial replay: dtlab-replay against real servers and workers.

Two shard daemons on loopback record their apply logs (--apply-log) and a
final checkpoint; real worker processes train a tiny MLP in float64 under ASP
(with a straggler), SSP and BSP, and a tiny MoE transformer in float32 under
ASP with ranged pushes (--moe-sparse-push); `python -m dtlab.pserver.replay`
re-executes the logs in one process and must end on the servers' parameters
bit for bit (max |difference| exactly 0).
A log whose contributors were changed makes it fail naming the update; a
damaged log is an error naming the file and the line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.pserver_util import ROOT, TINY_MLP, addresses, run_workers, serve

from dtlab.models.config import ConfigError, build
from dtlab.models.optim import OptimConfig
from dtlab.models.zoo import config_class
from dtlab.pserver import replay
from dtlab.pserver.common.config import ServerConfig
from dtlab.pserver.server.applylog import ApplyLog
from dtlab.pserver.server.daemon import build_store, config_record

ADAM = {"optimizer": "adam", "lr": 0.05, "warmup": 3, "schedule": "cosine"}
MOMENTUM = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "warmup": 2, "schedule": "cosine"}
MOE = {"vocab": 8, "seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 16,
       "moe_experts": 8, "moe_top_k": 1}
LOG = "apply.s{shard}.jsonl"
DIFF = re.compile(r"shard (\d): \d+ updates replayed; max \|difference\| from \S+: (\S+)")


def flags(cfg: dict) -> list[str]:
    return [x for k, v in cfg.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def async_run(tmp: Path, workers: int, steps: int, dtype: str, optim: dict, worker: list[str],
              model: tuple[str, dict] = ("mlp", TINY_MLP), **server) -> Path:
    """Train through 2 shards that log their updates and checkpoint at shutdown; the
    first worker's metrics file."""
    name, cfg = model
    per_step = 1 if server.get("consistency") == "bsp" else workers  # updates a step makes
    with serve(shards=2, model=name, model_cfg=cfg, optim=optim, num_workers=workers,
               dtype=dtype, seed=2, schedule_steps=steps * per_step, apply_log=str(tmp / LOG),
               checkpoint_dir=str(tmp / "ckpt"), **server) as daemons:
        paths = run_workers(addresses(daemons), workers,
                            ["--model", name, *flags(cfg), "--steps", str(steps),
                             "--batch-size", "4", "--seed", "2", "--dtype", dtype,
                             "--clip", "1.0", *worker], tmp)
    return paths[0]


def replayed(tmp: Path, metrics: Path, capsys) -> tuple[int, str]:
    """The replay's exit status and output (stdout, then stderr)."""
    capsys.readouterr()
    rc = replay.cli(["--config", str(metrics), "--apply-log", str(tmp / LOG),
                     "--checkpoint-dir", str(tmp / "ckpt")])
    out = capsys.readouterr()
    return rc, out.out + out.err


def stale(tmp: Path) -> int:
    """The largest staleness in shard 0's log (version at apply - version read)."""
    lines = [json.loads(x) for x in (tmp / "apply.s0.jsonl").read_text().splitlines()[1:]]
    return max(u["version"] - 1 - c["read"] for u in lines for c in u["contributors"])


@pytest.fixture(scope="module")
def asp_run(tmp_path_factory):
    """ASP, 3 workers, worker 1 a 3x straggler and everyone a random delay; float64,
    Adam, the lr divided by the staleness."""
    tmp = tmp_path_factory.mktemp("asp")
    metrics = async_run(tmp, 3, 40, "float64", ADAM,
                        ["--straggler", "1:3", "--delay-ms", "5"], staleness_lr="divide")
    return tmp, metrics


def test_asp_with_a_straggler_replays_bit_for_bit(asp_run, capsys):
    tmp, metrics = asp_run
    assert stale(tmp) >= 2  # the straggler's gradients arrive late: a real async order
    rc, out = replayed(tmp, metrics, capsys)
    assert rc == 0, out
    assert [d for _, d in DIFF.findall(out)] == ["0", "0"], out
    assert "first difference" not in out


@pytest.mark.parametrize("consistency, dtype, optim, worker, model", [
    ("ssp", "float64", MOMENTUM, ["--delay-ms", "3"], ("mlp", TINY_MLP)),
    ("bsp", "float64", ADAM, ["--delay-ms", "1"], ("mlp", TINY_MLP)),
    # float32: the same order of arithmetic as the servers and workers, so exact too; and
    # ranged pushes: the experts no token reached are left out (lazy Adam steps)
    ("asp", "float32", ADAM, ["--moe-sparse-push", "--straggler", "0:2"], ("transformer", MOE)),
])
def test_replay_equals_the_servers(tmp_path, capsys, consistency, dtype, optim, worker, model):
    server = {"consistency": consistency, **({"staleness": 1} if consistency == "ssp" else {})}
    metrics = async_run(tmp_path, 2, 20, dtype, optim, worker, model, **server)
    rc, out = replayed(tmp_path, metrics, capsys)
    assert rc == 0, out
    assert DIFF.findall(out) == [("0", "0"), ("1", "0")], out
    updates = [json.loads(x) for x in (tmp_path / "apply.s1.jsonl").read_text().splitlines()[1:]]
    if consistency == "bsp":  # one update per round, the mean of every worker's gradient
        assert all(len(u["contributors"]) == 2 for u in updates)
    if "--moe-sparse-push" in worker:
        assert any("ranges" in u for u in updates)


def copy_logs(run: Path, tmp: Path) -> Path:
    for k in (0, 1):
        shutil.copy(run / f"apply.s{k}.jsonl", tmp / f"apply.s{k}.jsonl")
    shutil.copytree(run / "ckpt", tmp / "ckpt")
    return tmp


@pytest.mark.parametrize("change", ["worker", "step"])
def test_a_changed_contributor_fails_naming_its_update(asp_run, tmp_path, capsys, change):
    """Two updates of shard 0 get each other's gradient: the worker of one for another's
    (change=worker), or one worker's two steps swapped (change=step); the versions read stay."""
    run, metrics = asp_run
    tmp = copy_logs(run, tmp_path)
    log = tmp / "apply.s0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    updates = [json.loads(x) for x in lines[1:]]
    if change == "worker":  # two updates in a row from different workers
        i = next(i for i in range(10, len(updates) - 1)
                 if updates[i]["contributors"][0]["worker"]
                 != updates[i + 1]["contributors"][0]["worker"])
        j = i + 1
    else:  # worker 1's steps 5 and 6
        i, j = (next(k for k, u in enumerate(updates) if u["contributors"][0]["worker"] == 1
                     and u["contributors"][0]["step"] == s) for s in (5, 6))
    a, b = updates[i]["contributors"][0], updates[j]["contributors"][0]
    swapped = {(a["worker"], a["step"]), (b["worker"], b["step"])}
    (a["worker"], a["step"]), (b["worker"], b["step"]) = (b["worker"], b["step"]), \
        (a["worker"], a["step"])
    for k in (i, j):
        lines[k + 1] = json.dumps(updates[k]) + "\n"
    log.write_text("".join(lines))
    rc, out = replayed(tmp, metrics, capsys)
    assert rc == 1, out
    # the first update not reproduced (or, where the change made the log non-causal, the
    # updates left waiting) is one that the swapped gradients reached
    named = re.findall(r"shard \d update \d+ \(\S+ line \d+: worker (\d+) step (\d+)", out)
    assert named and {(int(w), int(s)) for w, s in named} & swapped, out


def test_a_damaged_log_is_an_error_naming_file_and_line(asp_run, tmp_path, capsys):
    run, metrics = asp_run
    tmp = copy_logs(run, tmp_path)
    log1 = tmp / "apply.s1.jsonl"
    text = log1.read_text()
    log1.write_text(text[: len(text) - 20])  # the daemon killed while writing it
    n = text.count("\n")
    r = subprocess.run([sys.executable, "-m", "dtlab.pserver.replay", "--config", str(metrics),
                        "--apply-log", str(tmp / LOG), "--checkpoint-dir", str(tmp / "ckpt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"{log1} line {n}: truncated" in r.stderr, r.stderr

    header = json.loads(text.splitlines()[0])
    log1.write_text(json.dumps({**header, "num_shards": 3}) + "\n"
                    + text.split("\n", 1)[1])  # another run's shard count
    rc, out = replayed(tmp, metrics, capsys)
    assert rc == 1 and f"{log1} line 1: num_shards 3, but shard 0's log" in out, out

    log1.unlink()  # a shard's log missing
    rc, out = replayed(tmp, metrics, capsys)
    assert rc == 1 and f"{log1}: No such file or directory" in out, out


def test_a_local_sgd_run_is_refused_naming_its_local_steps(tmp_path, capsys):
    """A push of --local-steps H is an outer gradient of H inner steps: replaying it as one
    step's gradient would report a difference that is not a bug."""
    metrics = async_run(tmp_path, 2, 4, "float64", {"optimizer": "sgd", "lr": 0.1},
                        ["--local-steps", "2"], consistency="bsp", outer_optimizer="sgd")
    rc, out = replayed(tmp_path, metrics, capsys)
    assert rc != 0 and "--local-steps 2" in out and "--outer-optimizer sgd" in out, out


def test_apply_log_refuses_a_run_that_starts_midway():
    with pytest.raises(ConfigError, match="--apply-log .* does not go with --resume"):
        build(ServerConfig, {"apply_log": "a.jsonl", "resume": True, "checkpoint_dir": "c"})


def test_a_log_that_cannot_be_written_stops_and_the_updates_stand(tmp_path, caplog):
    """/dev/full refuses the buffered lines once they are flushed: the store goes on."""
    cfg = build(ServerConfig, {})
    ocfg = build(OptimConfig, {"optimizer": "sgd", "lr": 0.1})
    model = build(config_class("mlp"), dict(TINY_MLP))
    store = build_store(cfg, "mlp", model, ocfg)
    store.applylog = ApplyLog("/dev/full", store, config_record(cfg, "mlp", model, ocfg))
    lay = store.layout
    store.register(0, lay.model, lay.model_size, lay.layout_crc)
    grad = np.full(lay.length, 0.5, store.params.dtype)
    for step in range(200):  # ~100 bytes a line: past the file's 8 KiB buffer
        store.push(0, step, store.version, grad)
    assert store.version == 200
    assert "--apply-log /dev/full" in caplog.text and "no more updates are logged" in caplog.text
