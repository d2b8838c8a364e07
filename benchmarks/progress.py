"""One stderr line per measurement, so a long run shows where it is (no tqdm dependency)."""

from __future__ import annotations

import sys
import time

_START = time.perf_counter()


def say(section: str, message: str) -> None:
    """Print `[  12.3s] section: message` on stderr, flushed at once."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {section}: {message}", file=sys.stderr, flush=True)
