"""Filters: a deterministic predicate that drops samples where they are read, in the worker that reads them.

Why there: progress lives in position space, and a filtered position is consumed like any other (its sample
recorded as "filtered by policy", not trained). So the filter changes no order, plan or state, every kept sample is
trained exactly once at any world size, and a resume starts at its position in O(1): the predicate is never
evaluated again for what was already consumed. Its verdicts travel with the batch they belong to (a `Sifted`), which
the loader unwraps before it delivers the batch and records it; a predicate that raises fails its batch, as a
dataset's or a collate_fn's error does.

The batch holds the kept samples only (`REMOVED`: shorter, and empty when every member was filtered), or every
member with the verdicts beside it (`MASKED`: fixed shapes, e.g. LM rows, for a loop that zeroes the loss of the
filtered rows). A batch is never refilled from later positions: its members would then depend on data beyond its
positions, and the same global batch at any world size, which the loader keeps, would be lost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from loader.core.rows import Rows

REMOVED, MASKED = "removed", "masked"  # what a batch does with its filtered members


class Sifted:
    """A collated batch and, per member in order, whether the filter kept it: what a worker hands back."""

    __slots__ = ("batch", "kept")

    def __init__(self, batch: Any, kept: np.ndarray):
        self.batch, self.kept = batch, kept

    def pin_memory(self) -> Sifted:
        """torch's pin-memory thread pins what this holds (it calls this method of an object it does not know)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return Sifted(pin_memory(self.batch), self.kept)


class Sifting:
    """The dataset as the loader's workers read it under a filter: reads a batch's samples (through the dataset's
    `__getitems__` when it has one), asks `keep(index, sample)` of each, and collates the batch itself, so torch's
    own fetcher hands back a `Sifted`.

    Attributes other than its own are the dataset's, read and written: a worker_init_fn that configures
    `get_worker_info().dataset` configures the dataset."""

    __slots__ = ("dataset", "keep", "collate_fn", "filtered")

    def __init__(self, dataset: Any, keep: Callable[[int, Any], bool], collate_fn: Callable, filtered: str) -> None:
        for name, value in zip(Sifting.__slots__, (dataset, keep, collate_fn, filtered)):
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name in Sifting.__slots__ or name.startswith("__"):  # not set yet (unpickling), or a protocol's probe
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self.dataset, name, value)

    def __getstate__(self) -> tuple:
        return tuple(object.__getattribute__(self, name) for name in Sifting.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(Sifting.__slots__, state):
            object.__setattr__(self, name, value)

    def __getitems__(self, indices: Sequence[int]) -> Sifted:
        read = getattr(self.dataset, "__getitems__", None)
        samples = read(indices) if read else [self.dataset[i] for i in indices]
        kept = np.fromiter((bool(self.keep(i, s)) for i, s in zip(indices, samples)), bool, len(indices))
        if self.filtered == MASKED or kept.all():
            return Sifted(self.collate_fn(samples), kept)
        if kept.any():
            return Sifted(self.collate_fn(_members(samples, kept)), kept)
        return Sifted(emptied(self.collate_fn(_members(samples, np.arange(len(kept)) == 0))), kept)


def _members(samples: Sequence, kept: np.ndarray) -> list:
    """The kept samples, in order; of a `Rows`, a `Rows` of the kept rows of its tensor (one index, no stack)."""
    if type(samples) is Rows and samples.intact():
        return Rows(samples.batch[torch.from_numpy(kept)])
    return [sample for sample, keep in zip(samples, kept) if keep]


def emptied(batch: Any) -> Any:
    """A collated batch with none of its members: what a batch whose every member was filtered is delivered as, with
    the structure, dtypes and trailing shapes of a batch of the same samples (a model's forward runs on it, so every
    rank still takes part in the step's collectives). Tensors and arrays lose their rows; mappings and tuples or lists
    of them are emptied member by member; a list of plain values (default_collate's strings) becomes empty."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0]
    if isinstance(batch, Mapping):
        return {key: emptied(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        if not all(isinstance(value, (torch.Tensor, np.ndarray, Mapping, tuple, list)) for value in batch):
            return type(batch)() if type(batch) in (tuple, list) else []
        if hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*map(emptied, batch))
        return type(batch)(map(emptied, batch))
    raise TypeError(
        f"filter= kept no member of a batch, and collate_fn's batch ({type(batch).__name__}) cannot be made empty: "
        f"return tensors, arrays, or mappings, tuples or lists of them from collate_fn, or pass filtered='masked' "
        f"to keep every batch's members (and its shape) with the filter's verdicts in loader.last_kept()"
    )
