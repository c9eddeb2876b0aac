"""Only the optional C kernels live here; everything else is in setup.cfg.

Both are built when a C compiler is at hand; `optional=True` lets the
install go on without them, and the Python code then runs its NumPy twin:

- pserver/common/_kernels.c: one-pass copy, Adler-32 and finiteness checks for the
  parameter server's streams (pserver.common.codec falls back to ISA-L and NumPy).
- models/_fused.c: one-pass optimizer updates and GELU / LayerNorm passes,
  bit-identical to the NumPy lines of models/optim.py and models/layers.py,
  which it falls back to. -ffp-contract=off keeps
  the compiler from fusing a multiply and an add into one rounding;
  -fno-math-errno lets it vectorize sqrt (its results are unchanged).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("dtlab.pserver.common._kernels", ["pserver/common/_kernels.c"],
              extra_compile_args=["-O3"], optional=True),
    Extension("dtlab.models._fused", ["models/_fused.c"],
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"], optional=True),
])
