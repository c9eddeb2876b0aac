"""`python -m dtlab.lab.compare`: the same as `dtlab-compare`."""

from dtlab.lab.compare.cli import cli

cli()
