"""Sharded streams: a stream that names its shards and reads any shard from any record on.

Such a stream (tar shards, the files of a Hugging Face streaming dataset, any list of files) is not partitioned by
the user: the loader deals the shards to the (rank, worker) pairs itself, counts how far each shard was *delivered*,
and on a restart at another world size or number of workers deals the unfinished shards out again, each from the
record it had reached, so no record is skipped or repeated.

An epoch's shards are dealt in the epoch's order (the listed order, or a permutation of (seed, epoch) with
shuffle=True): global worker g = rank * workers + worker reads every G-th unfinished shard, in that order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info


class ShardedStream(IterableDataset):
    """Base for streams the loader can repartition: `shards()` names them, `iter_shard(i, start)` reads shard i from
    record `start` on. Iterated on its own (e.g. by a plain DataLoader), each worker reads every N-th shard."""

    def shards(self) -> Sequence[str]:
        raise NotImplementedError

    def iter_shard(self, index: int, start: int) -> Iterator:
        raise NotImplementedError

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for index in range(worker, len(self.shards()), workers):
            yield from self.iter_shard(index, 0)


def is_sharded(dataset: object) -> bool:
    return callable(getattr(dataset, "shards", None)) and callable(getattr(dataset, "iter_shard", None))


def shard_digest(names: Sequence[str]) -> str:
    """Identifies the shard list: progress is per shard index, so it applies only to the same shards in the same
    listed order."""
    return hashlib.sha256("\n".join(map(str, names)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EpochShards:
    """One epoch's progress: shards read to their end, and how far the others were read (next record, > 0)."""

    done: frozenset = frozenset()
    offsets: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ShardProgress:
    """Global progress of a sharded stream: every epoch before `epoch` is finished; `epochs` holds the progress of
    epochs >= `epoch` that were started (the others start with every shard at record 0)."""

    count: int
    epoch: int = 0
    epochs: dict = field(default_factory=dict)

    def of(self, epoch: int) -> EpochShards:
        return self.epochs.get(epoch, EpochShards())


@dataclass(frozen=True)
class ShardDeal:
    """Who reads what: the shards of an epoch dealt to G = world_size * workers global workers."""

    progress: ShardProgress
    world_size: int
    workers: int
    seed: int
    shuffle: bool

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.progress.count)
        return np.random.Generator(np.random.PCG64([self.seed, epoch, 0x5368617264])).permutation(self.progress.count)

    def remaining(self, epoch: int) -> list[tuple[int, int]]:
        """(shard, first record) of every unfinished shard of the epoch, in the epoch's order."""
        if epoch < self.progress.epoch:
            return []
        state = self.progress.of(epoch)
        return [(s, state.offsets.get(s, 0)) for s in self.order(epoch).tolist() if s not in state.done]

    def tasks(self, epoch: int, rank: int, worker: int) -> list[tuple[int, int]]:
        """The (shard, first record) list that worker `worker` of rank `rank` reads in the epoch, in order."""
        return self.remaining(epoch)[rank * self.workers + worker :: self.world_size * self.workers]


@dataclass(frozen=True)
class RankShards:
    """What one rank reports: its epoch, and per worker its committed position (task index, next record) or None
    (nothing read this epoch) or "ended" (every task read)."""

    rank: int
    epoch: int
    positions: list


def merge(deal: ShardDeal, ranks: list[RankShards]) -> ShardProgress:
    """The global progress committed by all ranks of one layout (every rank present, in any order)."""
    base = deal.progress
    epochs = {e: state for e, state in base.epochs.items()}
    first = base.epoch
    for epoch in range(base.epoch, max(r.epoch for r in ranks) + 1):
        state = base.of(epoch)
        done, offsets = set(state.done), dict(state.offsets)
        for r in ranks:
            for worker, position in enumerate(r.positions):
                if r.epoch < epoch or (r.epoch == epoch and position is None):
                    continue
                tasks = deal.tasks(epoch, r.rank, worker)
                if r.epoch > epoch or position == "ended":
                    read_to = len(tasks)
                else:  # (0, 0) names no task for a worker dealt none (a snapshot before its first batch)
                    read_to, offset = position
                    if read_to < len(tasks) and offset > tasks[read_to][1]:
                        offsets[tasks[read_to][0]] = offset
                for shard, _ in tasks[:read_to]:
                    done.add(shard)
                    offsets.pop(shard, None)
        if len(done) == base.count and first == epoch:
            first = epoch + 1
            epochs.pop(epoch, None)
        else:
            epochs[epoch] = EpochShards(frozenset(done), offsets)
    return ShardProgress(base.count, first, {e: s for e, s in epochs.items() if e >= first})
