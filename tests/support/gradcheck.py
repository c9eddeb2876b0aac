"""Central finite differences in float64, shared by the gradient tests.

    dL/dθ_i ~ (L(θ + h e_i) - L(θ - h e_i)) / 2h,   h = 1e-6

The truncation error is O(h^2 L''') ~ 1e-12 and the rounding error about
eps_64 |L| / h ~ 1e-10 |L|, so for the O(1)-O(10) losses used here an
analytic gradient must match within ATOL + RTOL |numeric|. A wrong term in
a backward pass gives errors of order 1e-2 or more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

H = 1e-6
ATOL = 1e-8
RTOL = 1e-6


def numeric_grad(f: Callable[[], float], arr: np.ndarray, indices: Iterable[int]) -> np.ndarray:
    """dF/d arr.flat[i] for each i, by central differences; `arr` is perturbed in place."""
    flat = arr.reshape(-1)  # a view: writing it writes arr
    assert np.shares_memory(flat, arr)
    out = []
    for i in indices:
        old = flat[i]
        flat[i] = old + H
        fp = f()
        flat[i] = old - H
        fm = f()
        flat[i] = old
        out.append((fp - fm) / (2 * H))
    return np.array(out)


def assert_grad_close(analytic, numeric, what: str) -> None:
    analytic, numeric = np.asarray(analytic).ravel(), np.asarray(numeric).ravel()
    err = np.abs(analytic - numeric)
    bound = ATOL + RTOL * np.abs(numeric)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (
        f"{what}: analytic {analytic[worst]!r} vs numeric {numeric[worst]!r} "
        f"at flat index {worst} (|err| {err[worst]:.3g} > {bound[worst]:.3g})")


def sample_offsets(P, per_tensor: int, rng: np.random.Generator) -> list[int]:
    """`per_tensor` random buffer offsets inside every parameter of P (all when smaller)."""
    out = []
    for spec in P.specs:
        lo, hi = P.offsets[spec.name]
        k = min(per_tensor, hi - lo)
        out += sorted((lo + rng.choice(hi - lo, size=k, replace=False)).tolist())
    return out
