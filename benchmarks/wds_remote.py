"""8. Remote shards: our loader over shards in a loopback S3 endpoint against webdataset streaming the same objects.

The shards of section 6 are uploaded to moto's S3 server (its own process, on 127.0.0.1; tests/servers.py starts
it for the tests too). Candidates, same workers and batch size: `webdataset.WebDataset` streaming the objects
(signed HTTP URLs, read with curl as webdataset does), ours reading them through the node cache (`cache_limit` the
smallest accepted with prefetch=2 and the most workers: 4 of the 8 shards, 7 with 4 workers, each of which may keep
2 open while idle; the copies are removed before each round, so every
round downloads the whole dataset as the stream does), and ours over the same shards on local disk. Also: the
bytes downloaded per epoch / the dataset's bytes with that small cache (plan-driven prefetch and eviction: 1.0
means each shard is downloaded exactly once an epoch), and the bytes read by ranged requests to index. And the
bytes one node downloads per epoch / its share of the dataset, two nodes of one rank each with their own small
cache: with `lanes=2` each node reads its own half of the shards (1.0 is the share exactly; the shard a lane
boundary cuts is read by both), without lanes every node reads every shard (2.0).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from functools import partial

import webdataset
from webdataset import autodecode

from benchmarks.config import Config
from benchmarks.loaders import TORCH, Candidate, ours
from benchmarks.rows import row, single
from benchmarks.throughput import rate
from benchmarks.timing import compare
from benchmarks.wds import KEYS, write_shards
from loader.sources import WebDatasetSource

STREAM = Candidate("webdataset.WebDataset S3 stream", TORCH.make, False)
OURS_REMOTE = Candidate("ResumableDataLoader S3 + cache", ours, False)
OURS_LOCAL = Candidate("ResumableDataLoader local disk", ours, False)
TARGET = ">= 0.9"
BYTES_TARGET = "<= 1.01"
NODE_TARGET = "<= 1.25"  # a node's share, and the shard a lane boundary cuts
PREFETCH = 2
WAIT_S = 60.0  # for a download still finishing from the previous round


def _missing() -> str | None:
    absent = [name for name in ("fsspec", "s3fs", "moto") if importlib.util.find_spec(name) is None]
    if absent:
        return f'{", ".join(absent)} not installed: pip install -e ".[test-remote]" for this section'
    return None


def _clear_copies(cache_dir: str) -> None:
    """A cold cache: no copies (indexes stay, as on a node where the job ran before), nothing downloading."""
    deadline = time.monotonic() + WAIT_S
    while os.listdir(os.path.join(cache_dir, "partial")) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(os.path.join(cache_dir, "shards"))
    os.makedirs(os.path.join(cache_dir, "shards"))


def _cold_rate(source, cache_dir: str, **kwargs) -> float:
    _clear_copies(cache_dir)
    return rate(OURS_REMOTE, source, **kwargs)


def _case(cfg: Config, signed: list[str], remote, local, cache_dir: str, num_workers: int) -> dict:
    common = dict(batch_size=cfg.batch_size, num_workers=num_workers)
    stream = webdataset.WebDataset(signed, shardshuffle=False).decode().to_tuple(*KEYS)
    blocks = dict(common, shuffle=True, shuffle_blocks=remote.shard_sizes)
    candidates = {
        STREAM.name: partial(rate, STREAM, stream, **common),
        OURS_REMOTE.name: partial(_cold_rate, remote, cache_dir, **blocks),
        OURS_LOCAL.name: partial(rate, OURS_LOCAL, local, **blocks),
    }
    label = f"workers={num_workers}"
    result = compare(candidates, STREAM.name, cfg.reps, cfg.warmup, f"remote {label}", "samples/s")
    return {"label": label, "num_workers": num_workers, **common, **result}


def _downloaded_per_epoch(cfg: Config, source, cache_dir: str, dataset_bytes: int) -> list[float]:
    """Bytes downloaded in each of two epochs (the first from a cold cache) / the dataset's bytes."""
    _clear_copies(cache_dir)
    loader = ours(
        source, batch_size=cfg.batch_size, shuffle=True, shuffle_blocks=source.shard_sizes, num_workers=max(cfg.workers)
    )
    ratios = []
    for _ in range(2):
        before = source.cache_stats().get("downloaded_bytes", 0)
        for _ in loader:
            pass
        ratios.append((source.cache_stats()["downloaded_bytes"] - before) / dataset_bytes)
    return ratios


NODES = 2


def _downloaded_per_node(cfg: Config, nodes: list[tuple], dataset_bytes: int, lanes: int | None) -> list[float]:
    """Bytes each of NODES one-rank nodes ((source, its cache_dir) each) downloads in an epoch / its share."""
    shares = []
    for rank, (source, cache_dir) in enumerate(nodes):
        _clear_copies(cache_dir)
        before = source.cache_stats().get("downloaded_bytes", 0)
        loader = ours(
            source,
            batch_size=cfg.batch_size,
            shuffle=True,
            shuffle_blocks=source.shard_sizes,
            num_workers=max(cfg.workers),
            rank=rank,
            world_size=NODES,
            lanes=lanes,
        )
        for _ in loader:
            pass
        shares.append((source.cache_stats()["downloaded_bytes"] - before) * NODES / dataset_bytes)
    return shares


def run(cfg: Config) -> dict:
    if (missing := _missing()) is not None:
        return {"skipped": missing}
    import fsspec

    from tests.servers import moto_server, s3_options, upload

    with tempfile.TemporaryDirectory(prefix="loader-bench-remote-") as directory, moto_server() as endpoint:
        os.makedirs(os.path.join(directory, "shards"))
        local_urls = write_shards(
            os.path.join(directory, "shards"), cfg.shards, cfg.samples_per_shard, cfg.sample_bytes
        )
        options = s3_options(endpoint)
        fs, _ = fsspec.url_to_fs("s3://bench", **options)
        upload(fs, os.path.join(directory, "shards"), "bench")
        names = [os.path.basename(u) for u in local_urls]
        signed = [fs.sign(f"bench/{name}", expiration=24 * 3600) for name in names]
        sizes = [os.path.getsize(u) for u in local_urls]
        dataset_bytes, cache_dir = sum(sizes), os.path.join(directory, "cache")
        cached = max(PREFETCH + 2, 2 * (max(cfg.workers) - 1) + 1)  # the smallest accepted: see WebDatasetSource
        limit = cached * (-(-max(sizes) // 4096) + 1) * 4096 + 2 * 4096  # a copy in whole blocks, and its checksum
        start = time.perf_counter()
        remote = WebDatasetSource(
            [f"s3://bench/{name}" for name in names],
            decode=autodecode.Decoder([]),
            keys=KEYS,
            storage_options=options,
            cache_dir=cache_dir,
            cache_limit=limit,
            prefetch=PREFETCH,
            progress=False,
        )
        index_s = time.perf_counter() - start
        index_bytes = remote.cache_stats()["index_bytes"]
        local = WebDatasetSource(local_urls, decode=autodecode.Decoder([]), keys=KEYS, progress=False)
        cases = [_case(cfg, signed, remote, local, cache_dir, workers) for workers in cfg.workers]
        per_epoch = _downloaded_per_epoch(cfg, remote, cache_dir, dataset_bytes)
        nodes = [
            (
                WebDatasetSource(
                    [f"s3://bench/{name}" for name in names],
                    decode=autodecode.Decoder([]),
                    keys=KEYS,
                    storage_options=options,
                    cache_dir=node_dir,
                    cache_limit=limit,
                    prefetch=PREFETCH,
                    progress=False,
                ),
                node_dir,
            )
            for node_dir in (os.path.join(directory, f"node{r}") for r in range(NODES))
        ]
        per_node = {lanes: _downloaded_per_node(cfg, nodes, dataset_bytes, lanes) for lanes in (NODES, None)}
    rows = []
    for case in cases:
        for name, ratio in case["ratios"].items():
            rows.append(
                row(
                    f"{case['label']}: {name} / {STREAM.name}",
                    ratio,
                    "ratio",
                    TARGET if name == OURS_REMOTE.name else None,
                )
            )
    cache_label = f"cache_limit {cached} shards, {cfg.shards} shards, workers={max(cfg.workers)}"
    rows.append(
        row(
            f"bytes downloaded, epoch 1 (cold cache) / dataset bytes, {cache_label}",
            single(per_epoch[0]),
            "ratio",
            BYTES_TARGET,
        )
    )
    rows.append(
        row(f"bytes downloaded, epoch 2 / dataset bytes, {cache_label}", single(per_epoch[1]), "ratio", BYTES_TARGET)
    )
    rows.append(
        row("bytes read by ranged requests to index / dataset bytes", single(index_bytes / dataset_bytes), "ratio")
    )
    for lanes, shares in per_node.items():
        rows.append(
            row(
                f"bytes downloaded per node, epoch / node's share, {NODES} nodes, lanes={lanes}, {cache_label}",
                single(max(shares)),
                "ratio",
                NODE_TARGET if lanes else None,
            )
        )
    shape = {
        "shards": cfg.shards,
        "samples_per_shard": cfg.samples_per_shard,
        "sample_bytes": cfg.sample_bytes,
        "dataset_bytes": dataset_bytes,
        "cache_limit": limit,
        "prefetch": PREFETCH,
    }
    return {
        **shape,
        "index_build_s": index_s,
        "index_bytes": index_bytes,
        "downloaded_per_epoch": per_epoch,
        "downloaded_per_node_share": {str(lanes): shares for lanes, shares in per_node.items()},
        "cases": cases,
        "rows": rows,
    }
