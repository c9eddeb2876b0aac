"""Memory for bulk transfers: huge pages for a shard's parameters.

(Freed memory is kept in the process by models/run/allocator.py, which the
daemon and the workers call at start as every trainer does.)
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import numpy as np

log = logging.getLogger(__name__)

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
