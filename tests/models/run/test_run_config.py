"""One run config for every process: `--config FILE` (a JSON object, or a metrics file
whose header holds one) read the same way by every entry point, flags overriding it,
and flags that would have no effect in a program refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.mpirun import ROOT
from support.pserver_util import DaemonProcess

from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import parse

RUN = {"model_name": "mlp", "model": {"d_hidden": 16},
       "data": {"data": "teacher", "n_samples": 512, "label_noise": 0.05},
       "optim": {"optimizer": "sgd", "lr": 0.05, "schedule": "constant", "warmup": 0},
       "run": {"steps": 6, "batch_size": 8, "seed": 5}}


def write(tmp_path, record, name="run.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return str(path)


def run(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def test_file_values_then_flags(tmp_path):
    setup = parse(["--config", write(tmp_path, RUN), "--lr", "0.2"], prog="t")
    assert setup.model_name == "mlp" and setup.model.d_hidden == 16
    assert setup.data.label_noise == 0.05 and setup.run.seed == 5
    assert setup.optim.lr == 0.2 and setup.optim.optimizer == "sgd"  # flag over file
    assert setup.run.log_every == 50  # neither: the default


def test_another_model_on_the_command_line_drops_the_files_model_section(tmp_path):
    setup = parse(["--config", write(tmp_path, RUN), "--model", "transformer"], prog="t")
    assert setup.model_name == "transformer" and setup.model.d_model == 64


@pytest.mark.parametrize("record, message", [
    ({"model_name": "mlp", "extra": {}}, "unknown section(s) extra"),
    ({"model_name": "mlp", "run": []}, "section 'run' must be an object"),
    ({"model_name": "mlp", "run": {"stepz": 3}}, "unknown RunConfig key(s): stepz"),
    ({"model_name": "mlp", "run": {"steps": "3"}}, "--steps must be int, got '3'"),
    ({"model_name": "rnn"}, "unknown model 'rnn'"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_config_files_are_named(tmp_path, record, message):
    with pytest.raises(ConfigError, match="--config .*" + message.replace("(", r"\(")
                       .replace(")", r"\)")):
        parse(["--config", write(tmp_path, record)], prog="t")


def test_missing_and_garbled_files(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        parse(["--config", str(tmp_path / "none.json")], prog="t")
    (tmp_path / "bad.json").write_text("{not json\n")
    with pytest.raises(ConfigError, match="neither a JSON object nor a metrics file"):
        parse(["--config", str(tmp_path / "bad.json")], prog="t")


def test_a_past_run_reruns_from_its_metrics_header(tmp_path):
    first = tmp_path / "first.jsonl"
    out = run("dtlab.models.run.train", "--config", write(tmp_path, RUN), "--metrics", str(first))
    assert out.returncode == 0, out.stderr
    before = first.read_text()
    again = tmp_path / "again.jsonl"
    out = run("dtlab.models.run.train", "--config", str(first), "--metrics", str(again))
    assert out.returncode == 0, out.stderr
    assert first.read_text() == before  # the run it was read from is untouched
    (h1, r1), (h2, r2) = read_metrics(str(first)), read_metrics(str(again))
    assert [r["loss"] for r in r1] == [r["loss"] for r in r2] and len(r1) == 6
    strip = {"metrics"}
    assert ({k: v for k, v in h1["config"]["run"].items() if k not in strip}
            == {k: v for k, v in h2["config"]["run"].items() if k not in strip})
    assert {k: h1["config"][k] for k in ("model", "data", "optim")} == \
           {k: h2["config"][k] for k in ("model", "data", "optim")}


def test_a_rerun_from_a_header_writes_no_metrics_unless_asked(tmp_path):
    first = tmp_path / "first.jsonl"
    assert run("dtlab.models.run.train", "--config", write(tmp_path, RUN), "--metrics",
               str(first)).returncode == 0
    setup = parse(["--config", str(first)], prog="t")
    assert setup.run.metrics == "" and setup.run.checkpoint_dir == ""


@pytest.mark.parametrize("flag", [["--optimizer", "sgd"], ["--lr", "0.5"], ["--warmup", "3"]])
def test_a_worker_refuses_optimizer_flags(flag):
    out = run("dtlab.pserver.worker", "--servers", "127.0.0.1:9", *flag)
    assert out.returncode == 2
    assert f"{flag[0]} has no effect in python -m dtlab.pserver.worker" in out.stderr
    assert "the servers run the optimizer" in out.stderr


@pytest.mark.parametrize("flag", [["--steps", "3"], ["--batch-size", "4"], ["--clip", "1"]])
def test_a_server_refuses_worker_flags(flag):
    out = run("pserver", "serve", *flag)
    assert out.returncode == 2 and f"{flag[0]} has no effect in" in out.stderr, out.stderr


def test_one_file_serves_the_server_and_its_worker(tmp_path):
    """--data digits fixes d_in and n_classes for the server too: no model flags copied."""
    config = write(tmp_path, {**RUN, "data": {"data": "digits"}})
    with DaemonProcess(tmp_path, ["--config", config, "--port", "0"]) as daemon:
        metrics = tmp_path / "w.jsonl"
        out = run("dtlab.pserver.worker", "--config", config, "--servers", daemon.address,
                  "--steps", "3", "--metrics", str(metrics), timeout=120)
        assert out.returncode == 0, out.stderr + daemon.output()
    header, records = read_metrics(str(metrics))
    assert header["config"]["model"]["d_in"] == 64 and len(records) == 3


def test_server_takes_seed_and_schedule_from_the_run_config(tmp_path):
    from dtlab.models.config import add_flags
    from dtlab.pserver.__main__ import SERVER_OPTIM_FLAGS, server_config
    from dtlab.pserver.common.config import ServerConfig

    setup = parse(["--config", write(tmp_path, RUN), "--num-workers", "3"], prog="t",
                  flags={"data": None, "optim": SERVER_OPTIM_FLAGS},
                  add_extra=lambda p: add_flags(p, ServerConfig, "server"))
    cfg = server_config(setup)
    assert (cfg.seed, cfg.schedule_steps) == (5, 6 * 3)  # one update per push of 3 workers
