"""The loaders under comparison, built the same way everywhere, and the loop that drives them as training does."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from loader import ResumableDataLoader

# StatefulDataLoader calls the deprecated torch.set_vital on every construction: one warning per run is noise.
warnings.filterwarnings("ignore", message=".*set_vital.*")


def ours(dataset, **kwargs: Any) -> ResumableDataLoader:
    """Our loader at a fixed seed, as one rank of one unless told otherwise (no torch.distributed here)."""
    return ResumableDataLoader(dataset, seed=0, **{"rank": 0, "world_size": 1, **kwargs})


@dataclass(frozen=True)
class Candidate:
    """A loader as users run it: `checkpoint` calls state_dict() after every step, as a resumable loop does."""

    name: str
    make: Callable[..., DataLoader]
    checkpoint: bool


TORCH = Candidate("DataLoader", DataLoader, False)
OURS = Candidate("ResumableDataLoader", ours, False)
OURS_CHECKPOINTING = Candidate("ResumableDataLoader+state_dict", ours, True)
STATEFUL_CHECKPOINTING = Candidate("StatefulDataLoader+state_dict", StatefulDataLoader, True)
CANDIDATES = (TORCH, OURS, OURS_CHECKPOINTING, STATEFUL_CHECKPOINTING)


def steps(loader: DataLoader, checkpoint: bool) -> Iterator[Any]:
    """The loader's batches; with `checkpoint`, state_dict() is taken once the consumer is done with each one."""
    for batch in loader:
        yield batch
        if checkpoint:
            loader.state_dict()


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: a tensor, or a tuple/list/dict of per-field tensors or lists."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    elif isinstance(batch, (tuple, list)):
        batch = batch[0]
    return len(batch)
