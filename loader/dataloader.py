"""ResumableDataLoader: torch's DataLoader, driven by a resumable rank sampler, counting what it delivers.

Workers, pinning, prefetching and collation stay torch's own. The loader replaces only the order (a lazy batch
sampler over the committed progress) and counts a batch when `next()` hands it to the caller, never when a worker
fetched it. With in-order delivery, the k-th batch out is the k-th index list in, so the count is exact.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from loader._checks import check_positive_int, check_rank, is_int
from loader.order import Order, block_sizes_for_window, sample_seed
from loader.partition import Layout
from loader.sampler import ResumableSampler
from loader.stream import StreamProgress


class SampleIndex(int):
    """A dataset index that also carries its per-sample seed, derived from (seed, epoch, index) alone.

    It is an int, so datasets that ignore the seed work unchanged; augmentations read `index.seed`."""

    seed: int

    def __new__(cls, index: int, seed: int) -> "SampleIndex":
        obj = super().__new__(cls, index)
        obj.seed = seed
        return obj

    def __getnewargs__(self) -> tuple[int, int]:
        return int(self), self.seed


class _WithSampleSeeds:
    """Index lists -> lists of SampleIndex, for datasets that asked for per-sample seeds."""

    def __init__(self, sampler: ResumableSampler, seed: int):
        self.sampler, self.seed = sampler, seed

    def __iter__(self) -> Iterator[list[SampleIndex]]:
        self.sampler.begin_pass()  # the epoch of the pass about to start, whose seeds these are
        epoch = self.sampler.epoch
        for batch in self.sampler:
            seeds = sample_seed(self.seed, epoch, np.asarray(batch, dtype=np.int64)).tolist()
            yield list(map(SampleIndex, batch, seeds))

    def __len__(self) -> int:
        return len(self.sampler)


class _RankIndices:
    """`loader.sampler`: this rank's dataset indices in delivery order, for code written against DistributedSampler
    (`loader.sampler.set_epoch(e)`, `len(loader.sampler)` in samples). With batch_size=None torch iterates it too,
    taking one index per delivered item."""

    def __init__(self, batches, sampler: ResumableSampler):
        self._batches, self._sampler = batches, sampler

    def __iter__(self) -> Iterator[int]:
        for batch in self._batches:
            yield from batch

    def __len__(self) -> int:
        return self._sampler.samples_in_next_pass()

    def set_epoch(self, epoch: int) -> None:
        self._sampler.set_epoch(epoch)


class _Delivery:
    """The iterator handed to the training loop: counts a batch at the moment it is returned.

    Only the newest iterator of a loader may deliver: an older one would count batches into the same progress
    twice over (and, with persistent workers, would read from the newest one's reset worker iterator)."""

    def __init__(
        self,
        inner,
        on_deliver: Callable[[], None],
        is_current: Callable[[], bool],
        on_end: Callable[[], None] | None = None,
        skip: int = 0,
    ):
        self._inner, self._on_deliver, self._is_current, self._on_end = inner, on_deliver, is_current, on_end
        self._skip = skip

    def __iter__(self) -> "_Delivery":
        return self

    def __next__(self):
        if not self._is_current():
            raise RuntimeError(
                "this iterator was superseded by a newer iter() over the same ResumableDataLoader: progress counts "
                "what one iterator delivers, so iterate the newest one (it continues where this one stopped)"
            )
        try:
            while self._skip:  # a stream without random access: replay what was already delivered, unseen
                next(self._inner)
                self._skip -= 1
            batch = next(self._inner)
        except StopIteration:
            if self._on_end is not None:
                self._on_end()
            raise
        self._on_deliver()
        return batch


def _default_rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    check_positive_int("world_size", world_size)
    check_rank(rank, world_size)
    return rank, world_size


def _order_for(dataset, shuffle: bool, seed: int, shuffle_blocks) -> Order:
    num_samples = len(dataset)
    if not shuffle:
        if shuffle_blocks is not None:
            raise ValueError("shuffle_blocks needs shuffle=True")
        return Order(num_samples, seed, "none")
    if shuffle_blocks is None:
        return Order(num_samples, seed, "global")
    if is_int(shuffle_blocks):
        shuffle_blocks = block_sizes_for_window(num_samples, shuffle_blocks)
    return Order(num_samples, seed, "blocks", tuple(int(size) for size in shuffle_blocks))


class ResumableDataLoader(DataLoader):
    """A drop-in torch DataLoader whose input progress survives restarts at any world size.

    Beyond DataLoader's arguments: `seed` (the order is a pure function of seed, epoch and position), `rank` and
    `world_size` (default: torch.distributed's, else 0 and 1; no DistributedSampler needed), `grad_accum` (only
    whole optimizer updates count as progress), `shuffle_blocks` (shuffle blocks of indices, e.g. shards, then
    inside each block: an int window or a list of block sizes) and `sample_seeds` (the dataset receives
    `SampleIndex` ints carrying a per-sample seed).

    A new `iter()` continues the current epoch right after the last delivered batch; after a finished pass it
    starts the next epoch. Call `state_dict()` after the optimizer step; it reports completed updates only.
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler=None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        grad_accum: int = 1,
        shuffle_blocks: int | list[int] | None = None,
        sample_seeds: bool = False,
    ):
        if sampler is not None or batch_sampler is not None:
            raise ValueError(
                "ResumableDataLoader owns the order so that it can resume it: pass shuffle=, seed= and "
                "shuffle_blocks= instead of sampler= or batch_sampler= (no DistributedSampler is needed either). "
                "A framework that injects a DistributedSampler must be told not to: Lightning with "
                "Trainer(use_distributed_sampler=False), accelerate by leaving the loader out of prepare()"
            )
        if not in_order:
            raise ValueError("in_order=False delivers batches out of order, so delivered progress would have holes")
        if batch_size is not None and (not is_int(batch_size) or batch_size <= 0):
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
        if not is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        rank, world_size = _default_rank_and_world(rank, world_size)
        layout = Layout(world_size, grad_accum, batch_size or 1, bool(drop_last))
        common = dict(
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )
        self.seed, self.rank, self.world_size, self.grad_accum = seed, rank, world_size, grad_accum
        self.ledger = None  # a loader.ledger.Ledger records every delivered batch's indices when attached
        self._iterations = 0  # iter() calls so far: only the newest iterator delivers
        if isinstance(dataset, IterableDataset):
            if sample_seeds or shuffle_blocks is not None:
                raise ValueError("sample_seeds and shuffle_blocks need a map-style dataset (random access)")
            self.resumable_sampler = None
            self._stream = StreamProgress(dataset, world_size, rank, grad_accum, snapshots=num_workers == 0)
            super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, **common)
            return
        self._stream = None
        self.resumable_sampler = ResumableSampler(_order_for(dataset, bool(shuffle), seed, shuffle_blocks), layout, rank)
        indices = _WithSampleSeeds(self.resumable_sampler, seed) if sample_seeds else self.resumable_sampler
        rank_indices = _RankIndices(indices, self.resumable_sampler)
        if batch_size is None:
            super().__init__(dataset, batch_size=None, sampler=rank_indices, **common)
        else:
            super().__init__(dataset, batch_sampler=indices, **common)
            object.__setattr__(self, "batch_size", batch_size)  # what the user asked for, as DataLoader reports it
            object.__setattr__(self, "drop_last", bool(drop_last))
            object.__setattr__(self, "sampler", rank_indices)  # torch's placeholder would have no set_epoch

    # -- iteration -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._iterations += 1
        iteration = self._iterations

        def is_current() -> bool:
            return self._iterations == iteration

        if self._stream is not None:
            if self.ledger is not None:
                raise TypeError("a ledger records sample indices, which an IterableDataset does not have")
            skip = self._stream.begin_pass()
            return _Delivery(super().__iter__(), self._stream.deliver, is_current, self._stream.end_pass, skip)
        self.resumable_sampler.begin_pass()
        return _Delivery(super().__iter__(), self._deliver, is_current)

    def _deliver(self) -> None:
        self.resumable_sampler.deliver()
        if self.ledger is not None:
            self.ledger.record(self.epoch, self.last_indices(), self.update_complete)

    def __len__(self) -> int:
        if self._stream is not None:
            return super().__len__()
        return len(self.resumable_sampler)

    @property
    def epoch(self) -> int:
        return (self._stream or self.resumable_sampler).epoch

    def set_epoch(self, epoch: int) -> None:
        """Same epoch: no change (safe to call after a resume). Another epoch: start it from its beginning."""
        (self._stream or self.resumable_sampler).set_epoch(epoch)

    @property
    def exhausted(self) -> bool:
        """True when this rank has delivered its whole share of the current epoch: a new pass starts the next."""
        return self._stream.finished if self._stream is not None else self.resumable_sampler.exhausted

    @property
    def update_complete(self) -> bool:
        """True when the batch just delivered completes an optimizer update (grad_accum micro-batches, or the
        epoch's final, shorter update): step the optimizer, then checkpoint."""
        if self._stream is not None:
            return self._stream.delivered > 0 and self._stream.completed == self._stream.delivered
        return self.resumable_sampler.update_complete

    def last_indices(self) -> np.ndarray:
        """Dataset indices of the batch just delivered: the identity of every sample the training loop saw."""
        if self._stream is not None:
            raise TypeError("an IterableDataset has no sample indices; use a map-style dataset for sample identity")
        return self.resumable_sampler.last_indices()

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's progress in completed updates: small, plain Python types, JSON- and torch.save-able. Its
        `base` entry (the progress this run resumed from) is one shared dict, as modules share tensors: copy the
        state (copy.deepcopy) before editing it."""
        return (self._stream or self.resumable_sampler).state_dict()

    def load_state_dict(self, state) -> None:
        """A merged state (see `merge_states`) or the list of all ranks' states, saved at any world size.

        Validated in full first: a rejected state raises ValueError and leaves the loader unchanged."""
        (self._stream or self.resumable_sampler).load_state_dict(state)
