"""Regenerate `cupy_names.json`: the names CuPy exports, read from the `cupy` package itself.

The strict array namespace (`strict_xp.py`) offers exactly these names, so a call
CuPy lacks fails on the CPU. CuPy imports without a GPU, so any machine can do it:

    pip download --no-deps -d /tmp/cupy cupy-cuda12x
    python -m venv /tmp/cupyvenv && /tmp/cupyvenv/bin/pip install /tmp/cupy/cupy_cuda12x-*.whl
    /tmp/cupyvenv/bin/python tests/support/cupy_names.py   # rewrites cupy_names.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("cupy_names.json")


def public(obj) -> list[str]:
    return sorted(n for n in dir(obj) if not n.startswith("_"))


def names() -> dict:
    import cupy  # this script's whole job is to read CuPy's names
    import numpy as np

    top = public(cupy)
    return {
        "cupy_version": cupy.__version__,
        "numpy_version_read_with": np.__version__,
        "functions": [n for n in top if callable(getattr(cupy, n))
                      and not isinstance(getattr(cupy, n), (cupy.ufunc, type))],
        "ufuncs": [n for n in top if isinstance(getattr(cupy, n), cupy.ufunc)],
        "ufunc_methods": public(cupy.ufunc),
        # ufunc.at exists on every ufunc but runs only where CuPy has a scatter kernel
        "ufunc_at": [n for n in top if isinstance(getattr(cupy, n), cupy.ufunc)
                     and getattr(getattr(cupy, n), "_scatter_op", None) is not None],
        "dtypes": [n for n in top if isinstance(getattr(cupy, n), type)
                   and issubclass(getattr(cupy, n), np.generic)],
        "constants": [n for n in top if isinstance(getattr(cupy, n), (int, float))],
        "ndarray": sorted(n for n in dir(cupy.ndarray) if not n.startswith("_")
                          or n in ("__bool__", "__int__", "__float__", "__complex__",
                                   "__index__", "__len__", "__iter__", "__matmul__")),
        "linalg": public(cupy.linalg),
        "random": public(cupy.random),
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(names(), indent=1) + "\n")
    sys.stdout.write(f"wrote {OUT}\n")
