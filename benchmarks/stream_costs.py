"""Where a stream's per-batch cost goes with workers (issue #11): CPU microseconds per batch of the workers' main
threads (reading, batching, the snapshot), their queue feeder threads (pickling) and the main process (unpickling,
delivery, state_dict), for DataLoader and our loader, and for our loader with parts of its snapshot taken out.

    python -m benchmarks.stream_costs [--reps 15] [--batches 600] [--workers 2] [--draw]

CPU time, not wall time: with more processes than CPUs the scheduler sets the wall time's spread, while the CPU a
batch costs stays put. Candidates run interleaved, in a seeded order per round; the table shows medians over rounds
and the median of the per-round differences to DataLoader. The ablations (`-rng`: no random-state check, `-snapshot`:
a constant snapshot) give states that resume wrongly: they are measurements only. `--draw`: every record draws one
torch, numpy and random number (an augmenting stream), so every snapshot carries a new random state.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader

import loader.streams.rng as rng
import loader.streams.source as stream_source
from benchmarks.datasets import FeatureStream, _Rows
from benchmarks.loaders import ours

_SNAPSHOT, _CHECK = stream_source._Batches.snapshot, rng.RngWatch.state
_CONSTANT = (0, False, None, {"i": 0}, None, "")  # a snapshot (see loader.streams.state.BATCHES)


class _DrawingRows(_Rows):
    def __next__(self):
        row = super().__next__()
        torch.rand(()), np.random.rand(), random.random()
        return row


class DrawingStream(FeatureStream):
    """FeatureStream drawing one number of each generator per record."""

    def __iter__(self) -> _DrawingRows:
        rows = super().__iter__()
        return _DrawingRows(rows.rows, rows.indices.start, rows.indices.step)


def _ablated(part: str | None) -> Callable[..., DataLoader]:
    """Our loader with `part` of the snapshot taken out (set before the workers fork, which copy it)."""

    def make(dataset, **kwargs) -> DataLoader:
        stream_source._Batches.snapshot, rng.RngWatch.state = _SNAPSHOT, _CHECK
        if part == "rng":
            rng.RngWatch.state = lambda self: _CHECK(self) if self._raw is None else rng.UNCHANGED
        elif part == "snapshot":
            stream_source._Batches.snapshot = lambda self, ended: (
                _SNAPSHOT(self, ended) if ended or self.count < 2 else _CONSTANT
            )
        return ours(dataset, **kwargs)

    return make


CANDIDATES = {
    "DataLoader": DataLoader,
    "ours": _ablated(None),
    "ours-rng": _ablated("rng"),
    "ours-snapshot": _ablated("snapshot"),
}


def _thread_ns(pids: list[int]) -> np.ndarray:
    """CPU ns so far of the workers' main threads and of their other threads (the queue feeders)."""
    main = other = 0
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    ns = int(f.read().split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
            main, other = (main + ns, other) if int(task) == pid else (main, other + ns)
    return np.array([main, other])


def per_batch(make: Callable[..., DataLoader], dataset, checkpoint: bool, **kwargs) -> np.ndarray:
    """CPU us per batch (worker main threads, feeders, main process) of a pass after each worker's first batch."""
    loader = make(dataset, **kwargs)
    batches = iter(loader)
    pids = [w.pid for w in getattr(batches, "_inner", batches)._workers]
    for _ in range(loader.num_workers):
        next(batches)
    start, count = np.append(_thread_ns(pids), time.process_time_ns()), 0
    while True:
        now = np.append(_thread_ns(pids), time.process_time_ns())  # before the last next() joins the workers
        try:
            next(batches)
        except StopIteration:
            break
        count += 1
        if checkpoint and hasattr(loader, "state_dict"):
            loader.state_dict()
    return (now - start) / 1e3 / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--draw", action="store_true")
    parser.add_argument("--state-dict", action="store_true", help="a state_dict() after every batch")
    args = parser.parse_args()
    dataset = (DrawingStream if args.draw else FeatureStream)(64 * args.batches, 64)
    samples: dict[str, list] = {name: [] for name in CANDIDATES}
    order = np.random.default_rng(0)
    for round_ in range(args.reps + 1):  # the first round warms up
        for name in order.permutation(list(CANDIDATES)).tolist():
            gc.disable()
            try:
                value = per_batch(CANDIDATES[name], dataset, args.state_dict, batch_size=64, num_workers=args.workers)
            finally:
                gc.enable()
            if round_:
                samples[name].append(value)
    base = np.array(samples["DataLoader"])
    print("CPU us per batch: worker main threads | feeders | main process ; median difference to DataLoader")
    for name, values in samples.items():
        values = np.array(values)
        median, difference = np.median(values, axis=0), np.median(values - base, axis=0)
        print(
            f"{name:14s} "
            + " | ".join(f"{m:7.1f}" for m in median)
            + " ; "
            + " | ".join(f"{d:+6.1f}" for d in difference)
            + f" ; total {difference.sum():+6.1f}"
        )


if __name__ == "__main__":
    main()
