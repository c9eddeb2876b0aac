"""The error bound of a half-precision sum under dtlab's accumulation rule.

The rule (collective/transport/link.py): every addition is computed in float32 and
rounded to the buffer's dtype, so a partial sum is rounded once per hop; a
sum over N ranks goes through at most k = N - 1 roundings on any path (any
summation tree of N values is at most N - 1 deep), and averaging rounds once
more (k = N). Recursive summation's bound (Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., eq. 4.4) then gives, element by element,

    |computed - exact| <= gamma_k * sum_r |x_r| + k * eta / 2,
    gamma_k = k u / (1 - k u),

with u the unit roundoff (2^-8 for bfloat16, 2^-11 for float16: k hops cost
about k * 2^-8 relative in bfloat16) and eta the smallest subnormal (the
absolute error of rounding near zero). The float32 intermediate adds at most
2^-24 relative per addition, k 2^-24 in all, which gamma_k - k u > (k u)^2
covers since u^2 >= 2^-24 for both dtypes. `exact` and `sum_r |x_r|` are
taken in float64 from the inputs as they are in the dtype, so input rounding
is not counted.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def unit_roundoff(dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding to nearest."""
    return float(ml_dtypes.finfo(dtype).eps) / 2


def error_bound(dtype, roundings: int, abs_sum: np.ndarray) -> np.ndarray:
    """The largest error allowed per element (L,) after `roundings` roundings."""
    ku = roundings * unit_roundoff(dtype)
    eta = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    return ku / (1 - ku) * abs_sum + roundings * eta / 2


def worst_ratio(got: np.ndarray, exact: np.ndarray, abs_sum: np.ndarray, dtype,
                roundings: int) -> float:
    """max over elements of |got - exact| / bound: <= 1 obeys the rule; NaN or inf
    (an overflowed or garbage result) counts as infinitely far."""
    with np.errstate(invalid="ignore", over="ignore"):  # a garbage result: inf, NaN
        err = np.abs(got.astype(np.float64) - exact)  # (L,)
    ratio = err / error_bound(dtype, roundings, abs_sum)  # (L,)
    if ratio.size and not np.all(np.isfinite(ratio)):
        return float("inf")
    return float(ratio.max(initial=0.0))
