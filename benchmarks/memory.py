"""5. Order memory: peak resident memory added by building the epoch's order and the first batch, against N.

Ours evaluates a keyed permutation at the positions it needs, so the added peak should stay under 1 MB at any N;
`torch.randperm(N)` (what DataLoader and StatefulDataLoader shuffle with) holds 8 bytes per sample. Each point
runs in a fresh process (`python -m benchmarks.memory KIND N`): one process's peak says nothing about the next.
The peak is reset after imports and a small warm-up (Linux /proc/self/clear_refs), so only the work is counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.config import Config
from benchmarks.progress import say
from benchmarks.rows import count, row, single

KINDS = ("ResumableDataLoader", "torch.randperm")
TARGET = "< 1"  # MB added by our order, at every N
_STATUS = "/proc/self/status"
_ROOT = Path(__file__).resolve().parent.parent  # where `python -m benchmarks.memory` finds the package


def kib(field: str) -> int:
    with open(_STATUS) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> str:
    """Make the peak RSS the current RSS; return how peaks are read, for the record."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return "VmHWM after clear_refs"
    except OSError:
        return "VmHWM growth (peak not resettable: an earlier, higher peak hides smaller work)"


def _work(kind: str, n: int) -> None:
    """Build the order of an N-sample epoch and take its first batch, the way each side does it."""
    if kind == "torch.randperm":
        import torch

        torch.randperm(n)[:64].tolist()
        return
    from benchmarks.datasets import IndexDataset
    from benchmarks.loaders import ours

    next(iter(ours(IndexDataset(n), batch_size=64, shuffle=True)))


def probe(kind: str, n: int) -> dict:
    """Runs in the child: the peak RSS the work adds, in bytes, and its seconds."""
    _work(kind, 1000)  # lazy imports and first-call allocations are not the order's
    return peak_added(lambda: _work(kind, n))


def peak_added(work: Callable[[], object]) -> dict:
    """The peak RSS that work() adds, in bytes, and its seconds (the peak reset first, where Linux allows)."""
    method = reset_peak()
    before = kib("VmHWM")
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    return {"added_bytes": (kib("VmHWM") - before) * 1024, "seconds": seconds, "method": method}


def in_child(module: str, args: list[str], timeout_s: float) -> dict:
    """`python -m module *args` in a fresh process: the JSON it prints last, or {"timed_out_s"} for a child run
    past the timeout (killed and reaped by subprocess.run)."""
    command = [sys.executable, "-m", module, *args]
    try:
        done = subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"timed_out_s": timeout_s}
    if done.returncode:
        raise RuntimeError(f"memory probe {' '.join(args)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(kind: str, n: int, timeout_s: float) -> dict:
    """One point in a fresh process; a point that runs past the timeout is killed and recorded as such."""
    point = {"n": n, **in_child("benchmarks.memory", [kind, str(n)], timeout_s)}
    if "timed_out_s" in point:
        return point
    say("memory", f"{kind} N={count(n)}: +{point['added_bytes'] / 1e6:.2f} MB in {point['seconds']:.2f} s")
    return point


def run(cfg: Config) -> dict:
    if not sys.platform.startswith("linux"):
        return {"skipped": "needs Linux /proc/self/status to read the peak RSS", "rows": []}
    caps = {"ResumableDataLoader": max(cfg.memory_sizes), "torch.randperm": cfg.randperm_cap}
    points = {
        kind: [_measure(kind, n, cfg.memory_timeout_s) for n in cfg.memory_sizes if n <= caps[kind]] for kind in KINDS
    }
    rows = [
        row(
            f"{kind} N={count(p['n'])}",
            single(p["added_bytes"]),
            "MB",
            TARGET if kind == KINDS[0] else None,
            scale=1e-6,
        )
        for kind in KINDS
        for p in points[kind]
        if "added_bytes" in p
    ]
    return {"points": points, "randperm_cap": cfg.randperm_cap, "rows": rows}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], int(sys.argv[2]))))
