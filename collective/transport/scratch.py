"""Scratch memory of one communicator: a pool of buffers that only grows.

Allocating a receive buffer per call would page-fault it in on first touch
every time (what slows MPI libraries that malloc a temporary per collective
on large buffers), while a pool that only grows costs nothing after the
first call. One pool per communicator is safe without locks because MPI
requires collectives on one communicator to be issued one at a time; a
second thread (the bucket reducer) works on a duplicated communicator with
a pool of its own.
"""

from __future__ import annotations

import numpy as np

from dtlab.collective.transport.pages import PAGE, address, mirror


class Workspace:
    """Reusable byte buffers, keyed by purpose and array module; they only grow."""

    def __init__(self):
        self._bufs: dict[tuple[str, str], object] = {}
        self._last: dict[str, tuple] = {}

    def get(self, key: str, nbytes: int, xp=np):
        """A uint8 buffer of exactly `nbytes` (a view of a pooled one)."""
        slot = (key, xp.__name__)
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = xp.empty(max(nbytes, 1), dtype=np.uint8)
            self._bufs[slot] = buf
        return buf[:nbytes]

    def pages(self, key: str, nbytes: int, xp=np):
        """A pooled uint8 buffer of `nbytes` that starts on a page boundary,
        to cut receive buffers from with `pages.mirror()`."""
        raw = self.get(key, nbytes + PAGE - 1, xp)
        skip = (-address(raw)) % PAGE
        return raw[skip : skip + nbytes]

    def typed(self, key: str, count: int, dtype, xp=np):
        """A pooled 1-D array of `count` elements of `dtype`.

        The last view per key is remembered: a training loop asks for the same
        shapes over and over, and this is on the small-message critical path.
        """
        last = self._last.get(key)
        if last is not None and last[0] == count and last[1] == dtype and last[2] is xp:
            return last[3]
        dtype = np.dtype(dtype)
        view = self.get(key, count * dtype.itemsize, xp).view(dtype)
        self._last[key] = (count, dtype, xp, view)
        return view

    def mirrored(self, key: str, like, xp=np):
        """A pooled 1-D array with the size and dtype of `like`, starting at the same
        offset within a page (pages.mirror)."""
        pages = self.pages(key, like.nbytes + PAGE, xp)
        return mirror(pages, 0, address(like), like.nbytes).view(like.dtype)
