"""The lab: the comparison of sync and async training (`dtlab-compare`), the
cost model that predicts it at scale (`dtlab-simulate`), and the benchmarks
(`dtlab-bench`). It imports the package and is never imported by it."""

import dtlab.models  # noqa: F401 - first: its BLAS thread setting must precede NumPy's import
