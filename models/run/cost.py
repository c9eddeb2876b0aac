"""`dtlab-cost`: print what one training step of a model costs (models/cost.py).

    dtlab-cost --model transformer --vocab 50257 --seq-len 1024 \\
        --d-model 1024 --n-heads 16 --n-layers 24 --d-ff 4096 --batch-size 8
    dtlab-cost --model mlp --json
    dtlab-cost --model transformer --zero 3 --dp 64     # + ZeRO's bytes per rank and sent
"""

from __future__ import annotations

import argparse
import json
import sys

from dtlab.models.config import ConfigError, add_flags, from_namespace
from dtlab.models.cost import (
    OPTIMIZER_STATES,
    ZERO_STAGES,
    estimate,
    zero_memory,
    zero_table,
    zero_traffic,
)
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
    parser.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None,
                        help="also the bytes per rank and sent per step of this ZeRO stage "
                             "(and plain data parallelism's) over --dp ranks "
                             "(Rajbhandari et al. 2020)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel ranks for --zero (default: 1)")
    add_flags(parser, config_class(model), f"{model} config")
    args = parser.parse_args(argv)
    if args.dp is not None and args.zero is None:
        raise ConfigError(f"--dp {args.dp} has no effect without --zero")
    dp = 1 if args.dp is None else args.dp
    cost = estimate(model, from_namespace(config_class(model), args), args.batch_size,
                    args.optimizer)
    if args.zero is None:
        print(json.dumps(cost.as_dict(), indent=1) if args.json else cost.table())
        return 0
    stages = sorted({0, args.zero})
    if args.json:
        zero = {p: {s: {**zero_memory(cost.params_total, s, dp, p, args.optimizer),
                        "sent": zero_traffic(cost.params_total, s, dp, p)} for s in stages}
                for p in ("fp32", "bf16", "fp16")}
        print(json.dumps({**cost.as_dict(), "zero": {"stage": args.zero, "dp": dp,
                                                     "per_rank": zero}}, indent=1))
    else:
        print(cost.table() + "\n\n" + zero_table(cost.params_total, dp, args.optimizer, stages))
    return 0


def cli() -> int:
    return run_cli(main, command_name("dtlab.models.run.cost"))


if __name__ == "__main__":
    sys.exit(cli())
