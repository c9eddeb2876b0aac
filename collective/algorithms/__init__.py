"""Our all-reduces and their relatives over MPI point-to-point: the ring, halving-doubling,
recursive doubling, the shared-memory paths, the naive and tree baselines, all-to-all, the
quantized ring, and the chooser that picks one by size, N and node."""
