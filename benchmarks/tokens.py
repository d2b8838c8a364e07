"""7. LM data: tokens/s of TokenSource and of a 3-source Mixture through our loader against a plain loop slicing
the same memmaps (the limit), the memory a 1e9-position mixture adds, and the cost of position -> (source, index).

The plain loop is nanoGPT's get_batch for the same samples: per sample, slice its seq_len + 1 tokens from an
np.memmap and cast them to int64, then torch.stack the batch. Nothing else (no progress, no file checks, no
loader): the limit. Ours: ResumableDataLoader (num_workers=0) over a TokenSource, shuffled, and over a Mixture
of three TokenSources, 50/30/20, with shuffle=False (the mixture interleaves); torch's DataLoader over the same
dataset is shown for what torch's own per-batch machinery costs. Both sides read the same samples in the same
order: the plain loop is handed the loader's index list, computed before timing. Every timed pass starts after
its first batch.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks.config import Config
from benchmarks.loaders import ours
from benchmarks.memory import in_child, peak_added
from benchmarks.progress import say
from benchmarks.rows import count, row, single
from benchmarks.states import global_state_at
from benchmarks.timing import compare, measure, per_call
from loader.core.order import Order
from loader.sources import Mixture, TokenSource
from loader.sources.mixture import BLOCK

TARGET = ">= 0.95"  # tokens/s through our loader / the plain loop's
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
        tokens += torch.stack([torch.from_numpy(m[o:o + seq_len + 1].astype(np.int64)) for m, o in batch]).numel()
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
    batches = [pairs[k:k + batch] for k in range(batch, len(pairs) // batch * batch, batch)]  # after the first
    kwargs = dict(batch_size=batch, shuffle=shuffle, drop_last=True)
    first = next(iter(ours(dataset, **kwargs)))
    expected = torch.stack([torch.from_numpy(m[o:o + cfg.seq_len + 1].astype(np.int64)) for m, o in pairs[:batch]])
    assert torch.equal(first, expected), "the plain loop would read other samples than the loader"
    candidates = {
        PLAIN: partial(plain_loop, batches, cfg.seq_len),
        OURS: partial(through, partial(ours, dataset, **kwargs)),
        TORCH: partial(through, partial(DataLoader, dataset, **kwargs)),
    }
    result = compare(candidates, PLAIN, cfg.reps, cfg.warmup, f"tokens {label}", "tokens/s")
    rows = [row(f"{label}: {name} / {PLAIN}", ratio, "ratio", TARGET if name == OURS else None)
            for name, ratio in result["ratios"].items()]
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
        f"plan.locate of a block of {BLOCK} positions in order (what the cache computes)":
            (lambda: mix.plan.locate(np.arange(middle, middle + BLOCK)), BLOCK),
        "plan.locate of 64 scattered positions (a shuffled mixture: no cache)":
            (lambda: mix.plan.locate(scattered), 64),
        "Mixture.locate of batches of 8 positions in order (through the cache)":
            (lambda: [mix.locate(batch) for batch in in_order], 8 * len(in_order)),
    }
    points = []
    for what, (work, positions) in cases.items():
        stats = measure(what, lambda: per_call(work, cfg.min_call_s) / positions * 1e9, cfg.reps, cfg.warmup,
                        "tokens position -> (source, index)", "ns")
        points.append({"what": what, "ns_per_position": stats})
    return points


def run(cfg: Config) -> dict:
    with tempfile.TemporaryDirectory(prefix="loader-bench-tokens-") as directory:
        paths = write_sources(Path(directory), cfg.tokens_per_source)
        cases = [_token_source(cfg, paths[0], batch) for batch in cfg.token_batch_sizes]
        cases += [_mixture(cfg, paths, batch) for batch in cfg.token_batch_sizes]
        args = [directory, str(cfg.seq_len), str(cfg.mixture_positions)]
        memory = in_child("benchmarks.tokens", args, cfg.memory_timeout_s)
        mapping = _mapping_costs(cfg, paths)
    rows = [r for case in cases for r in case["rows"]]
    if "timed_out_s" in memory:
        memory = None
    else:
        say("tokens", f"mixture of {count(cfg.mixture_positions)} positions: +{memory['added_bytes'] / 1e6:.2f} MB")
        rows.append(row(f"memory: resume a {count(cfg.mixture_positions)}-position mixture at its middle, one batch",
                        single(memory["added_bytes"]), "MB", MEMORY_TARGET, scale=1e-6))
    rows += [row(f"position -> (source, index): {p['what']}", p["ns_per_position"], "ns") for p in mapping]
    shape = {"seq_len": cfg.seq_len, "tokens_per_source": cfg.tokens_per_source, "weights": dict(zip(NAMES, WEIGHTS))}
    return {**shape, "cases": cases, "memory": memory, "mapping": mapping, "rows": rows}


if __name__ == "__main__":
    print(json.dumps(memory_probe(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
