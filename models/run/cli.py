"""How every entry point starts and ends: its name as the user typed it, and
`run_cli`, which turns a bad config, a user error or Ctrl-C into one line
and an exit status (2, 1, 130) instead of a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from dtlab.models.config import ConfigError
from dtlab.models.run.launcher import who


def command_name(module: str = "") -> str:
    """How the user started this program: "python -m MODULE", a console script's name
    ("dtlab-train"), or "python" and the script's path; for usage lines and messages."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    if not argv0.endswith(".py"):
        return os.path.basename(argv0)
    return f"python -m {module}" if module else f"python {argv0}"


def run_cli(main: Callable[[list[str]], int], prog: str = "", argv: list[str] | None = None,
            user_errors: tuple[type[BaseException], ...] = (),
            describe: Callable[[BaseException], str] = str) -> int:
    """Run an entry point called `prog` (the command the user typed).

    A bad config prints `PROG: error: ...` and returns 2; any of `user_errors`
    (a corrupt checkpoint, a diverged run, a server's refusal) prints
    `describe(error)` the same way and returns 1; Ctrl-C prints one line and
    returns 130. None shows a traceback: the message names the problem. Under
    a launcher of several processes each line names the rank it comes from.
    """
    prog, rank = prog or command_name(), who()
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except ConfigError as e:
        _say(f"{prog}: {rank}error: {e}")
        return 2
    except user_errors as e:
        _say(f"{prog}: {rank}error: {describe(e)}")
        return 1
    except KeyboardInterrupt:
        _say(f"{prog}: {rank}interrupted")
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _say(line: str) -> None:
    """One write per line, so that lines of several ranks merged by mpiexec stay whole."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
