"""Sharded streams from what users already have: a list of files, a webdataset pipeline, a Hugging Face streaming
dataset. Each names its shards and reads one from any record on (`loader.streams.shards.ShardedStream`), so the loader
deals the shards to ranks and workers itself and resumes at any world size or number of workers.

A record offset counts the records `iter_shard` yields; reading shard i from record `start` on must yield exactly
what a read from 0 yields after its first `start` records, so the per-shard processing must be deterministic and
keep records in order (decode, map, filter: yes; a shuffle buffer: no — shuffle the shard order with shuffle=True).
Resuming inside a shard reads and drops its first `start` records (Hugging Face skips whole Arrow tables).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from loader.streams.shards import ShardedStream


class FileShards(ShardedStream):
    """Each file is a shard; `read(path)` yields its records (lines, rows, samples: anything iterable)."""

    def __init__(self, paths: Sequence[str | os.PathLike], read: Callable[[str], Iterable]):
        self.paths, self.read = [os.fspath(p) for p in paths], read

    def shards(self) -> list[str]:
        return self.paths

    def iter_shard(self, index: int, start: int) -> Iterator:
        return itertools.islice(self.read(self.paths[index]), start, None)


class WebDatasetShards(ShardedStream):
    """Tar shards read by webdataset itself: each shard's samples (`tarfile_to_samples`), then your `stages`
    (e.g. `webdataset.decode("pil")`, `webdataset.to_tuple("jpg", "cls")`, `webdataset.map(f)`), as in
    `webdataset.DataPipeline(shard_list, tarfile_to_samples(), *stages)`. Shards are given as webdataset takes
    them: a brace pattern, or a list of URLs or paths."""

    def __init__(self, urls: str | Sequence[str], *stages: Callable, handler: Callable | None = None):
        from webdataset.shardlists import expand_urls

        self.urls = expand_urls(urls) if isinstance(urls, str) else [os.fspath(u) for u in urls]
        self.stages, self.handler = stages, handler

    def shards(self) -> list[str]:
        return self.urls

    def iter_shard(self, index: int, start: int) -> Iterator:
        import webdataset as wds

        samples = wds.tarfile_to_samples(handler=self.handler or wds.reraise_exception)
        pipeline = wds.DataPipeline(wds.SimpleShardList([self.urls[index]]), samples, *self.stages)
        return itertools.islice(pipeline, start, None)


class HuggingFaceShards(ShardedStream):
    """A Hugging Face `datasets.IterableDataset` (`load_dataset(..., streaming=True)`), read shard by shard: its
    `num_shards` shards (files, or row groups after `reshard()`) are dealt by the loader, so do not split it by node
    (`split_dataset_by_node`) or call its `set_epoch`: pass shuffle=True to the loader to shuffle the shards."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def shards(self) -> list[str]:
        return [f"shard {i} of {self.dataset.num_shards}" for i in range(self.dataset.num_shards)]

    def iter_shard(self, index: int, start: int) -> Iterator:
        shard = self.dataset.shard(num_shards=self.dataset.num_shards, index=index, contiguous=True)
        # iter(batch_size=1), not iter(): in a torch worker, iter() would split the shard again among the workers
        for batch in (shard.skip(start) if start else shard).iter(batch_size=1):
            yield {name: values[0] for name, values in batch.items()}
