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

    @property
    def module(self) -> str:
        return f"benchmarks.peers.{self.key}"

    def load(self) -> Peer:
        return importlib.import_module(self.module).PEER


SYSTEMS = (
    System("torch_skip", "DataLoader + DistributedSampler, skip k batches", "torch"),
    System("stateful", "torchdata StatefulDataLoader", "torchdata"),
    System("mosaic", "MosaicML Streaming", "mosaicml-streaming"),
    System("lit", "LitData", "litdata"),
    System("grain_index", "Grain", "grain"),
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
