"""Waiting on a condition, not on the clock: a test polls what it expects until it holds
or a generous deadline passes, so a loaded machine slows it down but cannot fail it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 30.0,
             every: float = 0.02) -> T:
    """Poll `check()` until it returns something truthy (returned), or fail after
    `timeout` seconds with an AssertionError that says `what` did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(every)
