"""Keep freed memory in the process: big blocks that are freed and allocated again every step.

A training step frees and allocates the same large arrays every step
(activations, their gradients, a pipeline's in-flight micro-batches), and a
gRPC transfer a ~1 MiB bytes object per message. With glibc's defaults a
block that size is served by mmap (M_MMAP_THRESHOLD starts at 128 KiB and only
adapts upwards as such blocks are freed) and free memory at the top of the
heap beyond M_TRIM_THRESHOLD goes back to the kernel, so the next step
touches new pages: a minor page fault per 4 KiB, paid again every step
(README has the measured rates). Fixing the thresholds as below has the
effect of GLIBC_TUNABLES=glibc.malloc.trim_threshold=...:glibc.malloc.
mmap_threshold=.... Further, glibc gives threads arenas of their own whose
heaps (64 MiB at most) are unmapped whole once empty; with several 64 MB
pushes in flight their messages spread over several such heaps, each
refaulted on every round; one arena (M_ARENA_MAX = 1) keeps them in one
heap. The price is that a process keeps the memory of its largest step
mapped after it ends: for a trainer, a daemon and a worker that repeat the
same step, that is the point.

Elsewhere than glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc <malloc.h>
TRIM_THRESHOLD = 1 << 30  # return free heap-top memory to the kernel only beyond 1 GiB
MMAP_THRESHOLD = 32 << 20  # mmap only blocks of 32 MiB and more (glibc's maximum)


def keep_freed_memory() -> bool:
    """One malloc arena with fixed trim and mmap thresholds; False where there is no glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and
              mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_ARENA_MAX, 1))
    log.debug("malloc thresholds fixed: %s", ok)
    return ok
