"""Only the optional C kernels live here; everything else is in setup.cfg.

pserver/_kernels.c (one-pass copy, Adler-32 and finiteness checks for the
parameter server's streams) is built when a C compiler is at hand;
`optional=True` lets the install go on without it, and pserver.wire then
uses ISA-L and NumPy instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pserver._kernels", ["pserver/_kernels.c"],
                             extra_compile_args=["-O3"], optional=True)])
