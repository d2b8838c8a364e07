"""Progress while the suite runs: a bar per comparison and a counter per section (no tqdm dependency).

On a terminal the bar redraws one line in place; in a log (CI, `| tee`) every update is its own line, so the log
keeps each measurement.
"""

from __future__ import annotations

import sys
import time

_START = time.perf_counter()
BAR_WIDTH = 20


def bar(done: int, total: int) -> str:
    """`[########------------] 8/20`"""
    filled = BAR_WIDTH * done // total
    return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {done}/{total}"


def say(section: str, message: str, done: int | None = None, total: int | None = None) -> None:
    """`[  12.3s] section: [bar] message` on stderr, flushed at once; the bar only when `total` is given."""
    progress = "" if total is None else bar(done or 0, total) + " "
    line = f"[{time.perf_counter() - _START:7.1f}s] {section}: {progress}{message}"
    if sys.stderr.isatty():
        unfinished = total is not None and (done or 0) < total
        print(f"\r\033[K{line}", end="" if unfinished else "\n", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)
