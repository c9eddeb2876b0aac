"""`python -m dtlab.lab.simulate`: the same as `dtlab-simulate`."""

from dtlab.lab.simulate.cli import cli

cli()
