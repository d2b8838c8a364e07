"""6. WebDataset: our loader over `loader.sources.webdataset.WebDatasetSource` against webdataset's own reader.

Same local shards (written here with webdataset.ShardWriter), same decoding. Ours is map-style and shuffled by
shard blocks (`shuffle_blocks=src.shard_sizes`: shards in a keyed order, samples shuffled inside each), so reads
stay within one shard at a time; `webdataset.WebDataset` reads the shards sequentially, its fastest mode and the
one with no state at all. The target is ours >= 0.9 of it.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from functools import partial

import numpy as np
import webdataset
from webdataset import autodecode

from benchmarks.config import Config
from benchmarks.loaders import OURS, OURS_CHECKPOINTING, TORCH, Candidate
from benchmarks.throughput import rate, ratio_rows
from benchmarks.timing import compare
from loader.sources import WebDatasetSource

SEQUENTIAL = Candidate("webdataset.WebDataset", TORCH.make, False)
KEYS = ("npy", "cls")
TARGET = ">= 0.9"


def write_shards(directory: str, shards: int, per_shard: int, sample_bytes: int) -> list[str]:
    """`shards` tar files of `per_shard` samples: a float32 array of `sample_bytes` and a class label each."""
    rng = np.random.default_rng(0)
    pattern = os.path.join(directory, "shard-%06d.tar")
    with webdataset.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            sink.write({"__key__": f"{i:09d}", "npy": rng.random(sample_bytes // 4, dtype=np.float32), "cls": i % 10})
    return sorted(glob.glob(os.path.join(directory, "shard-*.tar")))


def _case(cfg: Config, urls: list[str], source, num_workers: int) -> dict:
    common = dict(batch_size=cfg.batch_size, num_workers=num_workers)
    sequential = webdataset.WebDataset(urls, shardshuffle=False).decode().to_tuple(*KEYS)
    ours = dict(common, shuffle=True, shuffle_blocks=source.shard_sizes)
    candidates = {
        SEQUENTIAL.name: partial(rate, SEQUENTIAL, sequential, **common),
        OURS.name: partial(rate, OURS, source, **ours),
        OURS_CHECKPOINTING.name: partial(rate, OURS_CHECKPOINTING, source, **ours),
    }
    label = f"workers={num_workers}"
    result = compare(candidates, SEQUENTIAL.name, cfg.reps, cfg.warmup, f"webdataset {label}", "samples/s")
    return {"label": label, "num_workers": num_workers, **common, **result}


def run(cfg: Config) -> dict:
    with tempfile.TemporaryDirectory(prefix="loader-bench-shards-") as directory:
        urls = write_shards(directory, cfg.shards, cfg.samples_per_shard, cfg.sample_bytes)
        start = time.perf_counter()
        source = WebDatasetSource(urls, decode=autodecode.Decoder([]), keys=KEYS)  # .decode() with no arguments
        index_s = time.perf_counter() - start
        cases = [_case(cfg, urls, source, workers) for workers in cfg.workers]
    shape = {"shards": cfg.shards, "samples_per_shard": cfg.samples_per_shard, "sample_bytes": cfg.sample_bytes}
    rows = [r for case in cases for r in ratio_rows(case, SEQUENTIAL.name, TARGET)]
    return {**shape, "index_build_s": index_s, "cases": cases, "rows": rows}
