"""The CuPy-discipline check on the sync topology: `dtlab-sync` at 2 ranks under the strict
namespace (tests/support/strict_xp.py: CuPy's rules, NumPy's arithmetic) equals its NumPy
run bit for bit, for every model kind that needs ranks and every method.

One launch (tests/support/mpi_progs/discipline_cases.py) trains each case on NumPy and
under the strict namespace: plain data parallelism, ZeRO 1-3, local SGD, each compressor,
fp16 mixed precision with an fp16 wire, a checkpoint and its resume; the tensor-split
transformer, the pipeline under each schedule, the expert-parallel MoE (our all-to-all
in chunks, and MPI's). A second launch, DTLAB_ARRAY_MODULE in its environment, checks the
device each rank trains on (the strict namespace models a node of two). This is not a GPU run.
Device synchronisations per step for each case are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import re

import pytest
from support.mpirun import ROOT, mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")

STRICT = {"DTLAB_ARRAY_MODULE": "support.strict_xp", "PYTHONPATH": str(ROOT / "tests")}
STEPS = 3
MLP = ["--model", "mlp", "--d-in", "7", "--d-hidden", "10", "--n-layers", "2",
       "--n-classes", "5", "--n-samples", "512", "--batch-size", "4", "--seed", "3",
       "--warmup", "1", "--lr", "0.01", "--log-every", "1"]
GPT = ["--model", "transformer", "--vocab", "16", "--seq-len", "6", "--d-model", "16",
       "--n-heads", "2", "--n-layers", "2", "--d-ff", "24", "--n-tokens", "4096",
       "--batch-size", "4", "--warmup", "1", "--log-every", "1"]
MOE = [*GPT, "--moe-experts", "4", "--moe-top-k", "2"]
CASES = {
    "plain": [*MLP],
    "zero1": [*MLP, "--zero", "1"],
    "zero2": [*MLP, "--zero", "2"],
    "zero3": [*MLP, "--zero", "3"],
    "local-sgd": [*MLP, "--local-steps", "2", "--outer-optimizer", "nesterov",
                  "--outer-momentum", "0.9"],
    "topk": [*MLP, "--compress", "topk:0.3"],
    "randk": [*MLP, "--compress", "randk:0.3"],
    "sign": [*MLP, "--compress", "sign"],
    "powersgd": [*MLP, "--compress", "powersgd:2"],
    "fp16": [*MLP, "--precision", "fp16", "--wire", "fp16"],
    "tp2": [*GPT, "--tp", "2"],
    "pp2-gpipe": [*GPT, "--pp", "2", "--pp-schedule", "gpipe", "--grad-accum", "2"],
    "pp2-1f1b": [*GPT, "--pp", "2", "--pp-schedule", "1f1b", "--grad-accum", "2"],
    "pp2-zb-h1": [*GPT, "--pp", "2", "--pp-schedule", "zb-h1", "--grad-accum", "2"],
    "ep2": [*MOE, "--ep", "2", "--moe-chunks", "2"],
    "ep2-mpi-alltoall": [*MOE, "--ep", "2", "--moe-alltoall", "mpi", "--moe-dropless"],
}


def test_dtlab_sync_under_cupy_rules_equals_numpy(tmp_path, capsys):
    cases = [{"name": name, "argv": [*argv, "--steps", str(STEPS)], "steps": STEPS,
              "dir": str(tmp_path)} for name, argv in CASES.items()]
    cases.append({"name": "checkpoint-resume", "dir": str(tmp_path), "steps": STEPS + 2,
                  "argv": [*MLP, "--steps", str(STEPS), "--checkpoint-every", "1"],
                  "resume": [*MLP, "--steps", str(STEPS + 2), "--checkpoint-every", "1"]})
    path, out = tmp_path / "cases.json", tmp_path / "out.json"
    path.write_text(json.dumps(cases))
    r = mpirun(2, "tests/support/mpi_progs/discipline_cases.py", str(path), str(out),
               env={"PYTHONPATH": STRICT["PYTHONPATH"]}, timeout=240)
    assert r.rc == 0, r
    report = json.loads(out.read_text())
    assert set(report) == {c["name"] for c in cases}
    with capsys.disabled():
        print("\nCuPy-discipline check, dtlab-sync at 2 ranks: device syncs per step "
              "(scalar reads, device-to-host copies; the busiest rank)")
        for name, got in report.items():
            print(f"  {name:18s} {got['scalar_reads_per_step']:6.1f} "
                  f"{got['to_host_per_step']:6.1f}")
    assert {name for name, got in report.items() if not got["equal"]} == set()


PICKED = """
import os, sys
from mpi4py import MPI
for var in ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"):  # a launcher that names no local rank
    os.environ.pop(var, None)
from dtlab.collective.train import parse_args, train
from support import strict_xp
train(parse_args(sys.argv[1:]))
print(f"rank {MPI.COMM_WORLD.rank} device {strict_xp.cuda.Device().id}")
"""


def test_each_rank_trains_on_the_device_its_node_rank_picked():
    """Two ranks on one node with two devices: the grid picks device = node-local rank (from
    MPI, not the launcher's variables, which are removed here) and training stays there."""
    r = mpirun(2, "-c", PICKED, *MLP, "--steps", "1", env=STRICT, timeout=120)
    assert r.rc == 0, r
    # the two ranks' lines may land inside another's output line: find them anywhere
    assert sorted(re.findall(r"rank \d+ device \d+", r.stdout)) == \
        ["rank 0 device 0", "rank 1 device 1"]
