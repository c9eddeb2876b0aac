"""scripts/bench_parallel.py's parts: the config-derived formulas and one mpiexec launch."""
