"""The math of dtlab: arrays in, arrays out, no processes and no network.

Backend (NumPy or CuPy), flat parameters, layers with explicit forward and
backward passes, the dense models, loss, optimizers, data sources with known
loss floors and the FLOP/memory estimator. The machinery around a training
run (configs and --config files, the loop, metrics, checkpoints, threads)
is in models/run/; communication reaches models only through a communicator
object they are handed (see ARCHITECTURE.md).
"""
