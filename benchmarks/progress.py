"""Progress while the suite runs: a line per measurement and per section on stderr, and a tqdm bar per comparison.

tqdm draws the bar only on a terminal (`disable=None`); in a log (CI, `| tee`) it draws nothing and the lines stay,
one per measurement. Lines go through `tqdm.write`, so they scroll above a live bar instead of breaking it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

_START = time.perf_counter()


def say(section: str, message: str) -> None:
    """`[  12.3s] section: message` on stderr."""
    tqdm.write(f"[{time.perf_counter() - _START:7.1f}s] {section}: {message}", file=sys.stderr)


@contextmanager
def progress_bar(section: str, total: int) -> Iterator[tqdm]:
    """A bar of `total` steps for one comparison, on a terminal only; removed when it is done."""
    with tqdm(total=total, desc=section, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True) as bar:
        yield bar
