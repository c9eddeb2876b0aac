"""What a pipelined, tensor-split transformer step should send, hold and idle, from its config.

With N = b T tokens per micro-batch, m micro-batches, p stages, t tensor-parallel ranks, L
blocks, float32 (4 bytes) activations and the pipeline's 64-byte shape header:

    p2p bytes  = t k (2 m N d 4 + 64)
                 (each of the t pipelines: every micro-batch's activation forward through
                 the k boundaries between stages on different ranks, its gradient back
                 through them, and once a step the activation's shape header; k = p - 1,
                 v p - 1 with v chunks a rank in a loop (interleaved 1F1B), 2p - 2 in a V,
                 whose bottom stays on one rank)
    tp bytes   = t m [(N d (4 L + 2) + 2 N) 4 2(t - 1)/t  +  t N 4 (t - 1)/t]
                 (per rank and micro-batch, the all-reduce payloads of Megatron's g and f:
                 the vocabulary-parallel embedding's g, per block attention-out and FFN-out g
                 forward and the f before qkv and before the FFN backward, the head's f; the
                 cross-entropy's (N, 2) statistics; times the ring's 2(t - 1)/t, the bytes
                 each rank puts on its link in a bandwidth-optimal all-reduce (nccl-tests'
                 busbw); plus the cross-entropy's all-gather of N row maxima, (t - 1)/t of its
                 t N output arriving from the others)

Memory per rank follows models/cost.py (ZeRO's accounting, Rajbhandari et al. 2020):
parameters, gradients and optimizer states of the rank's modules (models/partition.py's
module_parts), each Part's tensor-split share as models/tensor_parallel.py splits it: qkv and
the FFN's first matrix by columns (with their biases), the output projections by rows (their
biases replicated), the embedding table and the head by vocabulary (positions replicated),
norms replicated. A micro-batch's activations are its modules' Parts with the split share of
their context (attention's qkv, scores and heads' output, the FFN hidden state, the logit
gradient) over t. Peak activations replay the stage's op list: a forward holds its
context, a deferred B (ZB-H1) then holds the inputs of its weight gradients (x and dy of
every matmul) until its W, as models/pipeline.py counts them.
"""

from __future__ import annotations

from dtlab.models.cost import OPTIMIZER_STATES
from dtlab.models.parts import FLOAT_BYTES, TOKEN_BYTES, Part
from dtlab.models.pipeline import MAX_NDIM
from dtlab.models.schedule import Op, virtual_stage

HEADER_BYTES = (MAX_NDIM + 1) * 8  # the int64 shape header, once a step and boundary

_COMMON = ["--model", "transformer", "--vocab", "64", "--seq-len", "64", "--n-layers", "4"]
SIZES = {  # name -> (model flags, samples per micro-batch)
    "tiny": (["--model", "transformer", "--vocab", "16", "--seq-len", "8", "--d-model", "16",
              "--n-heads", "4", "--n-layers", "4", "--d-ff", "32"], 2),
    "d128": ([*_COMMON, "--d-model", "128", "--n-heads", "4", "--d-ff", "512"], 2),
    "d256": ([*_COMMON, "--d-model", "256", "--n-heads", "8", "--d-ff", "1024"], 2),
}


def ring_factor(t: int) -> float:
    """Bytes on each rank's link per payload byte of a bandwidth-optimal all-reduce."""
    return 2 * (t - 1) / t


def crossings(layout: str, p: int, v: int) -> int:
    """Boundaries between consecutive stages held by different ranks."""
    rank = {virtual_stage(layout, p, r, c): r for r in range(p) for c in range(v)}
    return sum(rank[g] != rank[g + 1] for g in range(v * p - 1))


def p2p_bytes(c, b: int, m: int, p: int, t: int, k: int | None = None) -> int:
    """k: the boundaries between ranks (default p - 1: one stage a rank)."""
    act = b * c.seq_len * c.d_model * FLOAT_BYTES
    return t * (p - 1 if k is None else k) * (2 * m * act + HEADER_BYTES)


def tp_payload(c, b: int, t: int) -> tuple[int, int]:
    """(all-reduce, all-gather output) bytes one rank hands the tp communicator per
    micro-batch, summed over the stages of its pipeline."""
    if t == 1:
        return 0, 0
    N, d = b * c.seq_len, c.d_model
    return (N * d * (4 * c.n_layers + 2) + 2 * N) * FLOAT_BYTES, t * N * FLOAT_BYTES


def tp_bytes(allreduce: int, allgather: int, t: int) -> float:
    """Link bytes of the payloads handed to the communicator (see the module docstring)."""
    return allreduce * ring_factor(t) + allgather * (t - 1) / t if t > 1 else 0.0


def _replicated(part: Part, c, b: int) -> tuple[int, int]:
    """(params, act floats) of `part` that every tp rank holds whole."""
    N, d = b * c.seq_len, c.d_model
    name = part.name.removeprefix("h.")
    if name == "embedding":
        return c.seq_len * d, 0  # the position table
    if name in ("ln1", "ln2", "ln_f", "head"):
        return part.params if name != "head" else 0, part.act_floats  # the head keeps x
    if name in ("attention", "ffn (gelu)"):
        return d, N * d  # the row-split projection's bias; the input x
    if name == "ffn (swiglu)":
        return 0, N * d
    return 0, 0  # the loss's logit gradient: split by vocabulary


def shard(part: Part, c, b: int, t: int) -> tuple[float, float]:
    """(parameters, activation bytes) of one copy of `part` on one of t tp ranks."""
    params, floats = _replicated(part, c, b)
    act = (floats + (part.act_floats - floats) / t) * FLOAT_BYTES
    other = part.act_other_bytes
    if part.name == "embedding" and t > 1:
        # VocabParallelEmbedding keeps (row, position) int64 pairs of the tokens it owns:
        # N / t of uniform tokens, on average
        other = 2 * TOKEN_BYTES * b * c.seq_len / t
    return params + (part.params - params) / t, act + other


def weight_queue_bytes(part: Part, c, b: int, t: int) -> float:
    """Bytes a deferred B keeps for its W: x (N, d_in) and dy (N, d_out) of each matmul."""
    N, d, f = b * c.seq_len, c.d_model, c.d_ff
    floats = {"h.attention": 2 * N * d + 4 * N * d / t,  # qkv: x, dqkv; proj: heads, dy
              "h.ffn (gelu)": 2 * N * d + 2 * N * f / t,  # fc: x, dh; proj: GELU out, dy
              "h.ffn (swiglu)": 2 * N * d + 3 * N * f / t,  # w1, w3 share x
              "head": N * d,
              "loss (dlogits)": N * c.vocab / t}.get(part.name, 0)  # the head's dy
    return floats * FLOAT_BYTES


def stage_estimate(groups: list[list[Part]], c, b: int, t: int, optimizer: str) -> dict:
    """Per-rank bytes of one stage's modules (`groups`: their Parts)."""
    parts = [q for g in groups for q in g]
    params = sum(shard(q, c, b, t)[0] for q in parts)
    per_param = FLOAT_BYTES * (2 + OPTIMIZER_STATES[optimizer])  # weight, grad, states
    return {"param_bytes": params * FLOAT_BYTES, "state_bytes": params * per_param,
            "context_bytes": sum(shard(q, c, b, t)[1] for q in parts),
            "queue_bytes": sum(weight_queue_bytes(q, c, b, t) for q in parts)}


def peak_held(ops: list[Op], context: list[float], queue: list[float]) -> float:
    """Most bytes held at once by one rank's list: F..B a context, B..W a weight queue,
    each of the chunk the op runs (context[c], queue[c])."""
    held: dict[tuple[int, int], float] = {}
    most = 0.0
    for kind, i, c in ops:
        if kind == "F":
            held[i, c] = context[c]
        elif kind == "B":
            held[i, c] = queue[c]
        else:
            held.pop((i, c))
        most = max(most, sum(held.values()))
    return most
