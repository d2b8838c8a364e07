"""Token-budget batches: padding and batch count of `TokenBudgetBatches` (global length buckets) against an
unbounded-buffer best fit and a sorted-buffer batcher (fairseq's `max_tokens`, Lhotse's dynamic bucketing), on
synthetic lengths; the cost of a batch and of making the batches. `python -m benchmarks.budget [--samples N]`;
section 13 of `python -m benchmarks` (`benchmarks.features`) reports its table with the suite's.

`python -m benchmarks.budget --startup 1e6,1e7,1e8` measures a start: the seconds to construct
`TokenBudgetBatches(lengths.npy, 16384)` and the process's peak RSS, each in a fresh process, without a cache (every
start sorts the lengths), building the cache (the first start with `cache=`) and loading it (every later start:
the lengths' digest, the index's digest, nothing sorted), over int32 SFT-like lengths in a .npy (memory-mapped);
with `--keep`, of `PackedSource(documents, keep=mask.npy)` over that many computed documents (a 90% mask).

The budget counts a batch padded: count x longest <= max_tokens (a length 0 counts 1). Best fit, unbounded buffer:
all of the epoch's lengths sorted and cut greedily, the fewest batches any batcher makes (an optimal cut of sorted
lengths, and a batch of sorted neighbours pads least). Sorted buffer: the epoch's order in windows of `buffer`
samples, each sorted and cut greedily (its batch counts depend on the window, so batch k needs every earlier
window: what this project's buckets avoid). Padding: 1 - tokens / padded tokens; fill: padded tokens / (batches x
max_tokens), what a step's budget holds; "+batches": steps per epoch against the best fit.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.memory import in_child, kib
from loader.sources.budget import TokenBudgetBatches
from loader.sources.packing import PackedSource

MAX_TOKENS = 16384
BUFFER = 10_000  # Lhotse's DynamicBucketingSampler default buffer_size


def distributions(samples: int) -> dict[str, np.ndarray]:
    """SFT-like (log-normal, median 256 tokens, a tail past the budget) and speech-like (gamma frames, 1-30 s at
    100 frames/s) lengths, seeded."""
    rng = np.random.default_rng(0)
    return {
        "sft log-normal (median 256)": rng.lognormal(np.log(256), 1.0, samples).astype(np.int64),
        "speech gamma (mean 800 frames)": np.clip(rng.gamma(2.0, 400.0, samples), 100, 3000).astype(np.int64),
    }


def greedy_cut(sorted_lengths: np.ndarray, max_tokens: int) -> list[int]:
    """Batch sizes of ascending lengths cut greedily: each batch as long as count x its last length fits (a single
    longer sample alone). Optimal for sorted lengths: a longer prefix never needs more batches after it."""
    lengths, sizes, start = np.maximum(sorted_lengths, 1).tolist(), [], 0
    while start < len(lengths):
        stop = (
            bisect.bisect_right(range(start, len(lengths)), max_tokens, key=lambda j: (j - start + 1) * lengths[j])
            + start
        )
        stop = max(stop, start + 1)
        sizes.append(stop - start)
        start = stop
    return sizes


def measure_cut(lengths: np.ndarray, sizes: list[int], max_tokens: int) -> dict[str, float]:
    """Batches, padding and fill of sorted lengths cut into batches of these sizes."""
    cuts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    padded = int((np.maximum.reduceat(np.maximum(lengths, 1), cuts) * np.asarray(sizes)).sum())
    return {
        "batches": len(sizes),
        "padding": 1 - int(lengths.sum()) / padded,
        "fill": padded / (len(sizes) * max_tokens),
    }


def best_fit(lengths: np.ndarray, max_tokens: int) -> dict[str, float]:
    ordered = np.sort(lengths)
    return measure_cut(ordered, greedy_cut(ordered, max_tokens), max_tokens)


def sorted_buffer(lengths: np.ndarray, max_tokens: int, buffer: int = BUFFER) -> dict[str, float]:
    shuffled = lengths[np.random.default_rng(1).permutation(len(lengths))]
    windows = [np.sort(shuffled[low : low + buffer]) for low in range(0, len(lengths), buffer)]
    ordered = np.concatenate(windows)
    return measure_cut(ordered, [s for w in windows for s in greedy_cut(w, max_tokens)], max_tokens)


def ours(lengths: np.ndarray, max_tokens: int, buckets) -> dict[str, float]:
    stats = TokenBudgetBatches(lengths, max_tokens, buckets=buckets).stats()
    return {key: stats[key] for key in ("batches", "padding", "fill")}


def table(lengths: np.ndarray, max_tokens: int = MAX_TOKENS) -> list[tuple[str, dict[str, float]]]:
    """(batcher, measures) rows for these lengths, the best fit first."""
    rows = [
        ("best fit, unbounded buffer", best_fit(lengths, max_tokens)),
        (f"sorted buffer of {BUFFER} (fairseq, Lhotse)", sorted_buffer(lengths, max_tokens)),
    ]
    rows += [(f"ours, buckets={buckets}", ours(lengths, max_tokens, buckets)) for buckets in (1.05, 1.1, 1.25, None)]
    return rows


def costs(lengths: np.ndarray, max_tokens: int = MAX_TOKENS, draws: int = 2000) -> dict[str, float]:
    """Seconds a sample to make the batches (the one O(N) step) and seconds a batch to deal one (`members`)."""
    started = time.perf_counter()
    batches = TokenBudgetBatches(lengths, max_tokens)
    made = time.perf_counter() - started
    ks = np.random.default_rng(2).integers(0, len(batches), draws).tolist()
    started = time.perf_counter()
    for epoch, k in enumerate(ks):
        batches.members(k, epoch % 3)
    return {
        "make_s_per_sample": made / len(lengths),
        "batch_s": (time.perf_counter() - started) / len(ks),
        "index_bytes_per_sample": batches.index.itemsize,
    }


def start(kind: str, path: str, cache: str | None) -> dict[str, float]:
    """One start, in this (fresh) process: seconds to construct the source and take one batch or row at its middle,
    and the RSS before it and at its peak (MiB). `kind`: "budget" (`path`: the lengths) or "keep" (`path`: a keep=
    mask over `packing.AnalyticDocuments`, computed documents: only the mask and the tables are the start's)."""
    before = kib("VmRSS")
    started = time.perf_counter()
    if kind == "budget":
        source: Any = TokenBudgetBatches(path, MAX_TOKENS, cache=cache)
        made = time.perf_counter() - started
        source.members(len(source) // 2, 1)
        built = source.built
    else:
        from benchmarks.packing import AnalyticDocuments

        mask = np.load(path, mmap_mode="r")
        source = PackedSource(AnalyticDocuments(len(mask)), 2047, rows_per_window=8, keep=path, cache=cache)
        made = time.perf_counter() - started
        source.pieces(len(source) // 2, 1)
        built = not isinstance(source._stream.starts, np.memmap)
    return {
        "seconds": made,
        "first_batch_s": time.perf_counter() - started - made,
        "rss_before_mib": before / 1024,
        "peak_rss_mib": kib("VmHWM") / 1024,
        "built": built,
    }


def startup(kind: str, sizes: list[int], directory: str) -> list[dict]:
    """Each size's three starts (no cache, the cache built, the cache loaded), each a fresh process, over int32
    SFT-like lengths (budget) or a mask keeping 90% of the documents (keep)."""
    rows = []
    for samples in sizes:
        path = os.path.join(directory, f"{kind}-{samples}.npy")
        rng = np.random.default_rng(0)
        if kind == "budget":
            np.save(path, rng.lognormal(np.log(256), 1.0, samples).astype(np.int32))
        else:
            np.save(path, rng.random(samples) < 0.9)
        cache = os.path.join(directory, f"cache-{kind}-{samples}")
        for what, where in (("no cache", None), ("cache built", cache), ("cache loaded", cache)):
            point = in_child("benchmarks.budget", ["--start", kind, path] + ([where] if where else []), 3600)
            rows.append({"samples": samples, "start": what, **point})
        os.unlink(path)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget", description=__doc__)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--startup", help="sizes to measure a start at, e.g. 1e6,1e7,1e8")
    parser.add_argument(
        "--keep", action="store_true", help="with --startup: PackedSource(keep=) of that many documents instead"
    )
    parser.add_argument("--start", nargs="+", help=argparse.SUPPRESS)  # a child of --startup: KIND PATH [CACHE]
    args = parser.parse_args(argv)
    if args.start:
        print(json.dumps(start(args.start[0], args.start[1], args.start[2] if len(args.start) > 2 else None)))
        return
    if args.startup:
        sizes = [int(float(size)) for size in args.startup.split(",")]
        kind = "keep" if args.keep else "budget"
        print(f"{kind}: load average {os.getloadavg()[0]:.1f} at the start, {os.cpu_count()} CPUs")
        print(f"{'samples':>11} {'start':13} {'seconds':>8} {'first batch':>12} {'RSS before':>11} {'peak RSS':>9}")
        with tempfile.TemporaryDirectory() as directory:
            for row in startup(kind, sizes, directory):
                print(
                    f"{row['samples']:>11.0e} {row['start']:13} {row['seconds']:8.2f} "
                    f"{row['first_batch_s'] * 1e3:9.1f} ms {row['rss_before_mib']:7.0f} MiB "
                    f"{row['peak_rss_mib']:5.0f} MiB"
                )
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        return
    samples = args.samples
    for name, lengths in distributions(samples).items():
        print(f"\n{name}: {samples} samples, {int(lengths.sum())} tokens, max_tokens={MAX_TOKENS}")
        rows = table(lengths)
        least = rows[0][1]["batches"]
        print(f"{'batcher':44} {'batches':>8} {'+batches':>9} {'padding':>8} {'fill':>6}")
        for what, m in rows:
            print(f"{what:44} {m['batches']:8d} {m['batches'] / least - 1:9.2%} {m['padding']:8.2%} {m['fill']:6.1%}")
    measured = costs(distributions(samples)["sft log-normal (median 256)"])
    print(
        f"\nmaking the batches: {measured['make_s_per_sample'] * 1e6:.2f} us a sample (once), index "
        f"{measured['index_bytes_per_sample']} bytes a sample; a batch: {measured['batch_s'] * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()
