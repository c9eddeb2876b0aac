"""Expert parallelism (models/moe_ep.py, collective/train.py --ep) under real mpiexec.

- the grouped single-process layer (capacity and Switch term per token group: the twin of
  an ep run) against central finite differences in float64;
- the reorderings the exchange uses, against a direct construction;
- ep = 2 and 4: every ep layer and transformer equals its single-process twin in float64
  (tests/support/mpi_progs/moe_ep_twins.py: outputs, loss, every gradient within 1e-6, drops and
  dropless, chunked overlap, our all-to-all and MPI's);
- dp 2 x ep 2 training for a few steps equals one process on the global batch with the
  same token groups (--moe-groups 4) within 1e-5, with drops and with dropless;
- per-ep-rank checkpoints, a resume into another --ep refused by name; bad configs are
  named errors with exit status 2.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import assert_grad_close, numeric_grad, sample_offsets
from support.mpirun import mpirun
from support.twins import single_params

from dtlab.models.moe import MoE, dispatch, dispatch_groups
from dtlab.models.moe_ep import chunk_rows, source_to_expert
from dtlab.models.params import FlatParams
from dtlab.models.router import RouterOptions

pytestmark = pytest.mark.usefixtures("mpiexec")

LM = ["--model", "transformer", "--vocab", "16", "--seq-len", "8", "--d-model", "16",
      "--n-heads", "2", "--n-layers", "2", "--d-ff", "24", "--moe-experts", "4",
      "--n-tokens", "20000", "--dtype", "float64"]
RUN = ["--steps", "4", "--seed", "3", "--warmup", "2", "--lr", "3e-3"]


# ---- single process ----

def test_grouped_layer_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    opts = RouterOptions(4, top_k=2, aux_coef=0.3, z_coef=0.1)
    m = MoE("m", 5, 7, opts, kind="swiglu", capacity_factor=0.8, groups=3)
    P = FlatParams(m.specs(), seed=0, dtype="float64")
    P.data[...] = rng.normal(0, 0.5, P.size)
    x = rng.standard_normal((12, 5))
    dy = rng.standard_normal((12, 5))

    def loss():
        y, _ = m.forward(P, x)
        return float((y * dy).sum()) + m.last_aux_loss

    y, ctx = m.forward(P, x)
    assert len(ctx["slots"]) < 24  # pairs were dropped
    P.zero_grad()
    dx = m.backward(P, ctx, dy)
    idx = sample_offsets(P, 3, rng)
    assert_grad_close(P.grad[idx], numeric_grad(loss, P.data, idx), "grouped MoE params")
    assert_grad_close(dx.ravel()[:20], numeric_grad(loss, x, range(20)), "grouped MoE dx")


def test_groups_dispatch_each_group_with_its_own_capacity():
    sel = np.array([[0, 1], [0, 1], [0, 2], [0, 1]])  # (4, 2); groups {0, 1}, {2, 3}
    whole = dispatch(sel, None, 3, 2)  # capacity 2 over all four tokens: one e0 pair of 4
    grouped = dispatch_groups(sel, None, 3, 1.5, 2)  # ceil(1.5 x 4 / 3) = 2 per group
    assert whole.counts.tolist() == [2, 2, 1]
    assert grouped.counts.tolist() == [4, 3, 1]  # every e0 pair kept: 2 per group
    # each expert's rows in group order: e0 t0 t1 (group 0) then t2 t3 (group 1)
    assert grouped.slots.tolist() == [0, 2, 4, 6, 1, 3, 7, 5]


def test_source_to_expert_and_chunks_against_a_direct_construction():
    counts = np.array([[2, 0, 1], [1, 3, 0]])  # (sources, experts)
    rows = [(s, e, i) for s in range(2) for e in range(3) for i in range(counts[s, e])]
    want = [rows.index((s, e, i)) for e in range(3) for s in range(2)
            for i in range(counts[s, e])]
    assert source_to_expert(counts).tolist() == want
    parts = chunk_rows([5, 0, 2], 2)  # expert 0: rows 0-4, expert 2: rows 5-6
    assert [idx.tolist() for idx, _ in parts] == [[0, 1, 5], [2, 3, 4, 6]]
    assert [cc.tolist() for _, cc in parts] == [[2, 0, 1], [3, 0, 1]]


# ---- under mpiexec ----

@pytest.mark.parametrize("n", [2, 4])
def test_ep_layers_and_models_equal_their_single_process_twins(n):
    r = mpirun(n, "tests/support/mpi_progs/moe_ep_twins.py", timeout=120)
    assert r.rc == 0 and f"PASS moe ep twins {n}" in r.stdout, r
    print(r.stdout)


def assert_grid_equals_single(tmp_path, label: str, n: int, single_argv: list, grid_argv: list):
    """Train one process on `single_argv` and `n` ranks of tests/support/mpi_progs/grid_train.py on
    `grid_argv` (the same RUN steps); their final parameters agree within 1e-5."""
    single = single_params(tmp_path, [*single_argv, *RUN], 4)
    out = tmp_path / "grid.npy"
    r = mpirun(n, "tests/support/mpi_progs/grid_train.py", out, *grid_argv, *RUN, timeout=180)
    assert r.rc == 0, r
    err = float(np.linalg.norm(np.load(out) - single) / np.linalg.norm(single))
    print(f"{label}: relative difference {err:.2e}")
    assert err < 1e-5, f"{label}: relative difference {err:.2e}"


@pytest.mark.parametrize("moe,ep", [
    (["--moe-capacity-factor", "1.0"], ["--moe-alltoall", "mpi"]),
    (["--moe-dropless", "--moe-bias-rate", "0.01"], ["--moe-chunks", "2"]),
], ids=["drops-mpi", "dropless-bias-chunks"])
def test_dp2_ep2_training_equals_one_process_on_the_global_batch(tmp_path, moe, ep):
    B = 2
    assert_grid_equals_single(
        tmp_path, f"dp 2 ep 2 {' '.join(moe + ep)}", 4,
        [*LM, *moe, "--batch-size", str(4 * B), "--moe-groups", "4"],
        ["--dp", "2", "--ep", "2", *ep, *LM, *moe, "--batch-size", str(B),
         "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "4"])
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ep0of2", "ep1of2"]
    r = mpirun(2, "-m", "dtlab.collective.train", "--dp", "2", *LM, *moe, *RUN,
               "--batch-size", str(2 * B), "--checkpoint-dir", tmp_path / "ck", "--resume",
               timeout=60)
    assert r.rc != 0 and "--ep 2" in r.stderr and "Traceback" not in r.stderr, r


@pytest.mark.parametrize("moe,grid", [
    (["--moe-capacity-factor", "1.0"], ["--pp-schedule", "gpipe"]),
    (["--moe-dropless", "--moe-every", "2"], ["--pp-schedule", "zb-h1", "--moe-alltoall", "mpi"]),
], ids=["drops-gpipe", "dropless-every2-zb"])
def test_pp2_ep2_training_equals_one_process_on_the_global_batch(tmp_path, moe, grid):
    """Each (ep rank, micro-batch) is one token group: m = 2 micro-batches of B on 2 ep
    ranks are the single process's 4 groups of B. With --moe-every 2 the first stage holds
    no MoE layer, so its gradients are all dense."""
    B, m = 2, 2
    assert_grid_equals_single(
        tmp_path, f"pp 2 ep 2 {' '.join(moe + grid)}", 4,
        [*LM, *moe, "--batch-size", str(2 * m * B), "--moe-groups", str(2 * m)],
        ["--pp", "2", "--ep", "2", *grid, *LM, *moe, "--batch-size", str(B),
         "--grad-accum", str(m), "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "4"])
    assert len(list((tmp_path / "ck").iterdir())) == 4  # one directory per (pp, ep) rank


@pytest.mark.parametrize("moe,dp,pp,ep,tp,m", [
    (["--moe-capacity-factor", "1.0", "--moe-shared-experts", "1", "--clip", "0.05"],
     1, 1, 1, 2, 1),
    (["--moe-dropless", "--ffn", "swiglu", "--clip", "0.05"], 1, 1, 2, 2, 1),
    (["--moe-capacity-factor", "1.0", "--pp-schedule", "1f1b", "--clip", "0.05"],
     1, 2, 2, 2, 2),
], ids=["tp2-drops-shared", "ep2-tp2-swiglu-dropless", "pp2-ep2-tp2-1f1b"])
def test_tensor_split_experts_equal_one_process_on_the_global_batch(tmp_path, moe, dp, pp, ep,
                                                                    tp, m):
    """Experts split Megatron-style over tp (with ep and pp as well): every (dp, ep rank,
    micro-batch) is one token group of the single process; --clip exercises the global
    norm over tp shards, ep experts and stages."""
    B = 2
    groups = dp * ep * m
    single_moe = [a for a in moe if a not in ("--pp-schedule", "1f1b")]
    assert_grid_equals_single(
        tmp_path, f"dp {dp} pp {pp} ep {ep} tp {tp} {' '.join(moe)}", dp * pp * ep * tp,
        [*LM, *single_moe, "--batch-size", str(groups * B), "--moe-groups", str(groups)],
        ["--dp", dp, "--pp", pp, "--ep", ep, "--tp", tp, *LM, *moe, "--batch-size", str(B),
         "--grad-accum", str(m)])


@pytest.mark.parametrize("n,flags,message", [
    (2, ["--ep", "2", *LM, "--moe-experts", "3"], "--moe-experts 3 is not divisible by --ep 2"),
    (2, ["--ep", "2", "--model", "transformer"], "--ep 2 needs a model with experts"),
    (2, ["--ep", "2", "--model", "mlp"], "--ep 2 needs a model with experts"),
    (2, ["--moe-chunks", "2", *LM], "--moe-chunks 2 has no effect without --ep"),
    (2, ["--ep", "2", *LM, "--moe-groups", "2"], "--moe-groups 2 with --ep 2"),
    (4, ["--ep", "3", *LM, "--moe-experts", "6"], "pp=1 x ep=3 x tp=1 = 3 does not divide"),
])
def test_bad_ep_configs_are_named_errors(n, flags, message):
    r = mpirun(n, "-m", "dtlab.collective.train", *flags, "--steps", "2", timeout=60)
    assert r.rc == 2 and not r.timed_out, r
    assert message in r.stderr and "Traceback" not in r.stderr, r
