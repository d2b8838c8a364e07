"""7. LM data: tokens/s of TokenSource and of a 3-source Mixture through our loader against a plain loop slicing
the same memmaps (the limit), the loader's own CPU time per batch over that loop and where it goes, the memory a
1e9-position mixture adds, and the cost of position -> (source, index).

The plain loop is nanoGPT's get_batch for the same samples: per sample, slice its seq_len + 1 tokens from an
np.memmap and cast them to int64, then torch.stack the batch. Nothing else (no progress, no file checks, no
loader): the limit. Ours: ResumableDataLoader (num_workers=0) over a TokenSource, shuffled, and over a Mixture
of three TokenSources, 50/30/20, with shuffle=False (the mixture interleaves); torch's DataLoader over the same
dataset is shown for what torch's own per-batch machinery costs. Both sides read the same samples in the same
order: the plain loop is handed the loader's index list, computed before timing. Every timed pass starts after
its first batch.

The overhead (issue 23 item 4): CPU time (process_time) per batch of ours minus the plain loop's, paired per
interleaved round, at batch 8 and seq_len 256 where the per-batch work shows most; graded against 10 us, "not
resolved" when the rounds' quartiles straddle it. The breakdown times each part of a batch on its own, per batch:
what torch's iterator adds, the file checks, locating the samples, the copies, the Rows and collation, and the
progress and metrics the loader keeps.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.fetch import _MapDatasetFetcher

from benchmarks.config import Config
from benchmarks.loaders import ours
from benchmarks.memory import in_child, peak_added
from benchmarks.progress import say
from benchmarks.rows import count, row, single
from benchmarks.states import global_state_at
from benchmarks.timing import compare, measure, per_call, ratio_of, summary
from loader.core.order import Order
from loader.core.partition import Layout
from loader.core.rows import Rows, batch_reader, collate
from loader.core.sampler import ResumableSampler
from loader.sources import Mixture, TokenSource
from loader.sources.mixture import BLOCK
from loader.sources.tokens import GATHER_ROWS

TARGET = ">= 0.95"  # tokens/s through our loader / the plain loop's, graded from TARGET_FROM_BATCH on
TARGET_FROM_BATCH = 32  # below it the fixed cost per batch dominates: graded as OVERHEAD_TARGET instead
OVERHEAD_TARGET = "<= 10"  # CPU us per batch of ours beyond the plain loop's, at OVERHEAD_BATCH
OVERHEAD_BATCH, OVERHEAD_SEQ_LEN = 8, 256  # the lead's measurement: small batches, short rows, fixed costs show
OVERHEAD_BATCHES = 2000  # batches per timed pass (~0.1 s)
MEMORY_TARGET = "< 1"  # MB added by resuming a 1e9-position mixture and loading a batch, beyond the maps
NAMES, WEIGHTS = ("web", "code", "books"), (0.5, 0.3, 0.2)
PLAIN, OURS, TORCH = "plain memmap loop", "ResumableDataLoader", "DataLoader"
VOCAB = 50257  # GPT-2's: uint16 token files, as nanoGPT writes them
PROBE_BATCH = 8

Pairs = list[list[tuple[np.ndarray, int]]]  # per batch: (memmap, token offset) of each sample


def write_sources(directory: Path, tokens: int) -> list[Path]:
    """One uint16 token file of `tokens` random ids per mixture source."""
    rng = np.random.default_rng(0)
    paths = [directory / f"{name}.bin" for name in NAMES]
    for path in paths:
        rng.integers(0, VOCAB, tokens, dtype=np.uint16).tofile(path)
    return paths


def mixture(sources: list[TokenSource], num_samples: int) -> Mixture:
    return Mixture(sources, WEIGHTS, num_samples=num_samples, seed=0, names=NAMES)


def token_sources(paths: list[Path], seq_len: int) -> list[TokenSource]:
    return [TokenSource(path, seq_len=seq_len, dtype="uint16") for path in paths]


def plain_loop(batches: Pairs, seq_len: int) -> float:
    """Tokens/s of the limit: slice, cast, stack, for the given samples."""
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        tokens += torch.stack([torch.from_numpy(m[o : o + seq_len + 1].astype(np.int64)) for m, o in batch]).numel()
    return tokens / (time.perf_counter() - start)


def through(make_loader) -> float:
    """Tokens/s of one pass of a new loader, after its first batch."""
    batches = iter(make_loader())
    next(batches)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        tokens += batch.numel()
    return tokens / (time.perf_counter() - start)


def _compare(cfg: Config, label: str, dataset, shuffle: bool, pairs: list[tuple[np.ndarray, int]], batch: int) -> dict:
    """Our loader, torch's and the plain loop over the same samples; ratios to the plain loop."""
    batches = [pairs[k : k + batch] for k in range(batch, len(pairs) // batch * batch, batch)]  # after the first
    kwargs = dict(batch_size=batch, shuffle=shuffle, drop_last=True)
    first = next(iter(ours(dataset, **kwargs)))
    expected = torch.stack([torch.from_numpy(m[o : o + cfg.seq_len + 1].astype(np.int64)) for m, o in pairs[:batch]])
    assert torch.equal(first, expected), "the plain loop would read other samples than the loader"
    candidates = {
        PLAIN: partial(plain_loop, batches, cfg.seq_len),
        OURS: partial(through, partial(ours, dataset, **kwargs)),
        TORCH: partial(through, partial(DataLoader, dataset, **kwargs)),
    }
    result = compare(candidates, PLAIN, cfg.reps, cfg.warmup, f"tokens {label}", "tokens/s")
    graded = batch >= TARGET_FROM_BATCH
    rows = [
        row(f"{label}: {name} / {PLAIN}", ratio, "ratio", TARGET if name == OURS and graded else None)
        for name, ratio in result["ratios"].items()
    ]
    return {"label": label, "batch_size": batch, "samples": len(pairs), **result, "rows": rows}


def _token_source(cfg: Config, path: Path, batch: int) -> dict:
    source, memmap = TokenSource(path, seq_len=cfg.seq_len, dtype="uint16"), np.memmap(path, np.uint16, mode="r")
    order = Order(len(source), 0, "global").for_epoch(0)(np.arange(len(source)))  # the loader's: seed 0, one rank
    pairs = [(memmap, i * cfg.seq_len) for i in order.tolist()]
    return _compare(cfg, f"TokenSource, shuffled, batch {batch} x {cfg.seq_len + 1}", source, True, pairs, batch)


def _mixture(cfg: Config, paths: list[Path], batch: int) -> dict:
    mix = mixture(token_sources(paths, cfg.seq_len), cfg.tokens_per_source // cfg.seq_len)
    source, index = mix.plan.locate(np.arange(len(mix)))
    memmaps = [np.memmap(path, np.uint16, mode="r") for path in paths]
    pairs = [(memmaps[s], i * cfg.seq_len) for s, i in zip(source.tolist(), index.tolist())]
    return _compare(cfg, f"Mixture of 3 TokenSources, batch {batch} x {cfg.seq_len + 1}", mix, False, pairs, batch)


def cpu_per_batch(batches) -> float:
    """CPU seconds per batch of one pass over an iterable of batches (all of them: the caller bounds it)."""
    start, count = time.process_time(), 0
    for _ in batches:
        count += 1
    return (time.process_time() - start) / count


def cpu_per_call(fn: Callable[[], object], calls: int) -> float:
    """CPU seconds per call of fn over `calls` calls (CPU time: other processes on the machine do not count)."""
    return cpu_per_batch(fn() for _ in range(calls))


def plain_batches(pairs: list[tuple[np.ndarray, int]], batch: int, seq_len: int):
    """The plain loop's batches: nanoGPT's get_batch for the given samples."""
    for k in range(0, len(pairs) - batch + 1, batch):
        yield torch.stack([torch.from_numpy(m[o : o + seq_len + 1].astype(np.int64)) for m, o in pairs[k : k + batch]])


def loader_batches(dataset, shuffle: bool, batch: int, count: int):
    """`count` batches of a new loader (num_workers=0), after its first, which starts nothing timed."""
    batches = iter(ours(dataset, batch_size=batch, shuffle=shuffle, drop_last=True))
    next(batches)
    return itertools.islice(batches, count)


def graded(what: str, stats: dict, target: str) -> dict:
    """A row in us graded against `target` ("<= bound") only where the rounds resolve it: their quartiles on one
    side of the bound; otherwise "not resolved" (met None, resolved False)."""
    result = row(what, stats, "us", target, scale=1e6)
    bound = float(target.split()[1]) * 1e-6
    if stats["n"] > 1 and stats["q1"] <= bound <= stats["q3"]:
        result.update(met=None, resolved=False)
    return result


def _overhead(
    cfg: Config, label: str, dataset, shuffle: bool, pairs: list[tuple[np.ndarray, int]], seq_len: int, batch: int
) -> dict:
    """CPU per batch of ours and of the plain loop over the same samples, interleaved; the overhead per round
    (graded at OVERHEAD_BATCH) and the tokens/s ratio on CPU time (graded from TARGET_FROM_BATCH)."""
    count = min(OVERHEAD_BATCHES, len(pairs) // batch - 1)
    plain = pairs[batch : (count + 1) * batch]  # the loader's batches after its first
    candidates = {
        PLAIN: lambda: cpu_per_batch(plain_batches(plain, batch, seq_len)),
        OURS: lambda: cpu_per_batch(loader_batches(dataset, shuffle, batch, count)),
    }
    load = os.getloadavg()[0]
    result = compare(candidates, PLAIN, cfg.reps, cfg.warmup, f"tokens overhead {label}", "CPU s/batch")
    load = (load, os.getloadavg()[0])  # CPU time leaves other processes out, but not what they do to the caches
    say("tokens", f"overhead {label}: load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} CPUs")
    samples = result["samples"]
    overhead = summary([a - b for a, b in zip(samples[OURS], samples[PLAIN])])
    shape = f"{label}, batch {batch} x {seq_len + 1}"
    what = f"{shape}: CPU per batch, {OURS} - {PLAIN}"
    rows = [
        graded(what, overhead, OVERHEAD_TARGET) if batch == OVERHEAD_BATCH else row(what, overhead, "us", scale=1e6),
        row(f"{shape}: CPU per batch, {PLAIN}", result["values"][PLAIN], "us", scale=1e6),
        row(
            f"{shape}: tokens/s on CPU time, {OURS} / {PLAIN}",
            ratio_of(result, PLAIN, OURS),
            "ratio",
            TARGET if batch >= TARGET_FROM_BATCH else None,
        ),
    ]
    return {
        "label": label,
        "batch_size": batch,
        "seq_len": seq_len,
        "batches": count,
        **result,
        "overhead": overhead,
        "load_average": load,
        "rows": rows,
    }


def _fetch_only(dataset, batch_ids: list[int]) -> Callable[[], object]:
    """torch's fetcher and the loader's collate around a __getitems__ that costs nothing (a batch made ahead)."""
    made = Rows(torch.from_numpy(np.zeros((len(batch_ids), 2), dtype=np.int64)))

    class Made(torch.utils.data.Dataset):
        def __getitems__(self, indices):
            return made

    fetcher = _MapDatasetFetcher(Made(), True, collate, False)
    return partial(fetcher.fetch, batch_ids)


def _breakdown(cfg: Config, label: str, dataset, shuffle: bool, seq_len: int) -> list[dict]:
    """Each part of one batch of 8 timed on its own, as CPU time per call (the same batch over and over), in us."""
    loader = ours(dataset, batch_size=OVERHEAD_BATCH, shuffle=shuffle)
    ids = next(iter(loader.resumable_sampler))
    mixture = isinstance(dataset, Mixture)
    if mixture:
        parts = [(dataset.sources[s], rows, indices) for s, rows, indices in dataset._shares(ids)]
        locate = partial(dataset._shares, ids)
    else:
        parts = [(dataset, range(len(ids)), ids)]
        locate = partial(dataset._locate, ids)
    reads = [(src, rows, indices, *src._locate(indices)) for src, rows, indices in parts]
    out = np.empty((len(ids), seq_len + 1), dtype=np.int64)
    windows = [src._windows(files[0]) for src, _, _, files, _ in reads]

    def checks() -> None:  # what a batch checks of each file it reads: its size before, its state after
        for src, _, _, files, _ in reads:
            for file in set(files):
                src._files[file].array()
                src._files[file].check_unchanged()

    def copies() -> None:  # the tokens moved into the batch, as _fill moves them: a gather of a whole batch from one
        for (src, rows, indices, files, offsets), view in zip(reads, windows):  # file, else a slice per sample
            if len(indices) >= GATHER_ROWS:
                out[:] = view[np.asarray(offsets) // seq_len]
            else:
                tokens = src._files[files[0]].array()
                for r, offset in zip(rows, offsets):
                    out[r] = tokens[offset : offset + seq_len + 1]

    batch = collate(Rows(torch.from_numpy(out)))
    sampler = iter(ResumableSampler(Order(10**12, 0, "global" if shuffle else "none"), Layout(1, 1, 8, False), 0))
    profile_name = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"

    def record_function() -> None:
        with torch.autograd.profiler.record_function(profile_name):
            pass

    parts = {
        (
            "torch's record_function around next() (torch's iterator; the loader skips it unless a profiler runs)"
        ): record_function,
        "torch's fetcher + the loader's collate around __getitems__ (a source without batch_reader)": _fetch_only(
            dataset, ids
        ),
        "the sampler: the next index list": partial(next, sampler),
        "locating the samples (file, offset)" + (": Mixture._shares" if mixture else ""): locate,
        "file checks (size before, state after, per file read)": checks,
        "copies into the batch (numpy)": copies,
        "Rows of the batch + collate (torch.from_numpy, unbind; a source without batch_reader)": lambda: collate(
            Rows(torch.from_numpy(out))
        ),
        "progress and metrics (_deliver)": lambda: loader._deliver(time.perf_counter(), batch),
        "the source's whole read (its batch_reader, else __getitems__)": partial(
            batch_reader(dataset) or dataset.__getitems__, ids
        ),
    }
    calls = max(10, int(cfg.min_call_s * 1e5))  # ~2000 in a quick run: milliseconds of CPU per measurement
    rows = []
    for what, fn in parts.items():
        stats = measure(
            what, partial(cpu_per_call, fn, calls), cfg.reps, cfg.warmup, f"tokens breakdown {label}", "CPU s"
        )
        rows.append(row(f"{label}, batch {OVERHEAD_BATCH} x {seq_len + 1}, per batch: {what}", stats, "us", scale=1e6))
    return rows


def memory_probe(directory: str, seq_len: int, positions: int) -> dict:
    """Runs in a fresh process: the peak RSS that a new `positions`-position mixture, resumed at its middle, adds
    by loading a batch, beyond the maps. The maps: the file pages a batch touches count in RSS (the page cache
    maps whole large folios, up to 2 MB a sample), so a warm-up loads the same batch through the same TokenSources
    first; the measured mixture, loader and state are new, so everything else they allocate is counted."""
    sources = token_sources(sorted(Path(directory).glob("*.bin")), seq_len)

    def first_batch_at(position: int) -> None:
        mix = mixture(sources, positions)
        loader = ours(mix, batch_size=PROBE_BATCH)
        loader.load_state_dict(global_state_at(mix, PROBE_BATCH, position, shuffle=False))
        next(iter(loader))

    first_batch_at(positions // 2)  # lazy imports, first-call allocations, the file pages of this batch
    return peak_added(lambda: first_batch_at(positions // 2))


def _mapping_costs(cfg: Config, paths: list[Path]) -> list[dict]:
    """ns per position of position -> (source, index) at positions around 5e8 of a 1e9-position mixture."""
    mix = mixture(token_sources(paths, cfg.seq_len), cfg.mixture_positions)
    middle, rng = cfg.mixture_positions // 2, np.random.default_rng(0)
    scattered = rng.integers(0, cfg.mixture_positions, 64)
    in_order = [list(range(p, p + 8)) for p in range(middle, middle + 4 * BLOCK, 8)]  # 4 blocks: refills included
    cases = {
        f"plan.locate of a block of {BLOCK} positions in order (what the cache computes)": (
            lambda: mix.plan.locate(np.arange(middle, middle + BLOCK)),
            BLOCK,
        ),
        "plan.locate of 64 scattered positions (a shuffled mixture: no cache)": (
            lambda: mix.plan.locate(scattered),
            64,
        ),
        "Mixture.locate of batches of 8 positions in order (through the cache)": (
            lambda: [mix.locate(batch) for batch in in_order],
            8 * len(in_order),
        ),
    }
    points = []
    for what, (work, positions) in cases.items():
        stats = measure(
            what,
            lambda: per_call(work, cfg.min_call_s) / positions * 1e9,  # noqa: B023 - called in this iteration
            cfg.reps,
            cfg.warmup,
            "tokens position -> (source, index)",
            "ns",
        )
        points.append({"what": what, "ns_per_position": stats})
    return points


def _overheads(cfg: Config, paths: list[Path]) -> list[dict]:
    """The overhead (at OVERHEAD_BATCH and the graded batch sizes) and its breakdown, TokenSource shuffled and the
    Mixture in order, at OVERHEAD_SEQ_LEN."""
    seq_len = min(OVERHEAD_SEQ_LEN, cfg.seq_len)
    sources = token_sources(paths, seq_len)
    memmaps = [np.memmap(path, np.uint16, mode="r") for path in paths]
    order = Order(len(sources[0]), 0, "global").for_epoch(0)(np.arange(len(sources[0])))
    mix = mixture(sources, cfg.tokens_per_source // seq_len)
    source, index = mix.plan.locate(np.arange(len(mix)))
    cases = []
    for label, dataset, shuffle, pairs in (
        ("TokenSource, shuffled", sources[0], True, [(memmaps[0], i * seq_len) for i in order.tolist()]),
        (
            "Mixture of 3 TokenSources",
            mix,
            False,
            [(memmaps[s], i * seq_len) for s, i in zip(source.tolist(), index.tolist())],
        ),
    ):
        for batch in sorted({OVERHEAD_BATCH, *(b for b in cfg.token_batch_sizes if b >= TARGET_FROM_BATCH)}):
            cases.append(_overhead(cfg, label, dataset, shuffle, pairs, seq_len, batch))
        cases[-1]["rows"] += _breakdown(cfg, label, dataset, shuffle, seq_len)
    return cases


def run(cfg: Config) -> dict:
    with tempfile.TemporaryDirectory(prefix="loader-bench-tokens-") as directory:
        paths = write_sources(Path(directory), cfg.tokens_per_source)
        overheads = _overheads(cfg, paths)
        cases = [_token_source(cfg, paths[0], batch) for batch in cfg.token_batch_sizes]
        cases += [_mixture(cfg, paths, batch) for batch in cfg.token_batch_sizes]
        args = [directory, str(cfg.seq_len), str(cfg.mixture_positions)]
        memory = in_child("benchmarks.tokens", args, cfg.memory_timeout_s)
        mapping = _mapping_costs(cfg, paths)
    rows = [r for case in overheads + cases for r in case["rows"]]
    if "timed_out_s" in memory:
        memory = None
    else:
        say("tokens", f"mixture of {count(cfg.mixture_positions)} positions: +{memory['added_bytes'] / 1e6:.2f} MB")
        rows.append(
            row(
                f"memory: resume a {count(cfg.mixture_positions)}-position mixture at its middle, one batch",
                single(memory["added_bytes"]),
                "MB",
                MEMORY_TARGET,
                scale=1e-6,
            )
        )
    rows += [row(f"position -> (source, index): {p['what']}", p["ns_per_position"], "ns") for p in mapping]
    shape = {"seq_len": cfg.seq_len, "tokens_per_source": cfg.tokens_per_source, "weights": dict(zip(NAMES, WEIGHTS))}
    return {**shape, "overhead": overheads, "cases": cases, "memory": memory, "mapping": mapping, "rows": rows}


if __name__ == "__main__":
    print(json.dumps(memory_probe(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
