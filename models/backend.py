"""The one place that chooses NumPy or CuPy.

    DTLAB_DEVICE=cpu   NumPy (the default when no GPU is visible)
    DTLAB_DEVICE=gpu   CuPy; an error if CuPy or a GPU is missing
    DTLAB_DEVICE=auto  CuPy if it imports and sees a GPU, else NumPy (default)

    DTLAB_ARRAY_MODULE=a.module   that module stands in for CuPy (gpu and auto pick
                                  it): the tests' CuPy-discipline check names
                                  `support.strict_xp`, arrays held to CuPy's rules
                                  computing with NumPy. Only tests set it.

No other module imports cupy. Array code asks `array_module(x)` for the
namespace of the arrays it was handed, so one function body serves both.
When several processes share a host, each takes GPU `local_rank % n_gpus`;
the node-local rank comes from the caller (collective/ knows it from MPI) or,
failing that, from the launcher's environment.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import numpy as np

_LOCAL_RANK_VARS = (
    "MPI_LOCALRANKID",  # MPICH / Hydra
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI
    "SLURM_LOCALID",  # srun
    "PMI_LOCAL_RANK",
    "LOCAL_RANK",
)


class DeviceError(RuntimeError):
    """The requested device cannot be used."""


_xp: ModuleType | None = None


ARRAY_MODULE_ENV = "DTLAB_ARRAY_MODULE"


def _import_cupy() -> ModuleType | None:
    stand_in = os.environ.get(ARRAY_MODULE_ENV)
    if stand_in:
        try:
            return importlib.import_module(stand_in)
        except ImportError as e:
            raise DeviceError(f"{ARRAY_MODULE_ENV}={stand_in} does not import: {e}") from e
    try:
        import cupy  # the only cupy import in dtlab

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # no cupy, no driver, no device: all mean "no GPU"
        return None


def local_rank_from_env() -> int:
    """The node-local rank the launcher advertises, 0 when launched alone."""
    for var in _LOCAL_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def select(device: str | None = None, local_rank: int | None = None) -> ModuleType:
    """Choose the array module once per process and return it.

    device: "cpu", "gpu" or "auto"; None reads DTLAB_DEVICE (default "auto").
    local_rank: picks the GPU when several processes share a host.
    """
    global _xp
    device = (device or os.environ.get("DTLAB_DEVICE") or "auto").lower()
    if device not in ("cpu", "gpu", "auto"):
        raise DeviceError(f"DTLAB_DEVICE must be cpu, gpu or auto, not {device!r}")
    if device == "cpu":
        _xp = np
        return _xp
    cupy = _import_cupy()
    if cupy is None:
        if device == "gpu":
            raise DeviceError(
                "DTLAB_DEVICE=gpu but no GPU is usable: install the 'gpu' extra "
                "(cupy-cuda12x) and check that a CUDA device is visible"
            )
        _xp = np
        return _xp
    rank = local_rank_from_env() if local_rank is None else local_rank
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    _xp = cupy
    return _xp


def xp() -> ModuleType:
    """The process's array module, chosen on first use."""
    return _xp if _xp is not None else select()


def on_gpu() -> bool:
    return xp() is not np


def array_module(a) -> ModuleType:
    """NumPy for host arrays, CuPy for device arrays."""
    if isinstance(a, np.ndarray) or np.isscalar(a):
        return np
    module = xp()
    if module is not np and isinstance(a, module.ndarray):
        return module
    return module if hasattr(a, "__cuda_array_interface__") else np


def is_device_array(a) -> bool:
    """An array of the device module, or anything else exposing `__cuda_array_interface__`."""
    if isinstance(a, np.ndarray):
        return False
    return hasattr(a, "__cuda_array_interface__") or array_module(a) is not np


def to_host(a) -> np.ndarray:
    """A NumPy array with the contents of `a` (no copy if already on host)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get"):
        return a.get()
    return np.asarray(a)


def synchronize() -> None:
    """Wait for queued GPU work; call before handing a device buffer to MPI."""
    if on_gpu():
        xp().cuda.get_current_stream().synchronize()


def device_name() -> str:
    if not on_gpu():
        return "cpu"
    cupy = xp()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
