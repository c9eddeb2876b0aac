"""Tensor parallelism's all-reduces (Megatron-LM, Shoeybi et al. 2019), per stage.

A transformer split over t ranks (models/tensor_parallel.py) all-reduces a (b, T, d)
activation twice forward in every block (after attention's output projection and after
the FFN's, Megatron's g) and twice backward (before qkv and before the FFN, its f); the
vocabulary-parallel embedding adds one forward, the head one backward, the cross-entropy
one of its (N, 2) statistics and an all-gather of N row maxima. Per micro-batch these are
dtlab.lab.bench.parallel_formulas.tp_payload's bytes, split by the stage they run on.
They run within a node (tp is the grid's fastest dimension), on the intra-node link at
the all-reduce collective/algorithms/choose.py picks; the all-gather of n output bytes costs
(t - 1) alpha + (t - 1)/t n beta (a ring).

Recomputation (--recompute) runs each block's forward again in backward, its two
all-reduces with it: a block then all-reduces 2 times forward and 4 times backward
(Korthikanti et al. 2022, section 4.2). Sequence parallelism (Korthikanti et al. 2022,
section 4.2.2) turns each all-reduce into a reduce-scatter plus an all-gather of the same
tensor: on a ring the same bytes and steps, so the same time here; what it changes is
the norms' and dropouts' work and memory, split over t (simulate/hardware.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.lab.simulate.formulas import Network, sync_allreduce_s
from dtlab.lab.simulate.links import Link
from dtlab.models.parts import Part


@dataclass(frozen=True)
class StageMessages:
    """What one stage hands its tp communicator per micro-batch: the sizes in bytes of
    its forward and backward all-reduces and of its all-gathers' outputs."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    allgather: tuple[float, ...]

    @property
    def allreduce_bytes(self) -> float:
        return sum(self.forward) + sum(self.backward)


def stage_messages(parts: list[Part], c, b: int, t: int, itemsize: int) -> StageMessages:
    if t == 1:
        return StageMessages((), (), ())
    N = b * c.seq_len
    act = N * c.d_model * itemsize
    fwd, bwd, gather = [], [], []
    again = 2 if getattr(c, "recompute", False) else 1  # a recomputed block's forward twice
    for p in parts:
        name = p.name.removeprefix("h.")
        if name == "embedding":
            fwd.append(act)
        elif name == "attention" or name.startswith(("ffn", "moe")):
            fwd += [act] * p.count
            bwd += [act] * (again * p.count)
        elif name == "head":
            bwd.append(act)
        elif name.startswith("loss"):
            fwd.append(2 * N * itemsize)
            gather.append(t * N * itemsize)
    return StageMessages(tuple(fwd), tuple(bwd), tuple(gather))


def allgather_s(out_bytes: float, t: int, link: Link) -> float:
    return (t - 1) * (link.alpha_s + out_bytes / t * link.beta_s_per_byte)


def stage_tp_s(msgs: StageMessages, t: int, net: Network, one_host: bool) -> tuple[float, float]:
    """(forward, backward) seconds of a stage's tp communication for one micro-batch."""
    if t == 1:
        return 0.0, 0.0

    def ar(n: float) -> float:
        return sync_allreduce_s("ring", n, t, net, one_host_shm=one_host)[0]

    gather_link = net.link("ring", net.intra)
    return (sum(ar(n) for n in msgs.forward) + sum(allgather_s(n, t, gather_link)
                                                     for n in msgs.allgather),
            sum(ar(n) for n in msgs.backward))
