"""`python -m dtlab.pserver.worker`: the same as `dtlab-worker`."""

import sys

from dtlab.pserver.worker.loop import cli

sys.exit(cli())
