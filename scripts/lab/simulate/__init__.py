"""dtlab-simulate: the alpha-beta-gamma cost model of training at scale, calibrated from
the benchmarks on a host and validated against measured comparisons. ARCHITECTURE.md
maps its modules."""
