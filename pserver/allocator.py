"""Memory for bulk transfers: keep freed memory in the process; huge pages for parameters.

gRPC hands every received ~1 MiB message to Python as a new bytes object,
and the sender builds one per message too. With glibc's defaults a block
that size is served by mmap (M_MMAP_THRESHOLD starts at 128 KiB and only
adapts upwards as such blocks are freed) and free memory at the top of the
heap beyond M_TRIM_THRESHOLD goes back to the kernel, so the next transfer
touches new pages: a minor page fault per 4 KiB received, which slows the
plain gRPC stream itself (README has the measured rates). Fixing the
thresholds as below has the effect of GLIBC_TUNABLES=glibc.malloc.
trim_threshold=...:glibc.malloc.mmap_threshold=.... Further, glibc gives
threads arenas of their own whose heaps (64 MiB at most) are unmapped whole
once empty; with several 64 MB pushes in flight their messages spread over
several such heaps, each refaulted on every round; one arena (M_ARENA_MAX =
1) keeps them in one heap. The price is that a
process keeps the memory of its largest transfers mapped after they end:
for a daemon and a worker that repeat the same transfers, that is the point.

Elsewhere than glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import numpy as np

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


MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
HUGE_PAGE = 2 << 20


def huge_empty(n: int, dtype) -> np.ndarray:
    """An uninitialised 1-D array on 2 MiB transparent huge pages, where the kernel gives them.

    Machines that set transparent huge pages to `madvise` give them only to
    memory that asks: a shard's 64 MB parameters on 4 KiB pages cost the
    optimizer and the pulls a TLB miss, and the hardware prefetcher a
    restart, every 4 KiB (README has the measured gain). Elsewhere (no
    madvise, another OS) this is np.empty.
    """
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    try:
        madvise = ctypes.CDLL(None).madvise
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError):
        return np.empty(n, dtype)
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    raw = np.frombuffer(region, np.uint8)  # keeps `region` alive as long as any view of it
    skip = (-raw.ctypes.data) % HUGE_PAGE
    if madvise(raw.ctypes.data + skip, nbytes, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused; 4 KiB pages")
    return raw[skip : skip + nbytes].view(dtype)
