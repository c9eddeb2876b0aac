"""Device (CuPy) buffers and MPI: hand them over directly when MPI is
GPU-aware, stage them through host memory when it is not.

A device array is anything exposing `__cuda_array_interface__` that is not
a NumPy array (CuPy, or the host-backed stand-in the tests use, as mpi4py's
own test suite does). mpi4py reads the device pointer from that interface,
so with a GPU-aware MPI (MPICH built with CUDA and MPIR_CVAR_ENABLE_GPU=1,
Open MPI with UCX/CUDA, MVAPICH2-GDR, Cray MPICH with
MPICH_GPU_SUPPORT_ENABLED=1) the ring adds on the GPU and sends device
memory. Otherwise the flat buffer is copied to a pooled host buffer
(`.get(out=...)`), reduced there, and copied back (`.set(...)`).

Whether MPI is GPU-aware is decided once per process:
  DTLAB_GPU_AWARE_MPI=1 / 0   forces the answer (e.g. a library that supports
                              CUDA but has no query function);
  otherwise MPIX_Query_cuda_support() of the loaded libmpi (MPICH >= 4,
  Open MPI >= 4; it honours MPIR_CVAR_ENABLE_GPU), found with ctypes;
  otherwise False (staging is always correct, only slower).

Before MPI touches device memory the CuPy stream is synchronised
(`models.backend.synchronize()`), since kernels that produced the data may
still be queued. The comm thread of the bucket reducer synchronises the
legacy default stream, which CuPy uses unless told otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from dtlab.collective.transport.scratch import Workspace
from dtlab.models import backend

AWARE_ENV = "DTLAB_GPU_AWARE_MPI"


def is_device_array(a) -> bool:
    return backend.is_device_array(a)


def _loaded_libmpi() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def libmpi_cuda_support() -> bool | None:
    """MPIX_Query_cuda_support() of the loaded libmpi; None if it has none."""
    path = _loaded_libmpi()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())


@functools.cache
def mpi_is_gpu_aware() -> bool:
    """Can MPI read and write CUDA device memory? (cached per process)"""
    forced = os.environ.get(AWARE_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{AWARE_ENV} must be 0 or 1, not {forced!r}")
    return bool(libmpi_cuda_support())


def place(flat, ws: Workspace, key: str, *, copy_in: bool = True):
    """Put the 1-D array `flat` where MPI can use it (see module docstring).

    Returns (buf, xp, sync, device): run the collective on `buf` with array
    namespace `xp`, calling `sync` (if not None) before MPI reads device
    memory; `device` is the array to copy `buf` back to (a host stage), or None.
    """
    if not is_device_array(flat):
        return flat, np, None, None
    if mpi_is_gpu_aware():
        return flat, backend.array_module(flat), backend.synchronize, None
    host = ws.typed(key, flat.size, flat.dtype)  # (L,) pooled host stage
    if copy_in:
        flat.get(out=host)
    return host, np, None, flat


def unplace(buf, device, lo: int = 0, hi: int | None = None) -> None:
    """Copy elements [lo, hi) of a host stage `buf` back to `device` (if any)."""
    if device is not None:
        hi = buf.size if hi is None else hi
        device[lo:hi].set(buf[lo:hi])
