"""`dtlab-bench NAME [ARGS]`: run one of the lab's benchmarks; `dtlab-bench --list` names them.

    dtlab-bench --list
    dtlab-bench allreduce --launches 5 --ranks 2,4       # medians over five mpiexec launches
    mpiexec -n 4 dtlab-bench allreduce --tiny            # one launch, as the suite runs it
    dtlab-bench pserver --tiny --json /tmp/ps.json

Each benchmark is also `python -m dtlab.lab.bench.NAME`; what its columns mean
is in scripts/README.md.
"""

from __future__ import annotations

import ast
import importlib.util
import runpy
import sys

# the benchmarks; moe_ep and together are also started by others under mpiexec
NAMES = ("allreduce", "fanout", "flight", "model", "moe", "moe_ep", "optim", "parallel",
         "pipedream", "precision", "pserver", "replication", "ring_steps", "sync", "threads",
         "together", "zero")


def summary(name: str) -> str:
    """The first line of a benchmark's docstring, read without importing it."""
    origin = importlib.util.find_spec(f"dtlab.lab.bench.{name}").origin
    with open(origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.split("\n")[0]


def cli() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help", "--list"):
        print(__doc__.split("\n")[0] if args[:1] != ["--list"] else "benchmarks:")
        for name in NAMES:
            print(f"  {name:<12} {summary(name)}")
        sys.exit(0 if args else 2)
    name, rest = args[0], args[1:]
    if name not in NAMES:
        sys.stderr.write(f"dtlab-bench: error: no benchmark {name!r} "
                         f"(dtlab-bench --list names them: {', '.join(NAMES)})\n")
        sys.exit(2)
    sys.argv = [f"dtlab-bench {name}", *rest]
    runpy.run_module(f"dtlab.lab.bench.{name}", run_name="__main__", alter_sys=True)
