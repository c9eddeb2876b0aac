"""Log lines that name the worker ("worker 3: ..."), so that the lines of several workers
on one console tell who said them."""

from __future__ import annotations

import logging


class WorkerName(logging.Filter):
    """Puts `who` ("worker 3", or "worker" before the servers assigned the id) on every
    log record."""

    def __init__(self):
        super().__init__()
        self.who = "worker"

    def filter(self, record: logging.LogRecord) -> bool:
        record.who = self.who
        return True


def start_logging() -> WorkerName:
    """The process's log lines at INFO, each naming the worker; the name to set once known."""
    handler = logging.StreamHandler()
    name = WorkerName()
    handler.addFilter(name)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(who)s: %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    return name
