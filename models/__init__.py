"""The math of dtlab: arrays in, arrays out, no processes and no network.

Backend (NumPy or CuPy), flat parameters, layers with explicit forward and
backward passes, the dense models, loss, optimizers, data sources with known
loss floors and the FLOP/memory estimator. The machinery around a training
run (configs and --config files, the loop, metrics, checkpoints, threads)
is in models/run/; communication reaches models only through a communicator
object they are handed (see ARCHITECTURE.md).
"""

import os

# Before NumPy loads its BLAS (dtlab-train imports this package first, the benchmarks
# through dtlab.lab.bench): OpenBLAS's idle threads spin 2^18 TSC cycles (about 0.1 ms)
# after a call before they sleep, instead of its default 2^28 (about 0.1 s). A spinning
# BLAS thread holds the core that the layers' passes and attention's heads run their
# second block on between the matmuls (layers.in_blocks, attention.over_heads), and that
# any other process or library on the host needs; the medium transformer's training
# step ran about 8% faster on 2 cores (dtlab-bench model). Too short a spin (2^4) wakes
# the threads for every small matmul: the small MLP's step ran 3x slower. A value the
# user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")
