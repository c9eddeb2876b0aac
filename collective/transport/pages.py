"""Receive buffers placed at the sender's offset within a page.

Within a node MPICH moves messages of 8 KiB and more by CMA
(process_vm_readv): the receiving rank's kernel copies the sender's pages
into its own with `rep movsb`. On some x86 cores that copy runs several
times slower when the destination lies a few bytes past the source modulo
4 KiB, the pattern of 4K aliasing (loads whose address matches a recent
store's in the low 12 bits wait for that store).
Scratch memory that malloc hands out right after the user's buffer sits 16
bytes past it, which is exactly that case. A receive buffer that starts at
the same offset within a page as the data sent into it makes the copy one
between equally aligned pages, as fast as the copy between two user buffers
(the sender's offset is taken to be ours: every rank allocates alike)
(figures: scripts/RESULTS.md).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

PAGE = 4096


def address(a) -> int:
    """Address of the first byte of a contiguous host or device array."""
    if isinstance(a, np.ndarray):
        return MPI.buffer(a).address
    return a.__cuda_array_interface__["data"][0]


def mirror(pages, start: int, like: int, nbytes: int):
    """`nbytes` of `pages` (uint8, page-aligned) from the first byte at or after
    `start` (a multiple of PAGE) whose offset within a page is that of the
    address `like`; the caller reserves PAGE bytes of slack per view."""
    at = start + like % PAGE
    return pages[at : at + nbytes]
