"""Data-parallel sharding of a Dataset into per-step micro-batches.

Every rank walks the same global order. Epoch e is the permutation

    perm_e = default_rng([seed, e]).permutation(n)

and each step consumes the next global window of W = world * k * B examples
(k micro-batches of B per rank; k is --grad-accum):

    window = perm_e[position : position + W]          # a short tail (< W) is dropped
    rank r takes window[r k B : (r + 1) k B] and splits it into k micro-batches of B

    e.g. world 2, k 2, B 3:  window = [a b c | d e f | g h i | j k l]
                                        r0 mb0  r0 mb1  r1 mb0  r1 mb1

So one process with batch N B sees at each step exactly the union of what N
ranks with batch B see, in the same epochs; and the state is global
({"epoch", "position"}), the same on every rank, so a run resumes bit-identically.
"""

from __future__ import annotations

import numpy as np

from dtlab.models.config import ConfigError
from dtlab.models.data.dataset import Dataset


class ShardedLoader:
    def __init__(self, dataset: Dataset, batch_size: int, rank: int = 0, world: int = 1,
                 seed: int = 0, micro_batches: int = 1):
        if batch_size <= 0:
            raise ConfigError(f"--batch-size must be positive (got {batch_size})")
        if micro_batches <= 0:
            raise ConfigError(f"--grad-accum must be positive (got {micro_batches})")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        self.dataset, self.B, self.k = dataset, batch_size, micro_batches
        self.rank, self.world, self.seed = rank, world, seed
        self.W = world * micro_batches * batch_size  # examples per global step
        if self.W > dataset.n:
            raise ConfigError(
                f"--batch-size {batch_size} x --grad-accum {micro_batches} x {world} rank(s)"
                f" = {self.W} examples per step exceeds the {dataset.n} in the dataset")
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset.n // self.W

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm_epoch, self._perm = self.epoch, rng.permutation(self.dataset.n)
        return self._perm  # (n,)

    def next(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """This rank's k micro-batches (inputs, targets) for one step."""
        if self.position + self.W > self.dataset.n:
            self.epoch, self.position = self.epoch + 1, 0
        window = self._permutation()[self.position : self.position + self.W]  # (W,)
        self.position += self.W
        kB = self.k * self.B
        mine = window[self.rank * kB : (self.rank + 1) * kB].reshape(self.k, self.B)  # (k, B)
        return [self.dataset.batch(idx) for idx in mine]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = state.get("epoch"), state.get("position")
        if not (isinstance(epoch, int) and isinstance(position, int)
                and epoch >= 0 and 0 <= position <= self.dataset.n):
            raise ValueError(f"loader state needs integer epoch >= 0 and position in "
                             f"[0, {self.dataset.n}], got {state!r}")
        self.epoch, self.position = epoch, position
