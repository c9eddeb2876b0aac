"""Run one parameter-server shard daemon.

    python -m pserver serve --model mlp --d-hidden 64 --shard 0 --num-shards 2 \\
        --port 50051 --optimizer adam --lr 1e-3 --seed 0 --consistency ssp --staleness 2

`--model` and its flags, and the optimizer flags, are parsed by
models.session exactly as for the trainers (give the server the model flags
the workers' data implies, e.g. `--d-in 64 --n-classes 10` for
`--data digits`: Register refuses a worker whose parameter layout differs).
The server's own flags are pserver.config.ServerConfig; see
`python -m pserver serve --model NAME --help`. SIGTERM or SIGINT shuts down
cleanly (pserver.daemon.Daemon.shutdown) and exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from models.checkpoint import CheckpointError
from models.config import add_flags, from_namespace, run_cli
from models.session import parse
from models.threads import share_cores
from pserver.allocator import keep_freed_memory
from pserver.config import ServerConfig
from pserver.daemon import Daemon, build_store, config_record

USAGE = "usage: python -m pserver serve --model NAME [flags]  (--help for the flags)"


def serve(argv: list[str]) -> int:
    setup = parse(argv, prog="python -m pserver serve",
                  description="One gRPC parameter-server shard.", configs=("optim",),
                  add_extra=lambda p: add_flags(p, ServerConfig, "server"))
    cfg = from_namespace(ServerConfig, setup.extra)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_memory()
    # The daemon's work is the optimizer on its own thread pool (--apply-threads), no matmul.
    logging.getLogger("pserver").info("shard %d: %s", cfg.shard,
                                      share_cores(threads=1).describe())
    store = build_store(cfg, setup.model_name, setup.model, setup.optim)
    daemon = Daemon(cfg, store, config_record(cfg, setup.model_name, setup.model, setup.optim))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    daemon.start()
    stop.wait()
    daemon.shutdown()
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    return serve(argv[1:])


def cli() -> int:
    return run_cli(main, user_errors=(CheckpointError,))


if __name__ == "__main__":
    sys.exit(cli())
