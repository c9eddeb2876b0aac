"""`dtlab-worker --compress topk:F | randk:F | sign`: the worker's gradient compressed with
error feedback before it is pushed (Stich et al. 2018, "Sparsified SGD with memory";
Karimireddy et al. 2019, "Error feedback fixes SignSGD and other gradient compression
schemes"), by models/compress.py on the whole flat gradient:

    p_t = g_t + e_t;   send C(p_t);   e_{t+1} = p_t - D(C(p_t))   (--no-error-feedback: e = 0)

then cut into each shard's part (pserver.common.compressed: indices and values, or packed
signs and the scale), which the servers decode and apply (to the sent elements only, for
top-k and random-k). The compression happens once per step, before any retry, so a retried
push sends the same bytes and the residual holds exactly what the step did not send.
Random-k draws its indices from (seed, step) with a seed of this worker's own (each worker
its own draws) and sends them, since the servers draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtlab.models.compress import CompressConfig, Compressor, make_compressor, spec
from dtlab.models.config import ConfigError
from dtlab.pserver.common import compressed
from dtlab.pserver.common.compressed import Part

KINDS = ("topk", "randk", "sign")  # what a server decodes (PushCompressed)


class CompressedPush:
    """The compressor of a worker's flat gradients of `size` elements of `dtype`."""

    def __init__(self, cfg: CompressConfig, size: int, dtype=np.float32, seed: int = 0):
        kind, _ = spec(cfg.compress)
        if kind not in KINDS:
            raise ConfigError(f"--compress {cfg.compress}: the parameter servers take "
                              f"{', '.join(KINDS)} (PowerSGD needs the workers' reductions "
                              "of dtlab-sync)")
        self.kind = kind
        self.compressor: Compressor = make_compressor(cfg, size, dtype, seed=seed)

    def seed(self, seed: int, worker: int) -> None:
        """Random-k's draws: this worker's own for run seed `seed` (before its first push)."""
        if self.kind == "randk":
            self.compressor.seed = seed * 1_000_003 + worker

    @property
    def residual(self):
        """(n,) e: what earlier pushes did not send (None without error feedback)."""
        return self.compressor.residual

    def parts(self, grad: np.ndarray, bounds: Sequence[tuple[int, int]]) -> list[Part]:
        """Compress `grad` (n,) once (the residual moves on) into each shard's part."""
        payload = self.compressor.compress(grad)
        indices = self.compressor.indices(payload.step) if self.kind == "randk" else None
        return compressed.split(payload, bounds, indices)
