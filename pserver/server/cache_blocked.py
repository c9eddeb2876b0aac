"""The shard's optimizer, run block by block: the same arithmetic, in cache-sized pieces.

SGD (with or without momentum), Adam and AdamW (models.optim) are
elementwise given the learning rate and the step count. Running one
models.optim instance per block of ~1 MiB of the shard, all stepped together,
therefore gives bit-identical parameters to a single instance over the whole
shard. With `threads` > 1 the blocks are split into that many contiguous
groups stepped in parallel (the C update and NumPy's loops release the
GIL), which helps only while other cores are idle. A block is also what a pushed
gradient's chunk holds, so each step reads its chunk in place.

Where models/_fused.c is not built, the update runs as NumPy passes through
a scratch buffer, and blocks keep those in the CPU cache instead of
streaming each pass over the whole shard through memory. The blocks of one
group step one after another on one thread and share one scratch block,
which therefore stays in cache (a scratch block each would write the
shard's size of cold scratch per step). Checkpoints see one state, as if
it were a single optimizer.

A step may also copy the new values out (`copy_to`: a pull through shared memory
right behind the push that made them): each block right after its update, while
it is still in the cache, with the Adler-32 of each block combined in order
(buffers.adler32_combine). That saves the pull's own pass over the shard's
parameters (64 MB read from memory again for a 64 MB shard); the values and
their checksum are those a separate copy would give.
"""

from __future__ import annotations

import numpy as np

from dtlab.models.optim import OptimConfig, make_optimizer
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.buffers import adler32_combine, copy_and_checksum
from dtlab.pserver.common.codec import ADLER_START
from dtlab.pserver.server.thread_pool import Parallel

BLOCK = 1 << 18  # elements per block (1 MiB of float32)


class BlockedOptimizer:
    def __init__(self, cfg: OptimConfig, params: np.ndarray, decay_mask=None, block: int = BLOCK,
                 threads: int = 1):
        n = params.size
        self.bounds = [(lo, min(n, lo + block)) for lo in range(0, n, block)]
        self.parallel = Parallel(threads, "apply")
        self.groups = self.parallel.groups(range(len(self.bounds)))  # block indices per thread
        self.parts = [None] * len(self.bounds)
        for group in self.groups:  # one thread steps these in turn: they share one scratch
            scratch = np.empty(min(n, block), params.dtype)
            for k in group:
                lo, hi = self.bounds[k]
                self.parts[k] = make_optimizer(
                    cfg, params[lo:hi], None if decay_mask is None else decay_mask[lo:hi],
                    scratch=scratch[: hi - lo])

    @property
    def steps(self) -> int:
        return self.parts[0].steps

    def step(self, param: np.ndarray, grad, lr: float,
             copy_to: np.ndarray | None = None) -> int | None:
        """One step; `grad` is an array or anything sliced like one (buffers.ChunkedArray).
        `copy_to` (param's shape and dtype; it may be `grad` itself, each block of which is
        read before it is overwritten): copy_to[:] = the new values, returning their
        Adler-32 (None without it)."""
        if param.shape != grad.shape:
            raise ValueError(f"param shape {param.shape} != grad shape {grad.shape}")
        sums = None if copy_to is None else [0] * len(self.bounds)  # each block's, from 1

        def run(blocks):
            for k in blocks:
                lo, hi = self.bounds[k]
                self.parts[k].step(param[lo:hi], grad[lo:hi], lr)
                if sums is not None:  # the block just written, still in the cache
                    sums[k] = copy_and_checksum(copy_to[lo:hi], param[lo:hi], ADLER_START)

        self.parallel.run(run, self.groups)
        if sums is None:
            return None
        checksum = ADLER_START
        for (lo, hi), block in zip(self.bounds, sums, strict=True):
            checksum = adler32_combine(checksum, block, (hi - lo) * param.itemsize)
        return checksum

    def step_ranges(self, param: np.ndarray, packed, ranges: list[tuple[int, int]],
                    lr: float) -> None:
        """One step on `ranges` of the shard only, `packed` holding their gradients back to
        back (pserver.common.ranges); every other element and its state stays as it is
        (models.optim.Optimizer.step_ranges). Every block counts the step."""
        if packed.shape != (ranges_lib.size(ranges),):
            raise ValueError(f"packed gradient shape {packed.shape} != the ranges' "
                             f"({ranges_lib.size(ranges)},)")

        def run(blocks):
            for k in blocks:
                lo, hi = self.bounds[k]
                inside, at = ranges_lib.within_packed(ranges, lo, hi)
                piece = packed[at : at + ranges_lib.size(inside)]
                self.parts[k].step_ranges(param[lo:hi], piece, inside, lr)

        self.parallel.run(run, self.groups)

    def state_dict(self) -> dict:
        states = [p.state_dict() for p in self.parts]
        names = [k for k in states[0] if k != "steps"]
        return {"steps": self.steps, **{k: np.concatenate([s[k] for s in states]) for k in names}}

    def load_state_dict(self, state: dict) -> None:
        n = self.bounds[-1][1]
        for k, v in state.items():
            if k != "steps" and v.shape != (n,):
                raise ValueError(f"optimizer state {k}: shape {v.shape} != ({n},)")
        for (lo, hi), part in zip(self.bounds, self.parts, strict=True):
            part.load_state_dict({k: v if k == "steps" else v[lo:hi] for k, v in state.items()})
