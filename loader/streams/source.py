"""Where a stream is read: each worker process (the main process at num_workers=0) makes its batches itself, and
each batch leaves with its worker's state right after it. The main process keeps, per worker, the state after
the last batch it *delivered*, so the state at "k batches delivered" is exact however far the workers prefetched,
and a resume restores every worker there instead of replaying the stream.

A worker's state: its dataset's and its iterator's own states (StatefulDataLoader's protocol: `state_dict` /
`load_state_dict` on the dataset, or on the iterator its `__iter__` returns), its random states (torch, numpy,
random; in workers only, the main process's belong to the training), how many batches it made in the pass, and for
a sharded stream the task and record it reached. torch's workers run this unchanged: the loader hands torch this
source as the dataset (batch_size=None), and a worker_init_fn that tells each worker which state it resumes from.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch.utils.data._utils.worker as torch_worker
from torch._utils import ExceptionWrapper
from torch.utils.data import IterableDataset, get_worker_info

from loader.core.state import StateError
from loader.streams.filtered import SHARDED, Runs
from loader.streams.rng import RngWatch, rng_state, seed_like_torch, set_rng_state
from loader.streams.shards import ShardDeal
from loader.streams.state import BATCHES, DATASET, ENDED, ITERATOR, RNG, SHARD, RankStream, snapshot_of


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


# What torch's iterator yields for a stream, one per batch: (worker, snapshot, error, end, batch, records, filtered).
# `snapshot` is the worker's state right after the batch ("ended" once its stream is exhausted); `error` (a Raised),
# when making the batch raised (the batch is then consumed, not delivered); `end`, when no batch comes: the worker's
# stream ended after its last one; `records`, how many the batch holds (a worker's last may hold fewer), and
# `filtered`, the runs of records the loader's filter dropped before it (or before the end; None: none), named as
# `loader.streams.filtered` names them.
# A plain tuple: it pickles 3x faster than an object, and pin_memory passes through it.


@dataclass(frozen=True)
class Plan:
    """Where each worker of a new torch iterator starts: per logical worker, (origin, latest), where `origin` is its
    state when the pass began (None: a fresh copy of the dataset, seeded from `base_seed`) and `latest` its snapshot
    after the last batch delivered (None: none yet). torch's worker i runs logical worker (i + rotation) % N, so
    that torch's round robin continues after the worker that delivered last."""

    pass_id: int
    epoch: int
    base_seed: int | None
    rotation: int
    workers: tuple


class StreamSource(IterableDataset):
    """The dataset torch iterates for a stream: one (worker, snapshot, error, end, batch, records, filtered) per batch
    of the user's stream. With a filter (`keep(None, record)`), a batch is made of the next records it keeps: the
    records it drops are consumed before the batch's snapshot, so a resume never reads them again, nor evaluates the
    filter on them."""

    _live: _Batches | None  # the main process's pass (num_workers=0), which a new iterator may go on with

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None,
        drop_last: bool,
        collate_fn: Callable,
        num_workers: int,
        worker_init_fn: Callable | None,
        rank: int,
        deal: ShardDeal | None,
        keep: Callable[[None, Any], bool] | None = None,
    ) -> None:
        self.dataset, self.batch_size, self.drop_last, self.collate_fn = dataset, batch_size, drop_last, collate_fn
        self.num_workers, self.user_init, self.rank, self.deal = num_workers, worker_init_fn, rank, deal
        self.keep = keep
        self.plan: Plan | None = None  # set by the main process before torch makes an iterator
        self._worker, self._epoch, self._live = 0, 0, None

    def __repr__(self) -> str:  # torch names the dataset in its messages: the user's
        return repr(self.dataset)

    def init_worker(self, worker_id: int) -> None:
        """torch's worker_init_fn: become the logical worker of the plan, reseeded as that worker when resuming, then
        the user's worker_init_fn. WorkerInfo names the user's dataset and the logical id."""
        info, plan = get_worker_info(), self.plan
        assert info is not None, "torch calls its worker_init_fn in a worker"
        seed = info.seed
        if plan is not None:
            self._worker = (worker_id + plan.rotation) % self.num_workers
            base_seed = info.seed - worker_id if plan.base_seed is None else plan.base_seed
            seed = seed_like_torch(base_seed, self._worker)
        else:
            self._worker = worker_id
        torch_worker._worker_info = dataclasses.replace(info, id=self._worker, seed=seed, dataset=self.dataset)
        if self.user_init is not None:
            self.user_init(self._worker)

    def __iter__(self) -> Iterator:
        plan, self.plan = self.plan, None
        if plan is None:  # persistent workers going on to the next pass
            self._epoch += 1
            return self._open(self._epoch, -1, None, None)
        self._epoch = plan.epoch
        origin, latest = plan.workers[self._worker]
        live = self._live
        if live is not None and live.resumes(plan.pass_id, latest):  # main process: its live iterator is there
            return live
        return self._open(plan.epoch, plan.pass_id, origin, latest)

    # -- opening a worker's pass at a snapshot ------------------------------------------------------------------

    def _open(self, epoch: int, pass_id: int, origin: tuple | None, latest: tuple | None) -> _Batches:
        if self.deal is not None:
            batches = self._open_shards(epoch, pass_id, origin, latest)
        elif _holds_states(latest):
            iterator = _resumed(self.dataset, latest, self._worker, iter)
            _set_rng(latest)
            batches = _Batches(self, pass_id, iterator, iterator, latest[BATCHES])
        else:
            batches = self._open_at_origin(pass_id, origin)
            if latest is not None:
                batches.replay(latest[BATCHES])  # a stream without state: its worker reads up to there again
        if latest is not None and latest[ENDED]:
            batches.finished = True
        self._live = batches if get_worker_info() is None else None
        return batches

    def _open_at_origin(self, pass_id: int, origin: tuple | None) -> _Batches:
        """The pass as it began: the dataset as the previous pass left it (a dataset that is its own iterator gets
        that pass's iterator state, loaded after an __iter__, as StatefulDataLoader does), the random state of then,
        and a new __iter__ (which may reset the dataset, or draw)."""
        if origin is not None:
            _restored(self.dataset, origin, self._worker, iter)
        _set_rng(origin)
        iterator = iter(self.dataset)
        return _Batches(self, pass_id, iterator, iterator, 0)

    def _open_shards(self, epoch: int, pass_id: int, origin: tuple | None, latest: tuple | None) -> _Batches:
        assert self.deal is not None, "opened for a sharded stream only"
        tasks = self.deal.tasks(epoch, self.rank, self._worker)
        if latest is not None:
            _set_rng(latest)
            task, offset = latest[SHARD]
            batches = latest[BATCHES]
        else:
            _set_rng(origin)
            task, offset, batches = 0, tasks[0][1] if tasks else 0, 0
        reader = _ShardReader(self.dataset, tasks, task, offset)
        return _Batches(self, pass_id, reader, None, batches, reader)


def _holds_states(value: tuple | None) -> TypeGuard[tuple]:
    """A snapshot holds the stream's own states (its dataset's, its iterator's)."""
    return value is not None and (value[DATASET] is not None or value[ITERATOR] is not None)


def _resumed(dataset: Any, latest: tuple, worker: int, opened: Callable) -> Iterator:
    """The dataset's iterator where a worker's snapshot left it (StatefulDataLoader's protocol): the dataset's state
    loaded before its __iter__ (`opened`), the iterator's after."""
    if latest[DATASET] is not None:
        dataset.load_state_dict(copy.deepcopy(latest[DATASET]))
    iterator = opened(dataset)
    if latest[ITERATOR] is not None:
        if not is_stateful(iterator):  # not told apart on load unless __iter__ is a generator function
            raise StateError(
                f"the state holds an iterator state for worker {worker}, but the iterator "
                f"{type(dataset).__name__}.__iter__ returns ({type(iterator).__name__}) has no load_state_dict: "
                f"load a state saved by this stream"
            )
        iterator.load_state_dict(copy.deepcopy(latest[ITERATOR]))
    return iterator


def _restored(dataset: Any, origin: tuple, worker: int, opened: Callable) -> None:
    """The dataset as the previous pass left it: its state, and for a dataset that is its own iterator that pass's
    iterator state, loaded after an __iter__ (`opened`), as StatefulDataLoader does."""
    if origin[DATASET] is not None:
        dataset.load_state_dict(copy.deepcopy(origin[DATASET]))
    if origin[ITERATOR] is not None:
        previous = opened(dataset)
        if previous is dataset:
            previous.load_state_dict(copy.deepcopy(origin[ITERATOR]))


class _NotHere(Exception):
    """A dataset's __iter__ raised in the main process, where no worker_init_fn ran: its states cannot be tried."""


def _opened_here(dataset: Any) -> Iterator:
    try:
        return iter(dataset)
    except Exception as err:  # noqa: BLE001 - whatever the user's __iter__ raises outside its worker
        raise _NotHere from err


def check_loadable(dataset: Any, mine: RankStream) -> None:
    """Load each of a rank's snapshots that holds the stream's own states into a copy of the dataset, as its worker
    will: a state the dataset or its iterator refuses (its load_state_dict raises) is refused on load, naming the
    worker, not when the worker starts. Only the dataset can tell its states apart, so it is asked. Not tried here: a
    dataset that cannot be copied, or whose __iter__ raises outside its worker (their workers find out, as before).
    The main process's random states stay as they were (an __iter__ or a load may draw or set them)."""
    rng = rng_state()
    try:
        for name, snapshots, load in (("origins", mine.origins, _restored), ("workers", mine.workers, _resumed)):
            for worker, value in enumerate(map(snapshot_of, snapshots)):
                if not _holds_states(value):
                    continue
                try:
                    trial = copy.deepcopy(dataset)
                except Exception:  # noqa: BLE001 - whatever keeps the user's dataset from being copied
                    return
                try:
                    load(trial, value, worker, _opened_here)
                except _NotHere:
                    return
                except StateError as err:
                    raise StateError(f"the state of rank {mine.rank}: {name}[{worker}].iterator: {err}") from None
                except Exception as err:  # noqa: BLE001 - whatever the user's load_state_dict raises
                    field = (
                        "iterator"
                        if value[DATASET] is None
                        else "dataset"
                        if value[ITERATOR] is None
                        else ("dataset or .iterator")
                    )
                    raise StateError(
                        f"the state of rank {mine.rank}: {name}[{worker}].{field} is a state "
                        f"{type(dataset).__name__} cannot load ({type(err).__name__}: {str(err)[:120]}): load a "
                        f"state saved by this stream"
                    ) from None
    finally:
        set_rng_state(rng)


_ATOMS = frozenset((int, float, str, bool, type(None)))


def _frozen(state: Any) -> Any:
    """A copy the dataset can no longer change: its state_dict may return objects it goes on mutating. A flat dict
    of numbers and strings (the usual state) is copied shallowly, 10x faster than deepcopy."""
    if type(state) is dict and _ATOMS.issuperset(map(type, state.values())):
        return dict(state)
    return copy.deepcopy(state)


def standing(dataset: Any) -> tuple | None:
    """The snapshot of a main-process dataset before any pass of the loader: its own state, as it stands (a dataset's
    state is loaded before its __iter__, so it can be taken now). None for a dataset without state, and for one that
    is its own iterator (it defines __next__): its state is an iterator's, loaded after an __iter__, and exists only
    once an __iter__ ran."""
    if not is_stateful(dataset) or callable(getattr(type(dataset), "__next__", None)):
        return None
    return (0, False, _frozen(dataset.state_dict()), None, None, None)


def _set_rng(snapshot: tuple | None) -> None:
    if snapshot is not None and snapshot[RNG] is not None:
        set_rng_state(snapshot[RNG])


class _ShardReader:
    """A worker's records: its tasks (shard, first record) in order, from task `task` at record `offset`, keeping
    (task, next record) current as records are drawn. An error while opening or reading a shard fails the batch
    being made and consumes the rest of that shard (a shard that cannot be read would otherwise fail every batch
    after it); the worker goes on with its next shard."""

    _records: Iterator | None  # the current shard's, once opened

    def __init__(self, dataset: Any, tasks: list, task: int, offset: int) -> None:
        self.dataset, self.tasks, self.task, self.offset = dataset, tasks, task, offset
        self._records, self.done = None, not tasks

    def __iter__(self) -> _ShardReader:
        return self

    def __next__(self) -> Any:
        while not self.done:
            try:  # opening a shard may raise too (an iter_shard that opens its file at once): that shard failed
                if self._records is None:
                    self._records = iter(self.dataset.iter_shard(self.tasks[self.task][0], self.offset))
                record = next(self._records)
            except StopIteration:
                self._next_task()
                continue
            except Exception:
                self._next_task()
                raise
            self.offset += 1
            return record
        raise StopIteration

    def _next_task(self) -> None:
        self._records = None
        if self.task + 1 < len(self.tasks):
            self.task += 1
            self.offset = self.tasks[self.task][1]
        else:
            self.done = True


class _Batches:
    """One worker's pass: the stream's records made into batches here, each sent with the worker's snapshot. An
    error while drawing or collating consumes the batch (the stream moved past it) and travels in its place."""

    def __init__(
        self,
        source: StreamSource,
        pass_id: int,
        records: Iterator,
        iterator: Any,
        count: int,
        reader: _ShardReader | None = None,
    ) -> None:
        self.source, self.pass_id, self.iterator, self.reader = source, pass_id, iterator, reader
        # drawn through its __next__: islice would call iter() on it, which resets a dataset that is its own iterator.
        # Not iter(__next__, sentinel), which compares every record with the sentinel by `==` (element-wise on NumPy
        # arrays, so ambiguous); starmap compares nothing, and goes on after a record that raised
        self.records = itertools.starmap(records.__next__, itertools.repeat(()))
        self.count, self.finished, self.exhausted, self.clean = count, False, False, True
        self.dropped = Runs()  # the records the filter dropped while the batch being made was drawn
        self._pending: tuple | None = None
        # what a snapshot holds, decided once: a dataset that is its own iterator keeps its state once
        self._keeps_dataset = reader is None and iterator is not source.dataset and is_stateful(source.dataset)
        self._keeps_iterator = reader is None and is_stateful(iterator)
        self._rng = RngWatch() if get_worker_info() is not None else None  # the main process's are the training's

    def snapshot(self, ended: bool) -> tuple:
        """The worker's state now: what a new worker needs to go on from here (see `loader.streams.state.BATCHES`)."""
        reader = self.reader
        return (
            self.count,
            ended,
            _frozen(self.source.dataset.state_dict()) if self._keeps_dataset else None,
            _frozen(self.iterator.state_dict()) if self._keeps_iterator else None,
            None if reader is None else (reader.task, reader.offset),
            None if self._rng is None else self._rng.state(),
        )

    def resumes(self, pass_id: int, latest: tuple | None) -> bool:
        """Whether this live iterator (main process) stands exactly where `latest` does, so it can just go on."""
        return self.clean and pass_id == self.pass_id and self.count == (0 if latest is None else latest[BATCHES])

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> tuple:
        if self._pending is not None:
            message, self._pending = self._pending, None
            return message
        if self.finished:
            raise StopIteration
        self.clean = False  # until the batch is made: an interrupt in between leaves the stream somewhere unknown
        message = self._make()
        self.clean = True
        return message

    def _make(self) -> tuple:
        source, size = self.source, self.source.batch_size or 1
        try:
            items = self._draw(size) if not self.exhausted else []
            self.exhausted = len(items) < size  # the records ended (their end was drawn: a stream's last code ran)
            if not items or (source.drop_last and len(items) < size):
                self.finished = True
                return source._worker, self.snapshot(ended=True), None, True, None, 0, self.dropped.take()
            batch = source.collate_fn(items if source.batch_size is not None else items[0])
        except Exception as err:  # noqa: BLE001 - whatever the user's code raised fails this batch only
            # a shard reader whose last shard failed has nothing left: its snapshot must say so, or a resume would
            # read the rest of that shard, which this pass consumed
            self.exhausted = self.exhausted or (self.reader is not None and self.reader.done)
            return self._made(_wrap(err), None, 0)  # returned from here: no local keeps `err` (a cycle)
        return self._made(None, batch, len(items))

    def _draw(self, size: int) -> list:
        """The next `size` records the filter keeps (fewer where the stream ends), naming those it drops: a sharded
        stream's by (shard, record), a plain one's by (worker, batch, record of this draw)."""
        keep = self.source.keep
        if keep is None:
            return list(itertools.islice(self.records, size))
        items, reader = [], self.reader
        for drawn, record in enumerate(self.records):
            if not keep(None, record):
                if reader is None:
                    self.dropped.add(self.source._worker, self.count, drawn)
                else:
                    self.dropped.add(reader.tasks[reader.task][0], SHARDED, reader.offset - 1)
                continue
            items.append(record)
            if len(items) == size:
                break
        return items

    def _made(self, error: Raised | None, batch: Any, records: int) -> tuple:
        dropped = self.dropped.take()  # a failed batch's go with it: its records are consumed, none is named
        self.count += 1
        self.finished = self.exhausted  # a short last batch: the stream ended with it
        return (
            self.source._worker,
            self.snapshot(ended=self.exhausted),
            error,
            False,
            batch,
            records,
            dropped if error is None else None,
        )

    def replay(self, count: int) -> None:
        """Make `count` batches again, unseen: how a stream without state gets back to where its worker was."""
        while self.count < count and not self.finished:
            message = self._make()
            if message[3]:
                self._pending = message  # the stream ended before: its end is still news to the main process


class Raised:
    """The error that failed a batch, taken once by whoever raises it. Nothing else may keep it: its traceback keeps
    the frames that made the batch, and through them the message holding it, a cycle that would keep the iterator
    (and its workers) alive until the garbage collector ran."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | ExceptionWrapper) -> None:
        self.error: BaseException | ExceptionWrapper | None = error

    def take(self) -> BaseException | ExceptionWrapper | None:
        error, self.error = self.error, None
        return error


def _wrap(err: Exception) -> Raised:
    """In a worker, torch's ExceptionWrapper (the exception itself may not pickle); in the main process, itself."""
    info = get_worker_info()
    if info is None:
        return Raised(err)
    return Raised(ExceptionWrapper(exc_info=sys.exc_info(), where=f"in DataLoader worker process {info.id}"))
