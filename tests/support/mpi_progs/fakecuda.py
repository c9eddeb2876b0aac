"""Host memory dressed up as a CUDA device array, to test the GPU code path
without a GPU (mpi4py's own test suite does the same with its `CAIBuf`).

`FakeDeviceArray` exposes only `__cuda_array_interface__` to MPI (no buffer
protocol), so mpi4py takes the device-pointer route; it refuses implicit
conversion to NumPy like CuPy (`np.asarray(x)` raises), supports the CuPy
calls the staging path uses (`get(out=)`, `set()`), and takes part in NumPy
ufuncs through `__array_ufunc__` the way CuPy arrays do. `get`/`set` calls
are counted so a test can tell staging from direct device access.
"""

from __future__ import annotations

import numpy as np


def _host(v):
    return v._a if isinstance(v, FakeDeviceArray) else v


class FakeDeviceArray:
    gets = 0
    sets = 0

    def __init__(self, host: np.ndarray):
        self._a = host

    @classmethod
    def of(cls, values) -> FakeDeviceArray:
        return cls(np.ascontiguousarray(values))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "version": 3,
            "shape": self._a.shape,
            "typestr": self._a.dtype.str,
            "data": (self._a.ctypes.data, False),
            "strides": None if self._a.flags.c_contiguous else self._a.strides,
        }

    def __array__(self, *args, **kwargs):
        raise TypeError("implicit conversion of a device array to NumPy; use .get()")

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if out is not None:
            kwargs["out"] = tuple(_host(o) for o in out)
        result = getattr(ufunc, method)(*(_host(i) for i in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return FakeDeviceArray(result)

    def __getitem__(self, key) -> FakeDeviceArray:
        return FakeDeviceArray(self._a[key])

    def __setitem__(self, key, value) -> None:
        if isinstance(value, np.ndarray):
            raise TypeError("implicit host-to-device copy; use .set()")
        self._a[key] = _host(value)

    def reshape(self, *shape) -> FakeDeviceArray:
        return FakeDeviceArray(self._a.reshape(*shape))

    def get(self, out=None) -> np.ndarray:
        FakeDeviceArray.gets += 1
        if out is None:
            return self._a.copy()
        out[...] = self._a
        return out

    def set(self, values: np.ndarray) -> None:
        FakeDeviceArray.sets += 1
        self._a[...] = values

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
