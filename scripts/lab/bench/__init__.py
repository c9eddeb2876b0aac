"""The lab's benchmarks: each measures its own baseline in the same run (MPI's
Allreduce, a plain gRPC stream, a matmul), prints an nccl-tests style table and
writes JSON; each also runs at a tiny size in the test suite."""
