"""The systems compared, in table order, and loading their adapters: one that will not import is reported with
its error, never dropped."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from benchmarks.peers.phase import Peer, error_text, version


@dataclass(frozen=True)
class System:
    key: str  # its adapter, benchmarks/peers/<key>.py
    name: str
    distribution: str  # the installed package whose version is reported
    note: str = ""  # what its defaults do to the table, in words
    drops: str = "nothing"  # what it leaves out of an uninterrupted epoch by design (the "no restart" skips)

    @property
    def module(self) -> str:
        return f"benchmarks.peers.{self.key}"

    def load(self) -> Peer:
        return importlib.import_module(self.module).PEER


TAIL = "the epoch's last partial global batch (N mod the global batch)"
SYSTEMS = (
    System(
        "torch_skip",
        "DataLoader + DistributedSampler, skip k batches",
        "torch",
        'DistributedSampler pads the epoch to a multiple of W with repeats (the "no restart" duplicates)',
        "nothing; pads to a multiple of W with repeats",
    ),
    System(
        "stateful",
        "torchdata StatefulDataLoader",
        "torchdata",
        "StatefulDistributedSampler pads as DistributedSampler does",
        "nothing; pads as DistributedSampler",
    ),
    System(
        "mosaic",
        "MosaicML Streaming",
        "mosaicml-streaming",
        "pads each rank's share to equal length with repeats",
        "nothing; pads each rank's share with repeats",
    ),
    System(
        "lit",
        "LitData",
        "litdata",
        "drop_last defaults to True under torch.distributed: the epoch's 16-sample tail (10,000 mod 48 at "
        'quick size) is dropped at every W, the "no restart" skips; a new world size, batch size or number of '
        "workers is resumed by re-splitting the rest (its elastic resume)",
        TAIL + ": drop_last=True, its default",
    ),
    System(
        "lit_keep",
        "LitData, drop_last=False",
        "litdata",
        "as LitData, with drop_last=False: the tail is served (it warns that ranks may then run unequal numbers "
        "of batches)",
    ),
    System(
        "grain_index",
        "Grain",
        "grain",
        'ShardOptions(drop_remainder=False); the "no restart" skips are its own tail handling (cause not traced)',
        "1 sample at W=3, 4 at W=6 (its tail handling, cause not traced)",
    ),
    System(
        "grain_elastic",
        "Grain ElasticIterator",
        "grain",
        "grain.experimental.ElasticIterator(MapDataset.range(N).shuffle(seed), global_batch, ShardOptions): each "
        "rank batches its share with drop_remainder=True",
        TAIL + ": drop_remainder=True",
    ),
    System(
        "energon",
        "Megatron Energon",
        "megatron-energon",
        "shuffle_buffer_size=100, max_samples_per_sequence=100 (its save/restore example), one epoch "
        "(repeat=False; training datasets repeat by default)",
    ),
    System(
        "olmo",
        "OLMo-core",
        "ai2-olmo-core",
        "NumpyFSLDataLoader over a NumpyFSLDataset of 2-token instances, dp_rank / dp_world_size, on CPU; resumes "
        "at tokens_processed // the global batch in tokens",
        TAIL + ": the order is cut to whole global batches",
    ),
    System("ours", "loader (ours)", "loader"),
)
OURS = SYSTEMS[-1]


def load_all() -> tuple[dict[str, Peer], dict[str, str]]:
    """The adapters that import (by key), and the error of each one that does not."""
    peers, errors = {}, {}
    for system in SYSTEMS:
        try:
            peers[system.key] = system.load()
        except Exception as err:  # not installed, or broken here: reported with its error
            errors[system.key] = error_text(err)
    return peers, errors


def versions() -> dict[str, str]:
    """Every compared package's version (and their shared dependencies'), for the report."""
    names = [s.distribution for s in SYSTEMS] + ["numpy", "pillow", "transformers", "torchvision"]
    return {name: version(name) for name in dict.fromkeys(names)}
