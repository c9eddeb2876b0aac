"""Expert parallelism's exchanges: the all-to-alls of an MoE layer's dispatched rows.

An ep group of e ranks holds the E experts of every MoE layer, E / e each
(models/moe_ep.py; GShard, Lepikhin et al. 2021). Per MoE layer and micro-batch of
b samples of T tokens, each rank routes its own N = b T tokens to k experts each
and sends the rows to their experts' ranks:

    rows   = k N min(1, capacity factor)     (dropless: k N; models/moe.py keeps
             ceil(factor k N / E) rows an expert, so balanced routing drops nothing
             at a factor >= 1 and keeps the factor's share below it)
    bytes  = rows d size                     one rank's send of one all-to-all

    forward   counts (E int64, one small all-to-all), dispatch, combine
    backward  the rows' gradients back to the experts, and back again

so 4 all-to-alls of `bytes` per MoE layer per micro-batch, each costing
(e - 1) alpha + (e - 1)/e bytes beta (pairwise exchange, simulate/formulas.py's
"alltoall"). k is the router's slots (k_max with dynamic routing: an upper bound).
Balanced routing is assumed: a skewed router makes the busiest rank's exchange and
experts slower than this.

Gradients: an MoE layer's E experts are split over ep, everything else (router, shared
experts) replicated; the dense range is averaged over dp x ep, the experts' over dp
(collective/train.py).
"""

from __future__ import annotations

from dtlab.lab.simulate.formulas import allreduce_s
from dtlab.lab.simulate.links import Link
from dtlab.models.parts import Part, gelu_ffn, swiglu_ffn

COUNT_BYTES = 8  # the int64 rows-per-expert counts exchanged before the rows
A2A_PER_LAYER = 4  # dispatch and combine, forward and backward


def is_moe(part: Part) -> bool:
    return part.name.removeprefix("h.").startswith("moe")


def dispatched_rows(c, b: int) -> float:
    """Rows one rank sends in one all-to-all of one MoE layer (balanced routing)."""
    N = b * c.seq_len
    k = c.router_options().slots
    keep = 1.0 if c.moe_dropless else min(1.0, c.moe_capacity_factor)
    return k * N * keep


def alltoall_bytes(c, b: int, itemsize: int) -> float:
    """Bytes one rank sends in one all-to-all of the rows (rows x d x size)."""
    return dispatched_rows(c, b) * c.d_model * itemsize


def alltoall_s(nbytes: float, e: int, link: Link) -> float:
    return allreduce_s("alltoall", nbytes, e, link)


def layer_alltoall_s(c, b: int, itemsize: int, e: int, link: Link) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's exchanges for one micro-batch."""
    if e == 1:
        return 0.0, 0.0
    rows = alltoall_s(alltoall_bytes(c, b, itemsize), e, link)
    counts = alltoall_s(c.moe_experts * COUNT_BYTES, e, link)
    return counts + 2 * rows, 2 * rows


def expert_params(c, part: Part) -> int:
    """Parameters of the E routed experts in `part` (one copy; 0 unless an MoE Part)."""
    if not is_moe(part):
        return 0
    expert = (swiglu_ffn if c.ffn == "swiglu" else gelu_ffn)("expert", 1, c.d_model, c.d_ff)
    return c.moe_experts * expert.params
