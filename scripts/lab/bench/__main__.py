"""`python -m dtlab.lab.bench NAME`: the same as `dtlab-bench NAME`."""

from dtlab.lab.bench.cli import cli

cli()
