"""The CuPy-discipline check on the async topology: a real `dtlab-worker` process under the
strict namespace (tests/support/strict_xp.py: CuPy's rules, NumPy's arithmetic; named by
DTLAB_ARRAY_MODULE) against real servers on loopback trains what its NumPy twin trains, bit
for bit: the servers end on the same values and the worker logs the same losses.

Shared memory is off (every tensor crosses gRPC, so a device array handed to the wire would
fail); the cases cover sessions and per-call transport, sparse pushes of the experts a MoE
step reached, and compressed pushes (top-k, sign). This is not a GPU run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from support.pserver_util import ROOT, SGD1, TINY_MLP, TINY_MLP_FLAGS, addresses, serve

from dtlab.models.run.metrics import read_metrics

STRICT = {"DTLAB_ARRAY_MODULE": "support.strict_xp", "PYTHONPATH": str(ROOT / "tests")}
MOE = {"vocab": 8, "seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32,
       "moe_experts": 4, "moe_top_k": 1}
MOE_DATA = {"markov_order": 1, "n_tokens": 2000}
MOE_FLAGS = ["--model", "transformer"] + [x for k, v in {**MOE, **MOE_DATA}.items()
                                          for x in (f"--{k.replace('_', '-')}", str(v))]
CASES = {
    "moe-sparse-session": ("transformer", MOE, MOE_DATA,
                           [*MOE_FLAGS, "--moe-sparse-push", "--transport", "session"]),
    "topk-calls": ("mlp", TINY_MLP, {}, [*TINY_MLP_FLAGS, "--compress", "topk:0.25",
                                         "--transport", "calls"]),
    "sign-session": ("mlp", TINY_MLP, {}, [*TINY_MLP_FLAGS, "--compress", "sign"]),
}


def start_worker(servers: str, flags: list[str], metrics, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dtlab.pserver.worker", "--servers", servers, "--worker-id", "0",
         "--num-workers", "1", "--no-shm", "--steps", "4", "--batch-size", "2", "--clip", "0",
         "--metrics", str(metrics), *flags],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **env})


@pytest.mark.parametrize("case", CASES)
def test_a_worker_under_cupy_rules_trains_what_numpy_trains(tmp_path, case):
    model, cfg, data, flags = CASES[case]
    with serve(2, model, cfg, SGD1, data=data, shm=False) as numpy_daemons, \
            serve(2, model, cfg, SGD1, data=data, shm=False) as strict_daemons:
        runs = {name: (start_worker(addresses(daemons), flags, tmp_path / f"{name}.jsonl", env),
                       daemons)
                for name, daemons, env in (("numpy", numpy_daemons, {}),
                                           ("strict", strict_daemons, STRICT))}
        for proc, _ in runs.values():
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
        values = {name: np.concatenate([d.store.params for d in daemons])
                  for name, (_, daemons) in runs.items()}
    header, records = read_metrics(str(tmp_path / "strict.jsonl"))
    _, numpy_records = read_metrics(str(tmp_path / "numpy.jsonl"))
    assert header["hardware"]["device"] == "CuPy-discipline check"
    assert len(records) == 4
    assert [r["loss"] for r in records] == [r["loss"] for r in numpy_records]
    assert values["strict"].tobytes() == values["numpy"].tobytes()
