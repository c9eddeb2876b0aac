"""Synthetic classification by a random linear teacher with label noise.

    x ~ N(0, I_d) (float32),   clean(x) = argmax_c (x W)_c,   W (d, C) with unit columns
    y = clean(x) with probability 1 - eps, else one of the other C - 1 classes uniformly

so p(y | x) = 1 - eps on the teacher's class and eps / (C - 1) on each other
class, and the Bayes-optimal cross-entropy (the loss floor) is exactly

    H = -(1 - eps) ln(1 - eps) - eps ln(eps / (C - 1))        (H = 0 when eps = 0)

whatever the distribution of x. Unit columns keep the classes about equally
frequent. The teacher is linear on purpose: its Bayes posterior is already a
step function of x, which a linear softmax cannot represent (it stalls
~0.25-0.4 nats above H) but a small MLP approaches within ~0.05-0.1 nats in
a couple of thousand steps; a nonlinear (tanh) teacher tried alongside it
left the same MLP ~0.6 nats short, slowing tests without making H any truer.
"""

from __future__ import annotations

import math

import numpy as np

from dtlab.models.data.dataset import ArrayDataset


def teacher_floor(eps: float, n_classes: int) -> float:
    """H = -(1 - eps) ln(1 - eps) - eps ln(eps / (C - 1)), in nats; 0 when eps = 0."""
    if eps == 0:
        return 0.0
    return -(1 - eps) * math.log(1 - eps) - eps * math.log(eps / (n_classes - 1))


class TeacherDataset(ArrayDataset):
    """`n` examples of dimension `d_in` in `n_classes` classes, fixed by `seed`; `draw` > 0
    gives other examples of the same teacher (a held-out set)."""

    def __init__(self, n: int, d_in: int, n_classes: int, label_noise: float, seed: int,
                 draw: int = 0):
        if n_classes < 2:
            raise ValueError("a teacher needs at least 2 classes")
        C, eps = n_classes, label_noise
        W = np.random.default_rng([seed, 0]).standard_normal((d_in, C))  # (d, C)
        self.W = W / np.linalg.norm(W, axis=0)
        stream = [draw] if draw else []
        x = np.random.default_rng([seed, 1, *stream]).standard_normal((n, d_in),
                                                                      dtype=np.float32)
        self.clean = self.teacher_class(x)  # (n,)
        noise = np.random.default_rng([seed, 2, *stream])
        flip = noise.random(n) < eps  # (n,)
        shift = noise.integers(1, C, size=n)  # (n,) in 1..C-1: another class, uniformly
        y = np.where(flip, (self.clean + shift) % C, self.clean)
        self.label_noise = eps
        super().__init__("teacher", x, y, C, teacher_floor(eps, C),
                         {"label_noise": eps, "flipped": float(flip.mean())})

    def teacher_class(self, x: np.ndarray) -> np.ndarray:
        """argmax_c (x W)_c for x (B, d): the noise-free label, (B,) int64."""
        return np.argmax(x.astype(np.float64) @ self.W, axis=1)  # (B, C) -> (B,)

    def posterior(self, x: np.ndarray) -> np.ndarray:
        """The true p(y | x), (B, C): 1 - eps on the teacher's class, eps / (C - 1) elsewhere."""
        C, eps = self.n_classes, self.label_noise
        p = np.full((len(x), C), eps / (C - 1))  # (B, C)
        p[np.arange(len(x)), self.teacher_class(x)] = 1 - eps
        return p
