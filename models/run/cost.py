"""`dtlab-cost`: print what one training step of a model costs (models/cost.py).

    dtlab-cost --model transformer --vocab 50257 --seq-len 1024 \\
        --d-model 1024 --n-heads 16 --n-layers 24 --d-ff 4096 --batch-size 8
    dtlab-cost --model mlp --json
"""

from __future__ import annotations

import argparse
import json
import sys

from dtlab.models.config import add_flags, from_namespace
from dtlab.models.cost import OPTIMIZER_STATES, estimate
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.zoo import MODELS, config_class


def main(argv: list[str]) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", choices=sorted(MODELS), default="transformer",
                     help="which model (default: transformer)")
    model = pre.parse_known_args(argv)[0].model
    parser = argparse.ArgumentParser(prog=command_name("dtlab.models.run.cost"),
                                     description=__doc__.split("\n")[0], parents=[pre])
    parser.add_argument("--batch-size", type=int, default=8, help="samples per step (default: 8)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw",
                        help="decides the optimizer-state bytes (default: adamw)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    add_flags(parser, config_class(model), f"{model} config")
    args = parser.parse_args(argv)
    cost = estimate(model, from_namespace(config_class(model), args), args.batch_size,
                    args.optimizer)
    print(json.dumps(cost.as_dict(), indent=1) if args.json else cost.table())
    return 0


def cli() -> int:
    return run_cli(main, command_name("dtlab.models.run.cost"))


if __name__ == "__main__":
    sys.exit(cli())
