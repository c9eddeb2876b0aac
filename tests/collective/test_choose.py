"""collective/algorithms/choose.py: which of our all-reduce algorithms runs, by size and world.

Pure arithmetic, no MPI: the order doubling -> shared memory (one-shot, then
two-shot) -> halving-doubling or the ring as buffers grow, the node question
asked only where the answer matters, and the ring for worlds that are not a
power of two. The algorithms themselves are checked against direct sums in
tests/collective/test_ring.py.
"""

from __future__ import annotations

import pytest

from dtlab.collective.algorithms.choose import (
    ONE_SHOT_ADDED_BYTES,
    OURS,
    SHM_SEGMENT_BYTES,
    SMALL_BYTES,
    allreduce_algorithm,
)

SIZES = [1 << k for k in range(2, 27)]  # 4 B .. 64 MB


class Asked:
    """shared() with a fixed answer, counting how often it was asked."""

    def __init__(self, answer: bool):
        self.answer, self.count = answer, 0

    def __call__(self) -> bool:
        self.count += 1
        return self.answer


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_one_node_goes_doubling_shm_then_point_to_point(n):
    order = [allreduce_algorithm(s, n, Asked(True)) for s in SIZES]
    assert set(order) <= set(OURS)
    runs = [a for i, a in enumerate(order) if i == 0 or a != order[i - 1]]
    large = "halving" if n & (n - 1) == 0 else "ring"
    assert runs[0] == "doubling" and runs[-1] == large, order
    assert [a for a in runs if a.startswith("shm")] == ["shm-one-shot", "shm-two-shot"], order
    for s, a in zip(SIZES, order, strict=True):
        assert (a == "doubling") == (s <= SMALL_BYTES)
        assert (a == "shm-one-shot") == (SMALL_BYTES < s and (n - 1) * s <= ONE_SHOT_ADDED_BYTES)
        assert a.startswith("shm") == (SMALL_BYTES < s <= SHM_SEGMENT_BYTES * n)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_several_nodes_never_use_shared_memory_and_are_asked_only_for_mid_sizes(n):
    for s in SIZES:
        asked = Asked(False)
        a = allreduce_algorithm(s, n, asked)
        assert not a.startswith("shm"), (s, a)
        assert asked.count == (1 if SMALL_BYTES < s <= SHM_SEGMENT_BYTES * n else 0), s
