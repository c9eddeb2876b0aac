"""A network plus its loss, and the Replica that the trainers drive.

    loss, ctx = model.forward(P, (inputs, targets), scale)
    model.backward(P, ctx, grad_ready)      # accumulates into P.grads

The loss is the model's `loss` (softmax cross-entropy unless the model
passes another, e.g. the vocabulary-parallel one of a tensor-split model);
`tp` is the tensor-parallel communicator a split model was built over (None:
dense), which the global gradient norm needs.

A Replica is one copy of the model as this process sees it: its FlatParams
and a `compute_grads(micro_batches)` step. The single-process trainer, the
sync data-parallel trainer and the async parameter-server worker all drive a
Replica; that is what makes the topologies interchangeable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dtlab.models import backend
from dtlab.models.comm import Comm
from dtlab.models.layers import Sequential
from dtlab.models.loss import softmax_cross_entropy
from dtlab.models.moe import moe_layers
from dtlab.models.optim import clip_grad_norm, clip_to, complement, squares
from dtlab.models.params import FlatParams
from dtlab.models.tensor_parallel import SPLIT

EXPERT = ("ep", "ep+tp")  # split labels of expert parameters: one group, laid out last

# (logits, targets, scale) -> (mean loss, dlogits times scale)
Loss = Callable[..., tuple[float, object]]


class Model:
    """`body` maps inputs to logits; `loss` scores them (default: softmax cross-entropy)."""

    name = "model"
    pp: Comm | None = None  # a pipeline stage's communicator (models/pipeline.py)
    ep: Comm | None = None  # the expert-parallel group (models/moe_ep.py; None: every expert)

    def __init__(self, config, body: Sequential, loss: Loss = softmax_cross_entropy,
                 tp: Comm | None = None):
        self.config, self.body, self.loss, self.tp = config, body, loss, tp
        self.moe = moe_layers(body)  # Mixture-of-Experts layers: their stats, aux losses

    def set_mode(self, scale: float, training: bool = True) -> None:
        """Tell the MoE layers the loss's scale (their balancing gradients follow it) and
        whether this is training (router noise) or evaluation."""
        for m in self.moe:
            m.aux_scale, m.training = scale, training

    def specs(self):
        """The body's parameters; under ep the held experts (split "ep") moved after the
        dense ones, so each group is one contiguous range of the flat buffers."""
        specs = self.body.specs()
        if self.ep is None:
            return specs
        return [s for s in specs if s.split not in EXPERT] + \
            [s for s in specs if s.split in EXPERT]

    def prepare(self, batch, P: FlatParams):
        """Move a host batch to the parameters' device and dtype."""
        inputs, targets = batch
        xp = P.xp
        if inputs.dtype.kind == "f":
            inputs = xp.asarray(inputs, dtype=P.dtype)
        else:
            inputs = xp.asarray(inputs)
        return inputs, xp.asarray(targets)

    def forward(self, P: FlatParams, batch, scale: float = 1.0, training: bool = True):
        self.set_mode(scale, training)
        inputs, targets = self.prepare(batch, P)
        logits, ctxs = self.body.forward(P, inputs)
        loss, dlogits = self.score(P, logits, targets, scale)
        return loss, (ctxs, dlogits)

    def score(self, P: FlatParams, logits, targets, scale: float):
        """(loss, dlogits x scale) of `logits`; under mixed precision (P.cast) the loss in
        float32 and its gradient kept in the half dtype."""
        if P.cast is None:
            return self.loss(logits, targets, scale)
        loss, dlogits = self.loss(P.cast.up(logits), targets, scale)
        return loss, P.cast.down(dlogits)

    def backward(self, P: FlatParams, ctx, grad_ready: Callable[[int], None] | None = None):
        ctxs, dlogits = ctx
        self.body.backward(P, ctxs, dlogits, grad_ready)

    def loss_and_grad(self, P: FlatParams, batch, scale: float = 1.0, grad_ready=None) -> float:
        loss, ctx = self.forward(P, batch, scale)
        self.backward(P, ctx, grad_ready)
        return loss

    def clip_grad_norm(self, P: FlatParams, max_norm: float) -> float:
        """Clip P.grad to the global norm of the whole model's gradient (over its
        tensor-parallel shards and its expert-parallel ranks' experts, every gradient
        counted once); return the norm before clipping. With both, by split label:

            norm^2 = |g_rest|^2 + sum_ep |g_ep|^2 + sum_tp (|g_tp|^2 + sum_ep |g_ep+tp|^2)
        """
        if self.ep is None and self.tp is None:
            return clip_grad_norm(P.grad, max_norm)
        if self.ep is None:
            return clip_grad_norm(P.grad, max_norm, split=P.ranges(SPLIT), comm=self.tp)
        if self.tp is None:
            return clip_grad_norm(P.grad, max_norm, split=P.ranges(*EXPERT), comm=self.ep)
        sq = {label: squares(P.grad, P.ranges(label)) for label in ("ep", "ep+tp", SPLIT)}
        experts = self.ep.allreduce(np.array([sq["ep"], sq["ep+tp"]]))  # (2,) over ep
        split = self.tp.allreduce(np.array([sq[SPLIT] + experts[1]]))  # (1,) over tp
        rest = squares(P.grad, complement(P.ranges("ep", "ep+tp", SPLIT), P.size))
        return clip_to(P.grad, math.sqrt(rest + experts[0] + split[0]), max_norm)

    def init_params(self, seed: int, dtype="float32", xp=None) -> FlatParams:
        return FlatParams(self.specs(), seed=seed, dtype=dtype, xp=xp or backend.xp())


class Replica:
    """One copy of the model in this process: parameters, gradients, one step."""

    def __init__(self, model: Model, params: FlatParams):
        self.model, self.params = model, params
        self.compute_params = params  # what forward and backward run on (a reducer's buffer)
        self.timing: dict = {}  # the last step's figures a subclass measures (a pipeline's bubble)
        self.spans: list = []  # the last step's (name, perf_counter start, end) passes, if kept

    def evaluate(self, batches: Sequence) -> float:
        """The mean loss over `batches` (forward only; gradients untouched)."""
        total = sum(self.model.forward(self.params, b, training=False)[0] for b in batches)
        return total / len(batches)

    def compute_grads(self, micro_batches: Sequence, grad_ready=None,
                      scale: float = 1.0) -> float:
        """Zero the gradients, accumulate the mean gradient over the micro-batches.

        Each micro-batch's loss is scaled by scale/k, so k micro-batches of size b
        give the gradient of one batch of size k*b (times `scale`: a mixed-precision
        loss scale, models/precision.py). `grad_ready` is passed to
        the last backward only: earlier ones are not final (cf. DDP no_sync).
        Returns the mean loss.
        """
        P, k = self.params, len(micro_batches)
        P.zero_grad()
        total = 0.0
        for i, mb in enumerate(micro_batches):
            ready = grad_ready if i == k - 1 else None
            total += self.model.loss_and_grad(P, mb, scale=scale / k, grad_ready=ready)
        return total / k

    def finish_grads(self) -> tuple[bool, dict]:
        """After any reduction of compute_params.grad: whether the optimizer may apply
        params.grad, and the step's record fields (models/precision.py: unscaling and the
        overflow check). Full precision: always, nothing to record."""
        return True, {}
