"""Streaming DiLoCo's schedule: which fragment of the parameters synchronises when.

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch": DiLoCo (models/outer.py) synchronises all parameters every H
inner steps; Streaming DiLoCo cuts them into F fragments and synchronises one at a time,
fragment f after the inner steps s (counted from 1) with

    s mod H == ((f + 1) H / F) mod H                      (H a multiple of F)

so a sync moves 1/F of the parameters every H / F steps and each fragment still every H.
Its exchange may overlap tau inner steps (tau < H / F): the outer gradient is taken
after step s, the outer step made with its mean, and the new global fragment merged
into the local one after step s + tau,

    theta_local_f <- alpha theta_local_f + (1 - alpha) theta_global_f    (alpha = 0: a copy)

At the run's last step every fragment synchronises, so every replica ends on the global
parameters (a shorter last round, as DiLoCo's). F = 1, tau = 0, alpha = 0 is DiLoCo: the
one fragment syncs at the round ends `round_ends` names (tests/collective/
test_streaming.py checks it bit for bit).

Fragments here are contiguous runs of whole tensors of the flat buffer, cut where the
running size passes each f / F of the total (the paper also strides layers across
fragments; contiguous is its "sequential" pattern).
"""

from __future__ import annotations

from collections.abc import Sequence


def fragment_ranges(tensor_ranges: Sequence[tuple[int, int]], fragments: int
                    ) -> list[tuple[int, int]]:
    """F contiguous [lo, hi) element ranges of the flat buffer, each of whole tensors
    (`tensor_ranges` in buffer order), split where the running size passes f/F of all."""
    total = tensor_ranges[-1][1] if tensor_ranges else 0
    if not 1 <= fragments <= len(tensor_ranges):
        raise ValueError(f"{fragments} fragments of {len(tensor_ranges)} tensors: "
                         "between 1 and the number of tensors")
    cuts, f = [0], 1
    for i, (_, hi) in enumerate(tensor_ranges):
        left = len(tensor_ranges) - 1 - i  # tensors after this one
        if f < fragments and (hi * fragments >= f * total or left == fragments - f):
            cuts.append(hi)
            f += 1
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def syncing(step: int, local_steps: int, fragments: int, total: int) -> list[int]:
    """The fragments that synchronise after inner step `step` (0-based) of `total`."""
    s = step + 1
    if s == total:
        return list(range(fragments))
    every = local_steps // fragments
    return [f for f in range(fragments) if s % local_steps == ((f + 1) * every) % local_steps]
