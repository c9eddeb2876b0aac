"""The gradient bucket's default size, in a module that needs no MPI, so that the cost
model (scripts/lab/simulate) reads the trainer's default without starting MPI."""

DEFAULT_BUCKET_BYTES = 25_000_000  # dtlab-sync --bucket-mb 25 (MB: 1e6 bytes)
