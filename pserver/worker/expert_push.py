"""The ranges a Mixture-of-Experts worker pushes: all but the experts no token reached.

An expert that kept no token row in any forward of a step (every micro-batch
of --grad-accum, every MoE layer; under a capacity, the rows kept after
drops) never ran forward or backward, so its gradient is exactly zero
(models.moe: an expert with no rows is skipped). With --moe-sparse-push the
worker leaves those experts' parameters out of its push:

    pushed = [0, n) - union of the untouched experts' parameter ranges

merged into as few ranges as the layout allows (pserver.common.ranges), and the
servers update exactly those (a lazy update: see models.optim.Optimizer.step_ranges).
The rows each expert kept come from the layers' MoEStats: the running sum of
"kept_per_expert" over forwards, read before and after compute_grads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtlab.models.moe import MoE
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.ranges import Ranges

KEPT = "kept_per_expert"  # MoEStats' running sum of the rows each expert kept


class ExpertPush:
    """`layers`: the model's MoE layers (Model.moe), `specs`: its parameters in flat order."""

    def __init__(self, layers: Sequence[MoE], specs: Sequence):
        found = ranges_lib.expert_ranges(specs)
        self.size = sum(s.size for s in specs)
        self.layers = [m for m in layers if m.stats is not None]
        # per layer, each held expert's parameter ranges, in the order of its counts
        self.experts = [[found[f"{m.name}.e{e}"] for e in m.owned] for m in self.layers]
        self.expert_elements = sum(ranges_lib.size(r) for r in found.values())
        self._before: list[np.ndarray] = []

    def begin(self) -> None:
        """Before compute_grads: the rows kept so far."""
        self._before = [self._kept(m) for m in self.layers]

    def ranges(self) -> tuple[Ranges, float]:
        """After compute_grads: the model's ranges to push, and the fraction of the expert
        parameters among them."""
        untouched = [r for m, before, experts in zip(self.layers, self._before, self.experts,
                                                     strict=True)
                     for kept, own in zip(self._kept(m) - before, experts, strict=True)
                     if kept == 0 for r in own]
        pushed = ranges_lib.without(self.size, untouched)
        left_out = ranges_lib.size(ranges_lib.merged(untouched))
        fraction = 1.0 - left_out / self.expert_elements if self.expert_elements else 1.0
        return pushed, fraction

    @staticmethod
    def _kept(layer: MoE) -> np.ndarray:
        """(held experts,) rows each kept over every forward so far."""
        kept = layer.stats.sums.get(KEPT)
        return np.zeros(len(layer.owned)) if kept is None else np.array(kept)
