"""Progress reporting: a redrawn bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, every: int, enabled: bool = True, stream=None,
                 prefix: str = ""):
        """`prefix` names the process in its lines ("worker 3: ") when several print."""
        self.total, self.every, self.enabled, self.prefix = total, every, enabled, prefix
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def update(self, step: int, loss: float, extra: str = "") -> None:
        if not self.enabled:
            return
        done = step + 1
        text = f"{self.prefix}step {done:>6}/{self.total}  loss {loss:8.4f}  {extra}"
        if self.tty:
            width = 24
            filled = width * done // self.total
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {text}")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.total or step == 0:
            print(text, file=self.stream, flush=True)
