"""How every entry point starts and ends: its name as the user typed it, and
`run_cli`, which turns a bad config, a user error or Ctrl-C into one line
and an exit status (2, 1, 130) instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

from dtlab.models.config import ConfigError
from dtlab.models.run.launcher_env import who


def command_name(module: str = "") -> str:
    """How the user started this program: "python -m MODULE", a console script's name
    ("dtlab-train"), or "python" and the script's path; for usage lines and messages."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    if not argv0.endswith(".py"):
        return os.path.basename(argv0)
    return f"python -m {module}" if module else f"python {argv0}"


def run_cli(main: Callable[[list[str]], int], prog: str = "", argv: list[str] | None = None,
            user_errors: tuple[type[BaseException], ...] = (),
            describe: Callable[[BaseException], str] = str,
            on_failure: Callable[[int, str], None] | None = None) -> int:
    """Run an entry point called `prog` (the command the user typed).

    A bad config prints `PROG: error: ...` and returns 2; any of `user_errors`
    (a corrupt checkpoint, a diverged run, a server's refusal) prints
    `describe(error)` the same way and returns 1; Ctrl-C prints one line and
    returns 130. None shows a traceback: the message names the problem. Under
    a launcher of several processes each line names the rank it comes from.
    `on_failure(status, line)` runs after any failure's line is out, argparse's
    refusal of a flag included (its SystemExit goes on after): a program of a
    job ends the job's others there.
    """
    prog, rank = prog or command_name(), who()
    line = ""
    try:
        status = main(sys.argv[1:] if argv is None else argv) or 0
    except ConfigError as e:
        status, line = 2, f"{prog}: {rank}error: {e}"
    except user_errors as e:
        status, line = 1, f"{prog}: {rank}error: {describe(e)}"
    except KeyboardInterrupt:
        status, line = 130, f"{prog}: {rank}interrupted"
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except SystemExit as e:  # argparse printed its usage and `PROG: error: ...` line
        if on_failure is not None and e.code not in (None, 0):
            on_failure(e.code if isinstance(e.code, int) else 1, argparse_line(e, rank))
        raise
    except Exception as e:  # a bug: its traceback, then the job's others are ended
        if on_failure is None:
            raise
        traceback.print_exc()
        status, line = 1, f"{prog}: {rank}error: {type(e).__name__}: {e}"
        on_failure(status, line)
        return status
    if line:
        _say(line)
    if status and on_failure is not None:
        on_failure(status, line)
    return status


def argparse_line(error: SystemExit, rank: str) -> str:
    """The line argparse printed before it raised `error` (`PROG: error: MESSAGE`),
    rebuilt from its ArgumentParser.error call's message; else the exit status."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is argparse.ArgumentParser.error.__code__:
            local = tb.tb_frame.f_locals
            return f"{local['self'].prog}: {rank}error: {local['message']}"
        tb = tb.tb_next
    return f"{command_name()}: {rank}exit status {error.code}"


def _say(line: str) -> None:
    """One write per line, so that lines of several ranks merged by mpiexec stay whole."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
