"""The streams' per-byte work, from the fastest implementation at hand: the C
extension (pserver/common/_kernels.c: one pass, GIL released) where it was built,
else ISA-L's vectorised Adler-32 (zlib's values), else zlib's."""

from __future__ import annotations

try:  # one pass per chunk, GIL released (pserver/common/_kernels.c, built where a compiler was)
    from dtlab.pserver.common import _kernels
    from dtlab.pserver.common._kernels import adler32  # AVX2 where the CPU has it
except ImportError:
    _kernels = None
    try:  # ISA-L's Adler-32 gives zlib's values, vectorised
        from isal.isal_zlib import adler32
    except ImportError:
        from zlib import adler32

__all__ = ["_kernels", "adler32"]
