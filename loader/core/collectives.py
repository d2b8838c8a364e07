"""The few collectives the checkpoint, the ledger and the sources need, each a no-op in a single process.

Why one place: every rank must call them in the same order, and a job without torch.distributed (one process,
tests, offline tools) must run the same code unchanged.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if distributed() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if distributed() else 1


def global_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global rank of each member of the group, in the group's rank order."""
    if not distributed():
        return [0]
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def all_gather(value: Any, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's value, in rank order, on every rank."""
    if not distributed():
        return [value]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of the group got here."""
    if distributed():
        dist.barrier(group=group)


def broadcast(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's value on every rank of the group (src is a global rank, hence the translation)."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]


def from_rank0(compute: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """compute() run on rank 0, its value on every rank of the group. An exception it raises is raised on every
    rank: raised on rank 0 alone, it would leave the others waiting in the broadcast until the group's timeout."""
    outcome, error = None, None
    if rank(group) == 0:
        try:
            outcome = (True, compute())
        except Exception as err:  # noqa: BLE001 - handed to every rank, raised there
            outcome, error = (False, _portable(err)), err
    ok, value = broadcast(outcome, group)
    if not ok:
        raise error or value
    return value


def _portable(err: Exception) -> Exception:
    """`err` if it survives the broadcast's pickling as itself, else a RuntimeError with its type and message: an
    exception whose constructor takes other arguments than its message would fail to unpickle on the other ranks
    (or to pickle on rank 0, leaving them waiting), and they must raise rank 0's error, not that one."""
    try:
        if type(pickle.loads(pickle.dumps(err))) is type(err):
            return err
    except Exception:  # noqa: BLE001 - any failure of the round trip: send the text instead
        pass
    return RuntimeError(f"on rank 0: {type(err).__name__}: {err}")
