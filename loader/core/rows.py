"""A batch whose samples are the rows of one tensor, and the collate that hands that tensor back without a copy.

Why: a source that reads a batch into one (n, ...) array (TokenSource, a Mixture of them) has its batch already
collated. Returned as a list of row views, torch's default_collate would torch.stack the rows back into a copy of
the very tensor they are views of: one more allocation and copy of the whole batch. `Rows` is such a list (every
consumer still sees a list of tensors, and default_collate still stacks it correctly), and `collate` returns its
tensor instead. The source decides (only it knows its rows are one tensor); the collate only recognises that, so
no per-dataset collate_fn is needed and a user's own collate_fn sees the same list as before.

Making the Rows costs ~8 us a batch (a tensor view per row, then freeing them), which the loader pays only to have
`collate` unwrap them again: a source may therefore also say how to read the tensor alone (`batch_reader`), which
the loader uses where it calls this collate itself (num_workers=0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import is_
from typing import Any

import torch
from torch.utils.data import default_collate

__all__ = ["Rows", "batch_reader", "collate"]


class Rows(list):
    """The rows of `batch` (shape (n, ...)) as a list of views (`batch.unbind(0)`), remembering `batch`.

    It is a list like any other: elements can be replaced, appended or removed. `collate` then notices that the
    list no longer is the rows of `batch` and stacks what it holds."""

    __slots__ = ("batch", "_views")

    def __init__(self, batch: torch.Tensor) -> None:
        views = batch.unbind(0)
        super().__init__(views)
        self.batch, self._views = batch, views

    def intact(self) -> bool:
        """Whether the list still holds exactly the views it was built with, in order (so `batch` is its stack)."""
        views = self._views
        return len(self) == len(views) and all(map(is_, self, views))

    def __reduce__(self) -> tuple[type, tuple]:
        """Pickled (to another process) as its tensor once, not as a row view each (each of which would carry the
        whole storage); a list changed since it was built pickles as the plain list it now is."""
        return (Rows, (self.batch,)) if self.intact() else (list, (list(self),))


def collate(data: Any) -> Any:
    """default_collate, except that an intact `Rows` is its tensor as is: stacking its rows would copy the tensor
    they are views of. A Rows changed since it was built (an element replaced, appended, removed) is collated
    from what it holds, as any list is."""
    if type(data) is Rows and data.intact():
        return data.batch
    return default_collate(data)


def batch_reader(dataset: object) -> Callable[[Sequence[int]], torch.Tensor] | None:
    """What `dataset.batch_reader()` returns, if it has that method: None, or a function of a batch's indices whose
    tensor is exactly `collate(dataset.__getitems__(indices))`, read without making the Rows first."""
    reader = getattr(dataset, "batch_reader", None)
    return reader() if callable(reader) else None
