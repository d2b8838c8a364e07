"""CPU time of a process's descendants, read from Linux /proc with the standard library alone: the cold-start
child (`benchmarks.first_batch`) imports nothing else before it times its own imports."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def descendants() -> dict[int, float]:
    """CPU seconds so far of every process descended from this one, by pid (Linux /proc; empty elsewhere)."""
    parents, cpu = {}, {}
    for entry in [e for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
            continue  # not a process, or one that just ended
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICKS
    found, frontier = {}, [os.getpid()]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found.update((pid, cpu[pid]) for pid in frontier)
    return found
