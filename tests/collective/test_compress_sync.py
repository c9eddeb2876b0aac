"""Compressed gradients on the sync trainer (dtlab-sync --compress;
collective/reducers/compress.py) against the exact cases they reduce to, and the exchange against
the error-feedback residual.

topk:1.0 and randk:1.0 send every element, so at dp 2 (the ring's sum a + b = b + a, as
the all-gather's 0 + a + b) they train plain data parallelism's parameters bit for bit;
PowerSGD at full rank (rank 10 >= every matrix's smaller side) projects the mean
gradient onto a basis of its own columns: equal in float64 within 1e-12 relative. The
transport check (tests/support/mpi_progs/compress_check.py, 3 ranks) adds up what every
rank did not keep in its residual and finds exactly the gradient each rank ended with.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.collective.train import parse_args
from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP = ["--model", "mlp", "--d-in", "7", "--d-hidden", "10", "--n-layers", "2",
       "--n-classes", "5", "--n-samples", "512", "--batch-size", "4", "--seed", "3",
       "--warmup", "2", "--lr", "0.01", "--steps", "6", "--log-every", "100"]


def test_full_compression_trains_what_plain_data_parallelism_trains(tmp_path):
    metrics = {name: tmp_path / f"{name}.jsonl" for name in ("plain32", "topk1", "topk10")}
    cases = [{"name": "plain32", "argv": [*MLP, "--metrics", str(metrics["plain32"])]},
             {"name": "topk1", "argv": [*MLP, "--compress", "topk:1.0",
                                        "--metrics", str(metrics["topk1"])]},
             {"name": "randk1", "argv": [*MLP, "--compress", "randk:1.0"]},
             {"name": "topk10", "argv": [*MLP, "--compress", "topk:0.1",
                                         "--metrics", str(metrics["topk10"])]},
             {"name": "plain64", "argv": [*MLP, "--dtype", "float64"]},
             {"name": "power64", "argv": [*MLP, "--dtype", "float64",
                                          "--compress", "powersgd:10"]},
             {"name": "power1", "argv": [*MLP, "--dtype", "float64",
                                         "--compress", "powersgd:1"]}]
    path, out = tmp_path / "cases.json", tmp_path / "out.npz"
    path.write_text(json.dumps(cases))
    r = mpirun(2, "tests/support/mpi_progs/method_cases.py", str(path), str(out), timeout=120)
    assert r.rc == 0, r
    got = dict(np.load(out))
    assert np.array_equal(got["topk1"], got["plain32"])
    assert np.array_equal(got["randk1"], got["plain32"])
    rel = np.linalg.norm(got["power64"] - got["plain64"]) / np.linalg.norm(got["plain64"])
    assert rel < 1e-12, rel
    low = np.linalg.norm(got["power1"] - got["plain64"]) / np.linalg.norm(got["plain64"])
    assert low > 1e-4  # rank 1 is not the gradient: the check above can fail
    sent = {name: {rec["sent_bytes"] for rec in read_metrics(str(p))[1]}
            for name, p in metrics.items()}
    n = got["plain32"].size  # dp 2: a ring all-reduce sends n float32; the all-gather of
    assert sent["plain32"] == {4 * n}  # top-k sends its k values and int32 indices
    k = -(-n // 10)
    assert sent["topk1"] == {8 * n} and sent["topk10"] == {-(-8 * k // 8) * 8}
    header, records = read_metrics(str(metrics["topk10"]))
    assert header["compress"] == "topk:0.1" and header["error_feedback"] is True
    assert all(rec["comm_rounds"] == 1 and rec["compress_s"] >= 0 for rec in records)


def test_the_exchange_is_what_the_residuals_do_not_hold():
    r = mpirun(3, "tests/support/mpi_progs/compress_check.py", timeout=60)
    assert r.rc == 0, r
    assert r.stdout.count("exactly what the residuals do not hold") == 2, r


@pytest.mark.parametrize("flags, named", [
    (["--compress", "topk:2"], "takes a fraction F in"),
    (["--compress", "powersgd:0"], "takes a rank R >= 1"),
    (["--compress", "sign", "--zero", "2"], "--compress sign with --zero 2"),
    (["--compress", "sign", "--wire", "bf16"], "--compress sign with --wire bf16"),
    (["--no-error-feedback"], "--no-error-feedback needs --compress"),
])
def test_what_compression_cannot_run_with_is_named(flags, named):
    with pytest.raises(ConfigError, match=named):
        parse_args([*MLP, *flags])
