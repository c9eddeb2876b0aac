"""ZeRO stages 1-3 (dtlab-sync --zero S) train exactly what plain data parallelism trains.

Each launch trains every case in one mpiexec (tests/support/mpi_progs/zero_cases.py) and
saves the whole final parameters. At dp 2 with one micro-batch and no clipping the
order of every sum is plain DP's (the ring adds two contributions, a + b = b + a; each
unit's reduce-scatter is the all-reduce's first half), so stages 1, 2 and 3 end bit for
bit on its parameters, in float32 and in bf16 and fp16 mixed precision (loss-scaled), with
the parameters resharded after forward or not, with and without the helper thread. With accumulation
(stages 2 and 3 reduce every micro-batch, plain DP sums them locally first), clipping (the
norm from the shards' squares) or dp 3 (units cut in uneven segments, so the ring's order
of additions differs from the all-reduce's) the sums are reordered: float64 runs then agree
with plain DP and with one process on the global batch within 1e-12 relative (the largest
difference measured: 3e-16).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mpi4py import MPI
from support.mpirun import mpirun

from dtlab.collective.comm import Communicator
from dtlab.collective.train import parse_args
from dtlab.collective.zero_trainer import shard_session
from dtlab.models.config import ConfigError
from dtlab.models.cost import zero_traffic
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import build_session

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/zero_cases.py"
MLP = ["--model", "mlp", "--d-in", "7", "--d-hidden", "10", "--n-layers", "2",
       "--n-classes", "5", "--n-samples", "512"]
LM = ["--model", "transformer", "--vocab", "11", "--seq-len", "6", "--d-model", "8",
      "--n-heads", "2", "--n-layers", "2", "--d-ff", "12", "--n-tokens", "3000"]
RUN = ["--steps", "4", "--seed", "3", "--warmup", "2", "--lr", "3e-3", "--log-every", "100"]
B = 4  # examples per micro-batch and rank
EXACT = {"clip": ["--clip", "0"],
         "bf16": ["--clip", "0", "--precision", "bf16"],
         "fp16": ["--clip", "0", "--precision", "fp16", "--loss-scale", "1e6"]}
# reordered sums: float64, two micro-batches, a clip that acts (the norms are above it)
REORDERED = ["--dtype", "float64", "--grad-accum", "2", "--clip", "0.05"]
STAGES = ("0", "1", "2", "3")


def case(name: str, model: list, extra: list, zero: str, metrics=None) -> dict:
    argv = [*model, *RUN, "--batch-size", str(B), *extra, "--zero", zero]
    return {"name": name, "argv": argv + (["--metrics", str(metrics)] if metrics else [])}


def launch(tmp_path, n: int, cases: list[dict], timeout: float = 90) -> dict:
    path, out = tmp_path / f"cases{n}.json", tmp_path / f"out{n}.npz"
    path.write_text(json.dumps(cases))
    r = mpirun(n, PROG, str(path), str(out), timeout=timeout)
    assert r.rc == 0, r
    with np.load(out) as f:
        return dict(f)


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    cases = []
    for label, model in (("mlp", MLP), ("lm", LM)):
        for kind, extra in (*EXACT.items(), ("f64", REORDERED)):
            cases += [case(f"{label}-{kind}-z{z}", model, extra, z, tmp / f"{label}-{kind}-{z}")
                      for z in STAGES]
    cases += [case("lm-clip-z3-keep", LM, EXACT["clip"] + ["--no-zero-reshard-after-forward"],
                   "3"),
              case("mlp-clip-z3-inline", MLP, EXACT["clip"] + ["--no-overlap"], "3")]
    return tmp, launch(tmp, 2, cases)


@pytest.fixture(scope="module")
def dp3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp3")
    cases = [case(f"{label}-f64-z{z}", model, REORDERED, z, tmp / f"{label}-f64-{z}")
             for label, model in (("mlp", MLP), ("lm", LM)) for z in STAGES]
    return tmp, launch(tmp, 3, cases)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process on the global batch of dp N: all N B k examples in one batch."""
    tmp = tmp_path_factory.mktemp("single")
    cases = []
    for n in (2, 3):
        for label, model in (("mlp", MLP), ("lm", LM)):
            c = case(f"{label}-{n}", model, REORDERED, "0")
            argv = c["argv"][:-2]  # no --zero: the single-process trainer
            argv[argv.index("--batch-size") + 1] = str(n * B * 2)
            argv[argv.index("--grad-accum") + 1] = "1"
            cases.append({"name": c["name"], "argv": argv, "single": True})
    return launch(tmp, 1, cases)


@pytest.mark.parametrize("label", ["mlp", "lm"])
@pytest.mark.parametrize("kind", list(EXACT))
def test_stages_end_bit_for_bit_on_plain_dp_at_dp2(dp2, label, kind):
    _, out = dp2
    plain = out[f"{label}-{kind}-z0"]
    for z in STAGES[1:]:
        assert np.array_equal(out[f"{label}-{kind}-z{z}"], plain), (label, kind, z)
    assert not np.array_equal(plain, out[f"{label}-f64-z0"].astype(plain.dtype))  # it trained


def test_stage3_kept_after_forward_and_inline_are_bit_for_bit(dp2):
    _, out = dp2
    assert np.array_equal(out["lm-clip-z3-keep"], out["lm-clip-z0"])
    assert np.array_equal(out["mlp-clip-z3-inline"], out["mlp-clip-z0"])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("label", ["mlp", "lm"])
def test_reordered_sums_agree_in_float64(dp2, dp3, single, n, label):
    out = (dp2 if n == 2 else dp3)[1]
    plain, one = out[f"{label}-f64-z0"], single[f"{label}-{n}"]
    assert rel(plain, one) < 1e-12
    for z in STAGES[1:]:
        got = out[f"{label}-f64-z{z}"]
        assert got.dtype == np.float64
        assert rel(got, plain) < 1e-12, (n, label, z, rel(got, plain))
        assert rel(got, one) < 1e-12, (n, label, z, rel(got, one))


@pytest.mark.parametrize("n", [2, 3])
def test_sent_bytes_and_memory_against_the_formulas(dp2, dp3, n):
    tmp = (dp2 if n == 2 else dp3)[0]
    for label in ("mlp", "lm"):
        for z in STAGES:
            header, records = read_metrics(str(tmp / f"{label}-f64-{z}"))
            psi, sent = header["n_params"], records[-1]["sent_bytes"]
            formula = zero_traffic(psi, int(z), n, micro_batches=2, itemsize=8)
            assert header["zero"] == int(z)
            # segments differ by at most one element: a few elements per unit and call
            assert abs(sent - formula) <= 8 * 3 * 2 * 8, (label, z, sent, formula)
            if z == "0":
                continue
            # fp32-style accounting at 8 bytes: weights 8, grads 8, Adam's two states 16 per
            # parameter, this rank's segments at most one element over Psi / N per unit
            memory, units = header["zero_bytes"], len(header["zero_units"])
            for key, kind, per in (("weight_bytes", "weights", 8), ("grad_bytes", "grads", 8),
                                   ("optimizer_bytes", "optimizer", 16),
                                   ("total_bytes", "total", 32)):
                assert abs(memory[key] - memory["formula"][kind]) <= units * per, key


@pytest.mark.parametrize("reshard", [True, False])
def test_stage3_holds_only_what_a_unit_needs(reshard):
    """One rank (a real world of size 1): after a step no unit's parameters or gradient
    remain gathered; the pools held two units at most when resharding, all of them when
    the parameters are kept from forward to backward; a read outside a unit is named."""
    setup = parse_args([*LM, "--zero", "3", "--batch-size", "2"]
                       + ([] if reshard else ["--no-zero-reshard-after-forward"]))
    session, reducer, zero = shard_session(build_session(setup),
                                           Communicator(MPI.COMM_SELF, name="self"), 3, reshard)
    try:
        session.replica.compute_grads(session.loader.next(), reducer.ready)
        reducer.wait()
        P, hooks, largest = zero.P, zero.hooks, zero.layout.largest
        assert P.params == {} and P.grads == {} and hooks.gathered == {}
        units = len(zero.layout.units)
        assert hooks.param_pool.made == (2 if reshard else units)
        assert hooks.grad_pool.made <= 2 and hooks.nbytes <= (units + 2) * largest * 4
        with pytest.raises(RuntimeError, match="parameter wte.W is not gathered"):
            P["wte.W"]
    finally:
        reducer.close()


@pytest.mark.parametrize("flags, words", [
    (["--zero", "3", "--tp", "2"], "--zero 3 with --tp 2"),
    (["--zero", "1", "--pp", "2"], "--zero 1 with --pp 2"),
    (["--zero", "2", "--model", "transformer", "--moe-experts", "4"], "--moe-experts"),
    (["--zero", "1", "--checkpoint-dir", "ck"], "--checkpoint-dir"),
    (["--zero", "2", "--wire", "bf16"], "--wire bf16 has no effect"),
    (["--zero", "3", "--allreduce", "mpi"], "--allreduce mpi has no effect"),
    (["--zero", "1", "--bucket-mb", "5"], "--bucket-mb 5.0 has no effect"),
    (["--zero", "2", "--no-zero-reshard-after-forward"], "without --zero 3"),
    (["--zero-reshard-after-forward"], "--zero-reshard-after-forward has no effect"),
])
def test_unsupported_combinations_are_refused_by_name(flags, words):
    with pytest.raises(ConfigError, match=words):
        parse_args(flags)


def test_refusal_ends_the_job_with_one_line():
    r = mpirun(2, "-m", "dtlab.collective.train", *MLP, "--zero", "3", "--tp", "2",
               timeout=60)
    assert r.rc == 2 and not r.timed_out, r
    assert "--zero 3 with --tp 2" in r.stderr and "Traceback" not in r.stderr
