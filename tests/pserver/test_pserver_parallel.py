"""The thread helper that splits work into contiguous groups, and the allocator settings."""

from __future__ import annotations

import platform
import threading

import numpy as np
import pytest

from dtlab.models.run.allocator import keep_freed_memory
from dtlab.pserver.server.allocator import HUGE_PAGE, huge_empty
from dtlab.pserver.server.thread_pool import Parallel


@pytest.mark.parametrize("threads, n", [(1, 5), (2, 5), (3, 2), (4, 0), (3, 10)])
def test_groups_are_contiguous_balanced_and_in_order(threads, n):
    parallel = Parallel(threads)
    groups = parallel.groups(range(n))
    assert [i for g in groups for i in g] == list(range(n))
    assert len(groups) == max(1, min(threads, n))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1
    ran_on = {}  # group index -> name of the thread that ran it

    def work(g):
        ran_on[groups.index(g)] = threading.current_thread().name
        return sum(g)

    assert parallel.run(work, groups) == [sum(g) for g in groups]
    assert sorted(ran_on) == list(range(len(groups)))  # every group ran once
    caller = threading.current_thread().name
    assert ran_on[0] == caller  # the caller runs the first group itself
    assert all(name.startswith("parallel") and name != caller  # the rest on the pool
               for i, name in ran_on.items() if i > 0)
    parallel.close()


def test_an_error_in_a_group_reaches_the_caller():
    parallel = Parallel(2)

    def fail(group):
        if 3 in group:
            raise ValueError("group with 3")
        return len(group)

    with pytest.raises(ValueError, match="group with 3"):
        parallel.run(fail, parallel.groups(range(4)))
    with pytest.raises(ValueError, match="3 groups for 2 threads"):
        parallel.run(fail, [[0], [1], [2]])
    parallel.close()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_malloc_thresholds_can_be_fixed_twice():
    assert keep_freed_memory() is keep_freed_memory() is True


def test_huge_page_arrays_are_ordinary_arrays():
    a = huge_empty(3 * HUGE_PAGE // 8 + 5, np.float64)
    assert a.shape == (3 * HUGE_PAGE // 8 + 5,) and a.dtype == np.float64 and a.flags.writeable
    if platform.system() == "Linux":
        assert a.ctypes.data % HUGE_PAGE == 0
    a[...] = np.arange(a.size)
    b = a[-3:]
    del a  # the mapping lives as long as a view of it does
    np.testing.assert_array_equal(b, [b[0], b[0] + 1, b[0] + 2])
