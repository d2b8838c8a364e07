"""Progress of a plain IterableDataset: the best guarantee a stream without random access allows.

A stream cannot be repartitioned, so its progress is (epoch, batches delivered in completed updates) for one rank,
restorable only at the same world size. Resuming replays the stream and discards what was already committed.
When the dataset has its own `state_dict`/`load_state_dict` and is read in this process (num_workers == 0), its
state is snapshotted at each completed update and restored instead, so resuming costs no replay.
"""

from __future__ import annotations

import copy

from loader._checks import is_int
from loader.state import StateError, stream_state, stream_state_for


def is_stateful(dataset) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class StreamProgress:
    def __init__(self, dataset, world_size: int, rank: int, grad_accum: int, snapshots: bool):
        self.dataset, self.world_size, self.rank, self.grad_accum = dataset, world_size, rank, grad_accum
        self.snapshots = snapshots and is_stateful(dataset)
        self._set(epoch=0, delivered=0, finished=False, snapshot=None)

    def _set(self, epoch: int, delivered: int, finished: bool, snapshot) -> None:
        self.epoch, self.delivered, self.finished = epoch, delivered, finished
        self._snapshot = snapshot  # (batches, dataset state) at the last completed update, or None

    @property
    def ended(self) -> bool:
        return self.finished

    @property
    def delivered_any(self) -> bool:
        return self.delivered > 0 or self.epoch > 0

    def set_epoch(self, epoch: int) -> bool:
        """Another epoch starts from its beginning; returns whether anything changed."""
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch == self.epoch:
            return False
        self._set(epoch, 0, False, None)
        return True

    def begin_pass(self) -> int:
        """Start or continue a pass; returns how many batches of the stream to discard before delivering."""
        if self.finished:
            self._set(self.epoch + 1, 0, False, None)
        if self._snapshot is None:
            return self.delivered
        batches, dataset_state = self._snapshot
        self.dataset.load_state_dict(copy.deepcopy(dataset_state))
        return self.delivered - batches

    def deliver(self) -> None:
        self.delivered += 1
        if self.snapshots and self.delivered % self.grad_accum == 0:
            self._snapshot = (self.delivered, copy.deepcopy(self.dataset.state_dict()))

    def end_pass(self) -> None:
        self.finished = True

    @property
    def completed(self) -> int:
        return self.delivered if self.finished else self.delivered - self.delivered % self.grad_accum

    def state_dict(self) -> dict:
        completed = self.completed
        dataset_state = None
        if self._snapshot is not None and self._snapshot[0] == completed:
            dataset_state = self._snapshot[1]
        return stream_state(self.world_size, self.rank, self.epoch, completed, self.finished, dataset_state)

    def load_state_dict(self, state) -> None:
        mine = stream_state_for(state, self.world_size, self.rank)
        finished = mine.get("finished")
        dataset_state = mine.get("dataset")
        if not isinstance(finished, bool):
            raise StateError(f"state.finished of rank {self.rank} must be a bool, got {finished!r}")
        if dataset_state is not None and not is_stateful(self.dataset):
            raise StateError(
                f"the state of rank {self.rank} holds a dataset state, but {type(self.dataset).__name__} has no "
                f"load_state_dict: construct the loader with the dataset class that saved it"
            )
        snapshot = None if dataset_state is None else (mine["batches"], dataset_state)
        self._set(mine["epoch"], mine["batches"], finished, snapshot)
