"""LitData: StreamingDataset + StreamingDataLoader on its optimized chunks, written with its BinaryWriter (what
`litdata.optimize` runs in each of its workers; optimize itself took 10x longer here for integer samples).

It reads the rank from torch.distributed, so every simulated rank is a process in a gloo group (`ranks.launch`).
Under data parallelism rank 0's StreamingDataLoader.state_dict() is saved (as Lightning Fabric does) and every
rank loads it.

The mixture case (`benchmarks.peers.capabilities`): a `CombinedStreamingDataset` of two sources, each written as
its own chunks (`samples.MIXTURE`), with its defaults (`iterate_over_all=True`: sampled by the sources' lengths
until every sample was served once).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import litdata
from litdata.streaming.writer import BinaryWriter

from benchmarks.peers.phase import RankZero
from benchmarks.peers.samples import MIXTURE, SEED, decode, item, mixture_sources

SAMPLES_PER_CHUNK = 4096


class _Decoded(litdata.StreamingDataset):
    """JPEG samples decoded in __getitem__, as its documentation has transforms added."""

    def __getitem__(self, index):
        return {"i": decode(super().__getitem__(index)["i"])}


def _loader(
    data, batch: int, workers: int = 0, kind: str = "index", drop_last: bool | None = None
) -> litdata.StreamingDataLoader:
    """drop_last=None is its default: True under torch.distributed (the epoch's tail is dropped at every W)."""
    dataset = (litdata.StreamingDataset if kind == "index" else _Decoded)(
        str(data), shuffle=True, seed=SEED, drop_last=drop_last
    )
    return litdata.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)


def _write(data: Path, samples: Iterable[int], kind: str = "index") -> None:
    """Chunks of the samples, in its format: sample i's item under "i"."""
    writer = BinaryWriter(str(data), chunk_size=SAMPLES_PER_CHUNK)
    for index, i in enumerate(samples):
        writer[index] = {"i": item(kind, i)}
    writer.done()
    writer.merge()


def _mixture(data, batch: int, workers: int = 0, kind: str = "index") -> litdata.StreamingDataLoader:
    sources = [litdata.StreamingDataset(str(data / name), shuffle=True, seed=SEED) for name in MIXTURE]
    return litdata.StreamingDataLoader(
        litdata.CombinedStreamingDataset(sources, seed=SEED), batch_size=batch, num_workers=workers
    )


class Lit(RankZero):
    _loader = staticmethod(_loader)
    saves = "rank 0's StreamingDataLoader.state_dict(); every rank loads it"

    def prepare(self, n, data, kind="index") -> None:
        _write(data, range(n), kind)

    def _moved(self, state: dict, position: int) -> dict:
        state["num_samples_yielded"] = state["dataset"]["num_samples_yielded"] = position
        state["dataset"]["sample_in_epoch"] = position
        return state


class LitMixture(Lit):
    _loader = staticmethod(_mixture)

    def prepare(self, n, data, kind="index") -> None:
        for name, ids in zip(MIXTURE, mixture_sources(n)):
            _write(data / name, ids, kind)


PEER, MIXED = Lit(), LitMixture()
