"""PauseWatch (pserver/server/replication/pauses.py) on a real pause: a child process that
runs one is SIGSTOPped, and afterwards it says it did not run all along since before the
pause, but did since shortly after it; with no pause it did."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dtlab.pserver.server.replication.pauses import PauseWatch

CHILD = """
import sys, time
from dtlab.pserver.server.replication.pauses import PauseWatch
watch = PauseWatch(0.02, 0.1)
watch.start()
start = time.monotonic()
for _ in sys.stdin:  # each line: ran since the start? since 0.05 s ago?
    print(watch.ran_since(start), watch.ran_since(time.monotonic() - 0.05), flush=True)
"""


def test_a_pause_is_seen_and_running_all_along_is_not_taken_for_one():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        def ask() -> str:
            child.stdin.write("?\n")
            child.stdin.flush()
            return child.stdout.readline().strip()

        time.sleep(0.3)
        assert ask() == "True True"  # ticking all along
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.4)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.2)  # ticks again: awake since the first tick after the pause
        assert ask() == "False True"
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(timeout=10)


def test_a_watch_that_ticks_slower_than_a_pause_is_refused():
    with pytest.raises(ValueError, match="ticks more often than a pause lasts"):
        PauseWatch(0.5, 0.5)
