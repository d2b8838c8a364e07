"""MosaicML Streaming: StreamingDataset on local MDS shards, through its StreamingDataLoader.

It reads the rank from RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, so every simulated rank is a process
(`ranks.launch`: one node, all ranks local). Under data parallelism rank 0's StreamingDataLoader.state_dict() is
saved (it counts rank 0's samples x world size) and every rank loads it.

Its package imports `streaming.vision`, hence torchvision, at import time; the only torchvision on the package
index for this CPU torch is a CUDA build whose operators fail to load. Where `import streaming` fails on
torchvision alone, `streaming.base` (the dataset, writer and loader) is imported without the package's __init__:
nothing measured here needs torchvision.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from types import ModuleType

from benchmarks.peers.phase import RankZero
from benchmarks.peers.samples import SEED, decode, item

SAMPLES_PER_SHARD = 4096
_INT_BYTES = 12  # an MDS "int" sample: 8 bytes and a 4-byte offset


def _streaming() -> ModuleType:
    """`streaming`, or `streaming.base` where the package's own __init__ fails for want of torchvision."""
    try:
        return importlib.import_module("streaming")
    except ModuleNotFoundError as err:
        if err.name != "torchvision":
            raise
    for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
        del sys.modules[name]
    package = types.ModuleType("streaming")
    package.__path__ = list(importlib.util.find_spec("streaming").submodule_search_locations)
    sys.modules["streaming"] = package
    return importlib.import_module("streaming.base")


streaming = _streaming()


class _Decoded(streaming.StreamingDataset):
    """JPEG samples decoded in __getitem__, as its documentation has transforms added."""

    def __getitem__(self, at):
        return {"i": decode(super().__getitem__(at)["i"])}


def _loader(data, batch: int, workers: int = 0, kind: str = "index"):
    dataset = (streaming.StreamingDataset if kind == "index" else _Decoded)(
        local=str(data), shuffle=True, shuffle_seed=SEED, batch_size=batch
    )
    return streaming.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)


class Mosaic(RankZero):
    _loader = staticmethod(_loader)
    saves = "rank 0's StreamingDataLoader.state_dict() (rank 0's count x world size); every rank loads it"

    def prepare(self, n, data, kind="index") -> None:
        """MDS shards of about SAMPLES_PER_SHARD index samples (JPEG samples: its default 64 MB shards)."""
        limit = {"size_limit": SAMPLES_PER_SHARD * _INT_BYTES} if kind == "index" else {}
        with streaming.MDSWriter(out=str(data), columns={"i": "int" if kind == "index" else "bytes"}, **limit) as w:
            for i in range(n):
                w.write({"i": item(kind, i)})

    def _moved(self, state: dict, position: int) -> dict:
        state["sample_in_epoch"] = position
        return state


PEER = Mosaic()
