"""Each system's samples in its own format, written once per (kind, N) under one directory and reused by every
measurement; a write predicted (from the system's measured rate) to run past the budget is not started."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.peers.phase import Peer, error_text
from benchmarks.progress import say
from benchmarks.rows import count


class TooSlowToWrite(RuntimeError):
    """The samples would take longer to write in this system's format than the budget allows."""


def why_not(err: Exception) -> str:
    """Why a measurement was not made: the budget's reason, or the error."""
    return str(err) if isinstance(err, TooSlowToWrite) else error_text(err)


class Store:
    def __init__(self, root: Path, budget_s: float):
        self.root, self.budget_s = root, budget_s
        self.per_sample_s: dict[str, float] = {}
        self.written: dict[tuple[str, str, int], Path] = {}

    def data(self, key: str, peer: Peer, n: int, kind: str = "index") -> Path:
        """Where `peer`'s n samples of `kind` are, written now unless they already are."""
        if (key, kind, n) in self.written:
            return self.written[(key, kind, n)]
        predicted = self.per_sample_s.get(key, 0.0) * n
        if predicted > self.budget_s:
            raise TooSlowToWrite(f"writing {count(n)} samples predicted {predicted:.0f} s > {self.budget_s:.0f} s")
        path = self.root / f"{key}-{kind}-{n}"
        start = time.perf_counter()
        peer.prepare(n, path, kind)
        seconds = time.perf_counter() - start
        self.per_sample_s[key] = max(self.per_sample_s.get(key, 0.0), seconds / n)
        if seconds > 1:
            say("peers", f"{key}: wrote {count(n)} {kind} samples in {seconds:.1f} s")
        self.written[(key, kind, n)] = path
        return path
