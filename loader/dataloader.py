"""ResumableDataLoader: torch's DataLoader, driven by a resumable rank sampler, counting what it delivers.

Workers, pinning, prefetching and collation stay torch's own (default_collate, except that a batch a source already
made as one tensor, a `loader.core.rows.Rows`, is that tensor rather than a stacked copy of it). The loader replaces
only the order (a lazy batch sampler over the committed progress) and counts a batch when `next()` hands it to the
caller, never when a worker fetched it. With in-order delivery, the k-th batch out is the k-th index list in, so the
count is exact.
"""

from __future__ import annotations

import copy
import copyreg
import pickle
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from time import perf_counter
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data
from numpy.typing import ArrayLike
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, IterableDataset, default_collate
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL
from torch.utils.data._utils.fetch import _MapDatasetFetcher
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data._utils.signal_handling import _remove_worker_pids, _set_worker_pids
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from loader.checkpoint.lockstep import LockstepWatch, warn_out_of_step
from loader.core.batch_policy import BatchPolicy
from loader.core.checks import check_positive_int, check_rank, is_int
from loader.core.collectives import all_gather
from loader.core.filtering import MASKED, REMOVED, Sifted, Sifting
from loader.core.mesh import data_parallel
from loader.core.order import Lanes, Order, block_sizes_for_window, sample_seed, worker_seed
from loader.core.partition import Layout
from loader.core.rows import batch_reader, collate
from loader.core.sampler import ResumableSampler
from loader.core.state import short
from loader.metrics import DataStallWarning, Monitor, batch_nbytes, stall_message
from loader.streams.filtered import count as count_dropped
from loader.streams.progress import StreamProgress
from loader.streams.shards import is_sharded

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.data import Dataset, Sampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from loader.checkpoint.ledger import Ledger


class SampleIndex(int):
    """A dataset index that also carries what the loader knows of it: its per-sample seed (`seed`, with
    sample_seeds=True), derived from (seed, epoch, index) alone, and the epoch of its batch (`epoch`, for a dataset
    that declares `epoch_aware = True`, e.g. a PackedSource, whose rows differ by epoch).

    It is an int, so datasets that ignore both work unchanged; augmentations read `index.seed`. Riding on the index,
    the epoch reaches whichever worker computes the batch (persistent or not, prefetching or not) as that batch's."""

    seed: int
    epoch: int
    plan: Any  # a dataset's plan that changed while its workers run (a Mixture's weights changed online)

    def __new__(cls, index: int, seed: int | None = None, epoch: int | None = None) -> SampleIndex:
        obj = super().__new__(cls, index)
        if seed is not None:
            obj.seed = seed
        if epoch is not None:
            obj.epoch = epoch
        return obj

    def __getnewargs__(self) -> tuple[int]:
        return (int(self),)  # the attributes travel in __dict__

    def carried_to(self, index: int) -> SampleIndex:
        """Another index with what this one carries: a mixture's index into one of its sources."""
        obj = int.__new__(type(self), index)
        obj.__dict__.update(self.__dict__)
        return obj


def carrying(
    batch: list[int], epoch: int, seed: int | None, epoch_aware: bool, plan: Any = None
) -> list[int] | list[SampleIndex]:
    """A batch of `epoch` as SampleIndex ints: with per-sample seeds when `seed` is given, with the epoch when the
    dataset is epoch-aware, with the dataset's `plan` when it has one to carry (a Mixture changed online). Plain
    ints when there is nothing to carry."""
    if seed is None and not epoch_aware and plan is None:
        return batch
    seeds = (
        [None] * len(batch)
        if seed is None
        else cast(np.ndarray, sample_seed(seed, epoch, np.asarray(batch, np.int64))).tolist()  # an array for an array
    )
    indices = list(map(SampleIndex, batch, seeds, [epoch if epoch_aware else None] * len(batch)))
    if plan is not None:  # one object for the batch: pickled once with it to a worker
        for index in indices:
            index.plan = plan
    return indices


class MixtureChange(NamedTuple):
    """Where an online change of a Mixture's weights applies (`ResumableDataLoader.change_mixture`)."""

    position: int  # the first mixture position under the new weights (loader epoch e: from e * len(mixture) on)
    step: int | None  # the step (as loader.step counts) whose update first trains a sample under them


def check_mixture(dataset: Any, order: Order) -> None:
    """Refuse an online change of weights (`change_mixture`) where the dataset is not a Mixture, or where loader
    positions are not mixture positions (lanes= spread them)."""
    if not callable(getattr(dataset, "change_weights", None)):
        raise TypeError(
            "change_mixture changes a loader.sources.Mixture's weights; this loader's dataset is "
            f"a {type(dataset).__name__}"
        )
    if order.lanes is not None:
        raise ValueError(
            "change_mixture needs loader positions that are mixture positions: lanes= spread them "
            "over the epoch; build the loader without lanes (shuffle=True leaves the order to the "
            "Mixture)"
        )


def planned_change(
    dataset: Any, weights: Sequence[float], step: int, epoch: int, position: int, num_samples: int
) -> Any:  # a Mixture's plan: loader.sources builds on the loader, not the loader on it
    """A Mixture's plan with `weights` from the first whole window at or after loader `position` of `epoch`, asked
    at `step`; None where the plan already recorded a request at that step or a later one (a step replayed after a
    restart or a failed commit: the recorded weights stand, never recomputed)."""
    requests = dataset.plan.requests
    if requests and step <= requests[-1][0]:
        return None
    if dataset.plan.epochs_continue:
        position += epoch * num_samples
    elif epoch > 0:
        raise ValueError(
            f"change_mixture in epoch {epoch} of a loader with shuffle=False, whose every epoch "
            f"serves the same positions (trained in epoch 0 under the weights of then): change the "
            f"weights online in epoch 0, or run the loader with shuffle=True (each epoch continues "
            f"the mixture's stream)"
        )
    return dataset.change_weights(weights, position, step)


class _Carrying:
    """Index lists -> lists of SampleIndex, for datasets that asked for per-sample seeds, take the epoch, or carry a
    plan that changes while the workers run (`carried_plan`, read as each batch is dispatched)."""

    def __init__(self, sampler: ResumableSampler, seed: int | None, epoch_aware: bool, carried: Callable | None):
        self.sampler, self.seed, self.epoch_aware, self.carried = sampler, seed, epoch_aware, carried

    def __iter__(self) -> Iterator[list[int] | list[SampleIndex]]:
        self.sampler.begin_pass()  # the epoch of the pass about to start, whose batches these are
        epoch = self.sampler.epoch
        for batch in self.sampler:
            yield carrying(batch, epoch, self.seed, self.epoch_aware, self.carried and self.carried())

    def __len__(self) -> int:
        return len(self.sampler)


class _Planned:
    """The batch sampler as torch iterates it, through the dataset's `planned(batches, in_flight)` hook when it has
    one: the order is known ahead, so a dataset can fetch what the next batches need (remote shards) before a
    worker asks. The hook must yield the batches unchanged."""

    def __init__(self, batches: _Carrying | ResumableSampler, planned: Callable, in_flight: int):
        self.batches, self.planned, self.in_flight = batches, planned, in_flight

    def __iter__(self) -> Iterator:
        return iter(self.planned(iter(self.batches), self.in_flight))

    def __len__(self) -> int:
        return len(self.batches)


class _RankIndices:
    """`loader.sampler`: this rank's dataset indices in delivery order, for code written against DistributedSampler
    (`loader.sampler.set_epoch(e)`, `len(loader.sampler)` in samples). With batch_size=None torch iterates it too,
    taking one index per delivered item."""

    def __init__(self, batches: _Carrying | ResumableSampler | _Planned, loader: ResumableDataLoader):
        # the loader weakly: it holds this as its sampler, and a cycle would leave the loader, and its persistent
        # workers, alive until the garbage collector happened to run. A sampler kept after its loader went answers
        # from the progress alone
        sampler = loader.resumable_sampler
        assert sampler is not None, "a map-style loader's (a stream's has no sampler): made after its sampler"
        self._batches, self._sampler, self._loader = batches, sampler, weakref.ref(loader)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        (self._sampler if loader is None else loader).set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        for batch in self._batches:
            yield from batch

    def __len__(self) -> int:
        loader = self._loader()
        return (self._sampler if loader is None else loader._next_pass()).samples_in_epoch()


class ContinuedPassWarning(UserWarning):
    """A new iter() continued a pass that an earlier iterator had left after delivering batches: they count as
    consumed, so a batch that was only looked at (`next(iter(loader))`) is never trained."""


# __init__ makes one of a loader's progress objects, for good: `_stream` for an IterableDataset, else
# `resumable_sampler`. A path of one kind (past a check of the other, or called for its kind only) asserts its own.
_MAP_STYLE = "a map-style dataset's loader: __init__ made its sampler"
_STREAM = "a stream's loader: __init__ made its StreamProgress, whose attach() made the source"
_EITHER = "__init__ made a stream's progress or a sampler"
_VERDICTS = "under a filter, each map-style batch comes with its verdicts (Sifted): none without one"
_NO_INDICES = np.zeros(0, np.int64)  # a stream's batch in the ledger: it counts its step, its records have no index
_INTERRUPTED = (
    "this iterator was interrupted inside next(): take a new iter(), which serves the interrupted batch again"
)
_WORKER_DIED = (
    "a worker process of this iterator died (torch raised it above): torch would go on past the batches "
    "that worker held, so the batches out would no longer be the index lists counted (a stream's pass "
    "would end without that worker's records). Take a new iter(), which starts new workers and serves "
    "every batch not delivered"
)
_CLOSED = (
    "the ResumableDataLoader was closed (close(), or the end of its with block) and this iterator's workers "
    "shut down: take a new iter(), which starts new workers and serves every batch not delivered"
)
_WORKER_INIT_FAILED = (
    "a worker's worker_init_fn raised (above): no batch failed, nothing was counted, and this "
    "iterator's workers are shut down. Take a new iter(), which starts new workers (running "
    "worker_init_fn again) and serves every batch not delivered"
)


class WorkerInitError(RuntimeError):
    """A loader's worker_init_fn raised in a worker. torch would hand that worker's first batch the error and each
    later one an UnboundLocalError (it has no fetcher), so batches whose data was never read would count as failed
    (a stream's worker would fail forever): a worker's start failing is the iterator's failure instead, and no batch
    is consumed.

    The error raised is also of the init's own exception type, as torch re-raises it (a class made of both, e.g.
    `WorkerInitError[ValueError]`): `except ValueError:` written for torch's DataLoader still catches it. Where
    that type cannot be one class with this one, cannot be made from a message, or cannot be imported by name in
    the main process (a local class), it is a WorkerInitError alone, as torch would make it a RuntimeError."""


class _InitErrorType(type):
    """The class of a WorkerInitError that is also the init's exception type (`original`). torch sends the worker's
    exception type to the main process by pickle, which finds a class by its name: this one travels as the original
    type, and the main process makes the same class of it."""

    original: type


_INIT_ERROR_TYPES: dict[type, _InitErrorType] = {}  # one class per original type, in each process


def _init_error_type(original: type) -> _InitErrorType:
    made = _INIT_ERROR_TYPES.get(original)
    if made is None:
        name = f"WorkerInitError[{original.__qualname__}]"
        made = _InitErrorType(
            name,
            (WorkerInitError, original),
            dict(
                __module__=__name__,
                __qualname__=name,
                original=original,
                __str__=BaseException.__str__,  # the message: the original's own may read fields a message does not set
            ),
        )
        _INIT_ERROR_TYPES[original] = made
    return made


copyreg.pickle(_InitErrorType, lambda made: (_init_error_type, (made.original,)))


def _init_error(original: type, message: str) -> WorkerInitError:
    """A WorkerInitError that is also an `original`, made the way torch will make it again in the main process
    (from the message alone), or a WorkerInitError alone where that cannot be done."""
    if issubclass(original, WorkerInitError):
        return WorkerInitError(message)
    try:
        made = _init_error_type(original)
        pickle.dumps(original)  # found by its name in the main process (a local class is not)
        return made(message=message) if getattr(made, "message", None) else made(message)
    except Exception:  # noqa: BLE001 - any type that cannot be one class with ours or made from a message
        return WorkerInitError(message)


def _dead_workers(iterator: object) -> list[int]:
    """The pids of a torch iterator's worker processes that died (an in-process iterator has none); a stream's worker
    that ended its stream exits, with status 0, and did not die."""
    return [worker.pid for worker in getattr(iterator, "_workers", ()) if worker.exitcode not in (None, 0)]


def _reports_a_death(error: BaseException) -> bool:
    """torch's ways of telling that a worker process died, by timing: it exited unexpectedly (noticed while waiting,
    or by torch's SIGCHLD handler: "DataLoader worker (pid ...)"), or its batch was cut off on the way (the
    connection to it reset or closed mid-message). Only for errors torch raised itself, never a batch's own."""
    return isinstance(error, (ConnectionError, EOFError)) or (
        isinstance(error, RuntimeError) and "DataLoader worker (pid" in str(error)
    )


class _WatchedWorkers(_MultiProcessingDataLoaderIter):
    """torch's iterator over worker processes, watched by torch's SIGCHLD handler only while this process waits for
    them. torch registers the workers' pids for their whole life, so the handler raised a worker's death wherever
    the main thread happened to be when the signal came: in the loader's own counting (a batch counted and never
    handed out), in the training step, in another loader's sampler, at interpreter exit. Waiting is where torch
    turns the death into its "exited unexpectedly" error, so that is the only place it can surface now; a worker
    that died meanwhile is found as the next wait starts."""

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        self._unwatch()  # registered by torch's __init__ (first_iter) just before this
        super()._reset(loader, first_iter)

    def _try_get_data(self, timeout: float = MP_STATUS_CHECK_INTERVAL) -> tuple[bool, Any]:
        dead = _dead_workers(self)
        if dead:  # torch's message for it
            raise RuntimeError(f"DataLoader worker (pid(s) {', '.join(map(str, dead))}) exited unexpectedly")
        self._worker_pids_set = True  # first: torch's _shutdown_workers removes them while it is set
        workers: list[Any] = self._workers  # torch's private list of its processes, started: each has its pid
        _set_worker_pids(id(self), tuple(worker.pid for worker in workers))
        try:
            return super()._try_get_data(timeout)
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._worker_pids_set:
            self._worker_pids_set = False
            _remove_worker_pids(id(self))


class _GuardedInit:
    """The user's worker_init_fn, its exception raised as a WorkerInitError of its own type too (picklable for spawn
    workers)."""

    def __init__(self, init: Callable[[int], None]):
        self.init = init

    def __call__(self, worker_id: int) -> None:
        try:
            self.init(worker_id)
        except Exception as err:
            raise _init_error(type(err), f"worker_init_fn raised in worker {worker_id}: {err!r}") from err


class _Delivery:
    """The iterator handed to the training loop: counts a batch at the moment it is returned.

    What counts is what was delivered: a batch whose loading raised (in the dataset, collate_fn or a worker) is
    consumed, recorded as failed and never served again, and the same iterator goes on with the next one. Only
    the newest iterator of a loader may deliver: an older one would count batches into the same progress twice
    over (and, with persistent workers, would read from the newest one's reset worker iterator). torch's
    iterator attributes (`_workers`, `_num_workers`, ...) are forwarded, for the tools that read them."""

    def __init__(self, inner: Any, loader: ResumableDataLoader, iteration: int):
        # inner: torch's iterator, whose private attributes (torch declares few) are read below; or an empty one
        self._inner, self._loader, self._iteration = inner, loader, iteration
        loader.__dict__["_active"] = weakref.ref(self)  # what `close()` stops
        self._stopped: str | None = None  # why this iterator may not go on, if it may not
        self._in_process = type(inner) is _SingleProcessDataLoaderIter  # num_workers=0: see _next
        self._in_workers = isinstance(inner, _MultiProcessingDataLoaderIter)
        self._read = None  # the dataset's reader of whole batches, where torch would call the loader's collate
        if self._in_process and inner._auto_collation and inner._collate_fn is collate:
            self._read = batch_reader(inner._dataset)

    def _next(self) -> Any:
        """torch's next(): with num_workers=0 and no profiler running, its `_next_data()` and count without the
        `record_function` context torch enters around each batch for the profiler's trace (~10 us a batch, most of
        the loader's own cost at small batches), and through the dataset's batch reader when it has one (no Rows
        made only to be unwrapped, ~8 us): the same batch, the same errors. Under a profiler, torch's own."""
        inner = self._inner
        if not self._in_process or torch.autograd._profiler_enabled() or inner._sampler_iter is None:
            return next(inner)
        if self._read is None:
            batch = inner._next_data()
        else:
            batch = self._read(inner._next_index())
            if inner._pin_memory:
                batch = pin_memory(batch, inner._pin_memory_device)
        inner._num_yielded += 1
        return batch

    def __iter__(self) -> _Delivery:
        return self

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _slots_taken(self, received_before: int | None) -> int:
        """Index lists the inner iterator used up in one next(): torch's multiprocessing iterator says how far it
        got (a timeout uses up none); the single-process one uses one per call that did not end the pass."""
        received = getattr(self._inner, "_rcvd_idx", None)
        return 1 if received is None else received - received_before

    def _check_active(self) -> None:
        if self._loader._iterations != self._iteration:
            raise RuntimeError(
                "this iterator was superseded (by a newer iter(), load_state_dict() or set_epoch() on the same "
                "ResumableDataLoader): progress counts what one iterator delivers, so iterate a new one, which "
                "continues where this one stopped"
            )
        if self._stopped is not None:
            raise RuntimeError(self._stopped)

    def _stop_workers(self, why: str) -> None:
        """This iterator may not go on, and its workers are shut down: the next iter() starts new ones."""
        self._stopped = why
        shutdown = getattr(self._inner, "_shutdown_workers", None)  # none in process, or for an empty pass
        if shutdown is not None:
            shutdown()
        if self._loader._iterator is self._inner:  # persistent: torch would reset them without running the init again
            self._loader._iterator = None

    def _stop_if_a_worker_died(self, error: Exception | None) -> None:
        """torch goes on past a dead worker's tasks: stop here instead, its workers shut down so that nothing of
        theirs is watched any more (a new iter() starts new ones and serves what they held). `error`: one torch
        raised itself, which may tell the death before the worker's exit shows."""
        if _dead_workers(self._inner) or (error is not None and self._in_workers and _reports_a_death(error)):
            self._stop_workers(_WORKER_DIED)

    def __next__(self) -> Any:
        loader = self._loader
        self._check_active()
        started = perf_counter()
        try:
            received_before = getattr(self._inner, "_rcvd_idx", None)
            batch = self._next()
        except StopIteration:
            loader._end_map_pass()
            raise
        except WorkerInitError:  # no batch failed: a worker could not start. Nothing counted, new workers retry
            self._stop_workers(_WORKER_INIT_FAILED)
            raise
        except Exception as error:
            taken = self._slots_taken(received_before)
            for i in range(taken):
                loader._fail(None if i else started)  # the wait was the first one's
            self._stop_if_a_worker_died(None if taken else error)  # a batch's own error tells nothing of workers
            raise
        except BaseException:  # KeyboardInterrupt and the like: nothing is counted, a new iter() serves it again
            self._stopped = _INTERRUPTED
            raise
        if type(batch) is Sifted:  # the filter's verdicts, made with the batch in the worker
            batch, loader._kept = batch.batch, batch.kept
        loader._deliver(started, batch)
        return batch


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _StreamDelivery(_Delivery):
    """A stream's delivery: torch yields (worker, snapshot, error, end, batch, records, filtered) per batch (see
    loader.streams.source); each snapshot moves its worker's state on. A batch whose making raised is consumed (the
    stream moved past it) and its error raised; `end` marks a worker's end, without a batch. An error torch raises
    itself (a worker that died, a timeout) counts nothing."""

    def __next__(self) -> Any:
        loader, stream = self._loader, self._loader._stream
        assert stream is not None, "a stream's loader delivers through this"
        self._check_active()
        started = perf_counter()
        while True:
            try:
                worker, snapshot, raised, end, batch, records, filtered = next(self._inner)
            except StopIteration:
                loader._end_pass()
                raise
            except WorkerInitError:  # as for map-style: a worker could not start, new workers retry
                self._stop_workers(_WORKER_INIT_FAILED)
                raise
            except Exception as error:  # torch's own (a worker that died, a timeout): nothing counted
                self._stop_if_a_worker_died(error)
                raise
            except BaseException:  # as for map-style: nothing counted, a new iter() serves the batch again
                self._stopped = _INTERRUPTED
                raise
            stream.receive(worker, snapshot)
            if not end:
                break
            loader._dropped_at_end(filtered)
        if raised is not None:
            loader._fail(started)
            failure = _unwrapped(raised.take())
            try:
                raise failure
            finally:
                del failure  # no cycle (exception -> traceback -> this frame -> exception) keeps the workers alive
        loader._deliver(started, batch, records, filtered)  # a stream's samples: counted where made
        return batch


def _unwrapped(error: BaseException | ExceptionWrapper) -> BaseException:
    """The exception a worker's ExceptionWrapper stands for, without the reference cycle torch's reraise() leaves
    in its traceback: a cycle keeps this iterator and its worker processes alive until the garbage collector runs,
    and a worker forked meanwhile inherits them."""
    if not isinstance(error, ExceptionWrapper):
        return error
    try:
        cast(Callable[[], NoReturn], error.reraise)()  # torch leaves it unannotated: it always raises
    except Exception as err:  # noqa: BLE001 - reraise raises the worker's exception type
        return err.with_traceback(None)


def _check_filter(keep: object, filtered: str, batch_size: int | None, dataset: object) -> None:
    """filter= and filtered= as `loader.core.filtering` can apply them."""
    if filtered not in (REMOVED, MASKED):
        raise ValueError(
            f"filtered must be {REMOVED!r} (a batch holds its kept samples) or {MASKED!r} (every member, "
            f"with the verdicts in loader.last_kept()), got {filtered!r}"
        )
    if keep is None:
        return
    if not callable(keep):
        raise ValueError(f"filter must be a function of (index, sample) returning whether to keep it, got {keep!r}")
    if batch_size is None:
        raise ValueError(
            "filter= needs batches (batch_size=None delivers single samples, and a filtered one would "
            "leave a rank with nothing to deliver): pass a batch_size, e.g. 1"
        )
    if isinstance(dataset, IterableDataset) and filtered == MASKED:
        raise ValueError(
            "filtered='masked' keeps a map-style batch's members: a stream's batches are made of the "
            "records its filter keeps, full, so leave filtered at its default"
        )


def _as_is(data: Any) -> Any:
    """torch's collate_fn for a stream: the source already made the batch."""
    return data


def _default_rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialized = _distributed()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    check_positive_int("world_size", world_size)
    check_rank(rank, world_size)
    return rank, world_size


def _order_for(
    num_samples: int,
    shuffle: bool,
    seed: int,
    shuffle_blocks: int | Sequence[int] | None,
    lanes: Lanes | None,
    orders_itself: bool = False,
) -> Order:
    """The loader's order; for a dataset that orders itself (a Mixture) under shuffle=True, the identity of mode
    "self": each epoch is the dataset's own (`continue_epochs`), and a loader position is the dataset's position."""
    if shuffle and orders_itself:
        if shuffle_blocks is not None or lanes is not None:
            raise ValueError(
                "shuffle=True leaves the order to a Mixture (each epoch continues its stream, windows "
                "arranged by its seed), so that a change of its weights is exact at any world size: "
                "shuffle_blocks= and lanes= would scatter its positions again; drop them"
            )
        return Order(num_samples, seed, "self")
    if not shuffle:
        if shuffle_blocks is not None:
            raise ValueError("shuffle_blocks needs shuffle=True")
        return Order(num_samples, seed, "none", lanes=lanes)
    if shuffle_blocks is None:
        return Order(num_samples, seed, "global", lanes=lanes)
    if is_int(shuffle_blocks):
        shuffle_blocks = block_sizes_for_window(num_samples, shuffle_blocks)
    return Order(num_samples, seed, "blocks", tuple(int(size) for size in shuffle_blocks), lanes)


def _lanes_for(lanes: int | None, lane_chunk: int | None, batch_size: int) -> Lanes | None:
    if lanes is None:
        if lane_chunk is not None:
            raise ValueError("lane_chunk needs lanes=")
        return None
    return Lanes(lanes, batch_size if lane_chunk is None else lane_chunk)


def _policy_grad_accum(
    policy: BatchPolicy, batch_size: int | None, grad_accum: int, world_size: int, dataset: object
) -> int:
    """K at step 0 under `policy`, after refusing what it cannot serve: a policy deals each step's samples by its
    global batch, at every step of its schedule and the world size the job runs at (checked now, for every step)."""
    if not isinstance(policy, BatchPolicy):
        raise ValueError(f"batch_policy must be a loader.core.batch_policy.BatchPolicy, got {short(policy)}")
    if isinstance(dataset, IterableDataset):
        raise ValueError("batch_policy needs a map-style dataset: a stream's steps are not positions the loader deals")
    if batch_size != policy.micro_batch:
        raise ValueError(
            f"batch_size={batch_size!r} but batch_policy.micro_batch={policy.micro_batch}: pass "
            f"batch_size={policy.micro_batch} (the micro-batch of every rank and micro-step)"
        )
    if grad_accum != 1:
        raise ValueError(
            f"grad_accum={grad_accum!r} with a batch_policy: leave it out, K follows from the policy "
            f"(loader.grad_accum says the current one)"
        )
    if policy.allow_global_batch_change:
        raise ValueError(
            "batch_policy with allow_global_batch_change=True: the loader deals each step's samples by "
            "the policy's global batch, so it must be served exactly; for a changed global batch pass "
            "grad_accum=policy.grad_accum(world_size) instead of batch_policy"
        )
    policy.check_world_size(world_size)
    return policy.schedule[0][1] // (world_size * policy.micro_batch)


def _identity(order: Order, layout: Layout) -> str:
    """What names one loader alike on every rank (with its rank and the order loaders were made in)."""
    fingerprint = order.fingerprint()
    return f"{fingerprint['num_samples']}-{fingerprint['seed']}-{fingerprint['shuffle']}-{layout.grad_accum}"


T_co = TypeVar("T_co", covariant=True)
_DATAPIPES = getattr(torch.utils.data, "IterDataPipe", ())  # () where a torch no longer ships DataPipes


def _refuse_datapipes(dataset: object) -> None:
    """torch shards a DataPipe graph per worker (`sharding_filter()`) and seeds its shuffles alike in every worker
    only when it iterates the DataPipe itself. The loader's workers iterate its own source, so that would never run,
    and a graph's position is no state the loader could save: refused rather than served twice over."""
    if isinstance(dataset, _DATAPIPES):
        raise ValueError(
            f"{type(dataset).__name__} is an IterDataPipe, which this loader does not support: torch applies a "
            f"DataPipe's sharding_filter() and shuffle seed only when it iterates the DataPipe itself, so with "
            f"num_workers > 0 it would yield every sample once per worker, and its position cannot be saved to "
            f"resume exactly. Use a map-style dataset (a MapDataPipe works), an IterableDataset that splits its "
            f"records by get_worker_info(), or a loader.ShardedStream, which the loader deals by rank and worker"
        )


class ResumableDataLoader(DataLoader[T_co]):
    """A drop-in torch DataLoader whose input progress survives restarts at any world size.

    Beyond DataLoader's arguments: `seed` (the order is a pure function of seed, epoch and position), `rank` and
    `world_size` (default: torch.distributed's, else 0 and 1; no DistributedSampler needed), `grad_accum` (only
    whole optimizer updates count as progress), `shuffle_blocks` (shuffle blocks of indices, e.g. shards, then
    inside each block: an int window or a list of block sizes), `sample_seeds` (the dataset receives
    `SampleIndex` ints carrying a per-sample seed) and `lanes` (each rank reads its own part of the shards: set it
    to a multiple of every world size the job runs at, see `loader.core.order.Lanes`; `lane_chunk` defaults to
    batch_size). Under tensor, context, pipeline or expert parallelism, `dp_mesh` (a DeviceMesh: `world_mesh["dp"]`,
    or `world_mesh["dp_replicate", "dp_shard"]`, flattened in the mesh's order) or `dp_group` (a ProcessGroup)
    gives the data-parallel coordinates to partition over instead: every peer of one data-parallel rank gets the
    same batches, and `rank` and `world_size` are the data-parallel ones. `filter` (a function of (index, sample);
    of (None, record) for a stream) drops samples where they are read, each recorded as filtered by policy; a batch
    then holds the kept ones, or with `filtered="masked"` all of them and `last_kept()` (see `loader.core.filtering`).

    A new `iter()` continues the current epoch right after the last delivered batch (with a
    `ContinuedPassWarning` when an earlier iterator left the pass after delivering batches); after a pass that
    ended it starts the next epoch. Call `state_dict()` after the optimizer step; it reports completed updates.
    A dataset whose samples change with the epoch (a PackedSource) declares `epoch_aware = True`: its indices are
    then `SampleIndex` ints carrying the epoch of their batch (`.epoch`), in whichever worker computes it.
    """

    ledger: Ledger | None
    resumable_sampler: ResumableSampler | None  # a map-style dataset's; a stream's progress is its StreamProgress
    _stream: StreamProgress | None
    _filter: tuple[Callable[[Any, Any], bool], str] | None

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: torch.Generator | None = None,
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
        lanes: int | None = None,
        lane_chunk: int | None = None,
        dp_mesh: DeviceMesh | None = None,
        dp_group: ProcessGroup | None = None,
        batch_policy: BatchPolicy | None = None,
        filter: Callable[[Any, Any], bool] | None = None,  # of (index, sample); of (None, record) for a stream
        filtered: str = REMOVED,
    ) -> None:
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
        if batch_size is None and drop_last:
            raise ValueError("batch_size=None disables batching, so drop_last=True has nothing to drop (as in torch)")
        if not is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        _check_filter(filter, filtered, batch_size, dataset)
        rank, world_size = data_parallel(rank, world_size, dp_mesh, dp_group)
        self._rank_and_world_given = (rank, world_size)  # None: torch.distributed's, read when iteration starts
        self._resolved_distributed = _distributed()  # whether the group existed when rank and world were read
        rank, world_size = _default_rank_and_world(rank, world_size)
        self.batch_policy = batch_policy
        if batch_policy is not None:
            grad_accum = _policy_grad_accum(batch_policy, batch_size, grad_accum, world_size, dataset)
        # batch_size=None hands out single samples, so a rank cannot take one more in a micro-batch: every rank
        # yields the same number of samples, and the epoch's last R mod (world_size * grad_accum) are dropped by
        # policy (recorded), as drop_last drops them of batches (else DDP would wait on a rank's extra backward)
        layout = Layout(world_size, grad_accum, batch_size or 1, bool(drop_last) or batch_size is None)
        common: dict[str, Any] = dict(
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
        self.seed, self._rank, self._world_size, self._grad_accum = seed, rank, world_size, grad_accum
        self.ledger = None  # a loader.ledger.Ledger records every delivered batch's indices when attached
        self._step_base: int | None = 0  # the step resumed from (None: unknown), and the updates completed since:
        self._updates = 0  # see `step`
        self.monitor = Monitor(grad_accum)  # per-step metrics (`metrics()`), the stall warning (`monitor.configure`)
        self._iterations = 0  # iterators superseded so far: only the newest iterator delivers
        self._filter = None if filter is None else (filter, filtered)
        self._kept: np.ndarray | None = None  # the filter's verdicts on the members of the batch delivered last
        self._tails: list[tuple[int, np.ndarray]] = []  # (epoch, runs) a stream's filter dropped after its workers'
        # last batches, not yet in the ledger (see `_dropped_at_end`)
        self._delivered_by_iterator = 0  # batches the newest iterator delivered
        if isinstance(dataset, IterableDataset):
            _refuse_datapipes(dataset)
            if sample_seeds or shuffle_blocks is not None or lanes is not None:
                raise ValueError("sample_seeds, shuffle_blocks and lanes need a map-style dataset (random access)")
            sharded = is_sharded(dataset)  # the loader deals its shards, in an order it may shuffle
            self.resumable_sampler = None
            self._stream = StreamProgress(
                dataset, world_size, rank, grad_accum, num_workers, persistent_workers, seed, bool(shuffle) and sharded
            )
            super().__init__(
                dataset, batch_size=batch_size, shuffle=None if sharded else shuffle, drop_last=drop_last, **common
            )
            self._stream.attach(
                batch_size, drop_last, self.collate_fn, worker_init_fn and _GuardedInit(worker_init_fn), filter
            )
            return
        self._stream = None
        if batch_size is not None and (collate_fn is None or collate_fn is default_collate):
            common["collate_fn"] = collate  # default_collate's batches, without stacking a loader.core.rows.Rows again
        self._shuffle_blocks, self._lanes = shuffle_blocks, _lanes_for(lanes, lane_chunk, batch_size or 1)
        orders_itself = bool(shuffle) and callable(getattr(dataset, "continue_epochs", None))
        num_samples = len(cast(Sized, dataset))  # a map-style dataset's (torch's Dataset declares no __len__)
        order = _order_for(num_samples, bool(shuffle), seed, shuffle_blocks, self._lanes, orders_itself)
        if orders_itself:
            cast(Any, dataset).continue_epochs()  # before the epoch-awareness is read: its epochs take the loader's
        schedule = None if batch_policy is None else batch_policy.schedule
        amended = (
            None
            if batch_policy is None or batch_policy.amends is None or batch_policy.change_at is None  # None together
            else (batch_policy.amends, batch_policy.change_at)
        )
        self.resumable_sampler = ResumableSampler(order, layout, rank, schedule, amended)
        self._lockstep = LockstepWatch(_identity(order, layout))
        carried = getattr(dataset, "carried_plan", None)
        self._carry = (
            seed if sample_seeds else None,
            bool(getattr(dataset, "epoch_aware", False)),
            carried if callable(carried) else None,
        )
        self._carries = self._carry != (None, False, None)  # seed 0, the default, is a seed too
        indices = _Carrying(self.resumable_sampler, *self._carry) if self._carries else self.resumable_sampler
        dispatched: _Carrying | ResumableSampler | _Planned = indices
        if callable(planned := getattr(dataset, "planned", None)):
            in_flight = num_workers * (2 if prefetch_factor is None else prefetch_factor) if num_workers else 1
            dispatched = _Planned(indices, planned, in_flight)
        if batch_size is None:
            sampler = _RankIndices(dispatched, self)  # torch iterates it
            super().__init__(dataset, batch_size=None, sampler=sampler, **common)
        else:
            super().__init__(dataset, batch_sampler=dispatched, **common)
            object.__setattr__(self, "batch_size", batch_size)  # what the user asked for, as DataLoader reports it
            object.__setattr__(self, "drop_last", bool(drop_last))
            sampler = _RankIndices(indices, self)  # users iterate it, unplanned
            object.__setattr__(self, "sampler", sampler)  # torch's placeholder would have no set_epoch

    # -- iteration -------------------------------------------------------------------------------------------------

    def _resolve_rank_and_world(self) -> None:
        """Rank and world size not given explicitly follow torch.distributed as it is now: a loader built before
        init_process_group (a script that builds it, then hands it to a framework that initialises the group)
        would otherwise run as world size 1 on every rank and train every sample once per rank. It returns at once
        unless a group appeared or went away since the last read."""
        if _distributed() == self._resolved_distributed:
            return
        self._resolved_distributed = not self._resolved_distributed
        rank, world_size = _default_rank_and_world(*self._rank_and_world_given)
        if (rank, world_size) == (self._rank, self._world_size):
            return
        progress = self._stream or self.resumable_sampler
        assert progress is not None, _EITHER
        if progress.delivered_any:
            raise RuntimeError(
                f"this ResumableDataLoader delivered batches as rank {self._rank} of world_size {self._world_size} "
                f"before torch.distributed was initialised as rank {rank} of {world_size}: build the loader after "
                f"init_process_group, or pass rank= and world_size= explicitly"
            )
        layout = self.resumable_sampler.layout if self.resumable_sampler is not None else None
        if self.batch_policy is not None:
            self.batch_policy.check_world_size(world_size)
        if layout is not None:
            assert self.resumable_sampler is not None, _MAP_STYLE
            self.resumable_sampler.relayout(
                Layout(world_size, layout.grad_accum, layout.batch_size, layout.drop_last), rank
            )
        else:
            assert self._stream is not None, _EITHER
            self._stream.place(world_size, rank)
        self._rank, self._world_size = rank, world_size

    @property
    def rank(self) -> int:
        self._resolve_rank_and_world()
        return self._rank

    @property
    def world_size(self) -> int:
        self._resolve_rank_and_world()
        return self._world_size

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch names its private iterator class
        self._resolve_rank_and_world()
        if callable(before_iter := getattr(self.dataset, "before_iter", None)):
            before_iter(self.num_workers)  # a dataset refuses what its readers cannot do, before anything starts
        progress = self._stream or self.resumable_sampler
        assert progress is not None, _EITHER
        if self._delivered_by_iterator and not progress.ended:
            warnings.warn(
                f"iter() continues epoch {self.epoch} of this ResumableDataLoader: the {self._delivered_by_iterator} "
                f"batch(es) the previous iterator delivered count as consumed, so a batch that was only looked at "
                f"(e.g. next(iter(loader))) is never trained. Use loader.peek() to look without consuming; keep "
                f"iterating one iterator to continue without this warning",
                ContinuedPassWarning,
                stacklevel=2,
            )
        self._settle()
        self._supersede()
        if self._stream is not None:
            self._drop_stale_workers()
            return self._stream_iter()
        sampler = self.resumable_sampler
        assert sampler is not None, _MAP_STYLE
        sampler.begin_pass()
        self._drop_stale_workers(stale=self._follow_length(sampler))
        self.monitor.begin(sampler.view().plan, sampler.rank, sampler.handed_out)
        self._follow_ramp()
        return _Delivery(self._torch_iter(), self, self._iterations)

    def _drop_stale_workers(self, stale: bool = False) -> None:
        """Persistent workers are started anew when one of them died (killed, out of memory: torch would reset them,
        and the dead one never acknowledges, so every later iter() raised, or waited out `timeout`, for good) or
        they are `stale`: the dataset changed length (each holds its copy from when it started, where the new
        indices would fail), or a stream's pass starts from other snapshots. Nothing is lost: the new pass
        continues after the last delivered batch."""
        iterator: Any = self._iterator  # torch's private one, whose _shutdown_workers only its subclasses declare
        if iterator is not None and (stale or _dead_workers(iterator)):
            iterator._shutdown_workers()
            self._iterator = None

    def _torch_iter(self, anew: Callable[[], None] = lambda: None) -> _BaseDataLoaderIter:
        """torch's iterator. A worker that died as it was made fails it: persistent workers are reset by it, which
        waits for each of them (one may have died since `_drop_stale_workers` looked, its death not yet visible
        then), and torch watches new workers from their start. New workers are started instead, after `anew()` (a
        stream plans where they start)."""
        try:
            return super().__iter__()
        except Exception as error:
            if not self.num_workers or not _reports_a_death(error):  # in-process: the dataset's own error
                raise
        self._drop_stale_workers(stale=True)
        anew()
        return super().__iter__()

    def _follow_length(self, sampler: ResumableSampler) -> bool:
        """The dataset's length, read when an epoch starts as torch's samplers read it: a dataset that grew (or
        shrank) between passes is dealt whole from this epoch on. One len() per epoch start, none per batch.
        Returns whether the length changed."""
        if not sampler.at_epoch_start:
            return False
        old, new = sampler.order.num_samples, len(cast(Sized, self.dataset))
        if new == old:
            return False
        if self._shuffle_blocks is not None and not is_int(self._shuffle_blocks):
            raise ValueError(
                f"the dataset's length changed from {old} to {new} before epoch {sampler.epoch} started, but "
                f"shuffle_blocks was given as block sizes summing to {old}: build a new ResumableDataLoader with block "
                f"sizes for {new} (an int window follows the length)"
            )
        sampler.follow_length(
            _order_for(
                new,
                sampler.order.shuffle != "none",
                self.seed,
                self._shuffle_blocks,
                self._lanes,
                sampler.order.shuffle == "self",
            )
        )
        return True

    def _next_pass(self) -> ResumableSampler:
        """The sampler as the next pass will find it, which `len()` describes: when that pass starts an epoch and
        the dataset changed length since the epoch was last read, a copy dealing the new length (one len(dataset) per
        call, as torch's len(); none while a pass is under way)."""
        sampler = self.resumable_sampler
        assert sampler is not None, _MAP_STYLE
        if not (sampler.ended or sampler.at_epoch_start) or len(cast(Sized, self.dataset)) == sampler.order.num_samples:
            return sampler
        ahead = sampler.next_pass()
        self._follow_length(ahead)
        return ahead

    def _stream_iter(self) -> _StreamDelivery:
        if self.ledger is not None and not self.ledger.stream:
            raise TypeError(
                "this ledger records sample indices, which an IterableDataset does not have: open it with "
                "Ledger.open_stream(run_dir, resumed_step), which names the records the filter drops by shard and "
                "record instead"
            )
        stream = self._stream
        assert stream is not None and stream.source is not None, _STREAM
        source = stream.source
        if stream.exhausted and not stream.ended:  # set_epoch() named the epoch whose stream is over: empty pass
            return _StreamDelivery(iter(()), self, self._iterations)
        plan = stream.begin_pass(workers_standing=self._iterator is not None)
        self._drop_stale_workers(stale=plan is not None)  # persistent workers stand elsewhere: start anew
        source.plan = plan
        self.monitor.begin(None)

        def anew() -> None:  # persistent workers that were to go on as they stood died: new ones start from a plan
            nonlocal plan
            plan = source.plan = stream.begin_pass(workers_standing=False)

        inner = self._torch_iter(anew)
        if inner._IterableDataset_len_called is not None:  # torch warns past len(dataset) items; each worker's end
            inner._IterableDataset_len_called += stream.workers  # comes as one more item
        stream.started(inner, plan)
        return _StreamDelivery(inner, self, self._iterations)

    def _get_iterator(self) -> _BaseDataLoaderIter:
        """torch's iterator, its workers seeded by `worker_seed` unless a `generator=` was given (torch would draw
        their seed from this process's generator, which may differ between the peers of a data-parallel rank); for
        a stream, over the stream's source, which makes the batches (with their states)."""
        view = copy.copy(self)
        if self.generator is None:
            sampler = self.resumable_sampler  # the micro-batch the pass starts at, on the rank dealt (which a
            # loader.integrations.torchft step sets on the sampler alone):
            if sampler is None:
                assert self._stream is not None, _EITHER
                start, rank = self._stream.delivered, self._rank
            else:
                start, rank = len(sampler) - sampler.batches_left, sampler.rank
            seed = worker_seed(self.seed, self.epoch, rank, start)
            view.__dict__["generator"] = torch.Generator().manual_seed(seed)
        if self._stream is not None:
            source = self._stream.source
            assert source is not None, _STREAM
            view.__dict__.update(
                dataset=source,
                batch_sampler=None,
                collate_fn=_as_is,
                drop_last=False,
                worker_init_fn=source.init_worker,
            )
        else:
            view.__dict__.update(self._read_as())
            if self.worker_init_fn is not None:
                view.__dict__["worker_init_fn"] = _GuardedInit(self.worker_init_fn)
        if not self.num_workers:
            return DataLoader._get_iterator(view)
        view.check_worker_number_rationality()
        return _WatchedWorkers(view)

    def _read_as(self) -> dict:
        """The dataset and collate_fn as a map-style batch is read (in a worker, or here): under a filter, a
        `Sifting` view of the dataset that also collates, so each batch comes back with the filter's verdicts."""
        if self._filter is None:
            return {"dataset": self.dataset, "collate_fn": self.collate_fn}
        return {
            "dataset": Sifting(self.dataset, self._filter[0], self.collate_fn, self._filter[1]),
            "collate_fn": _as_is,
        }

    def _supersede(self) -> None:
        """From now on, only an iterator made after this call delivers."""
        self._iterations += 1
        self._delivered_by_iterator = 0
        self.monitor.new_pass()

    def _deliver(self, started: float, batch: Any, records: int = 0, runs: np.ndarray | None = None) -> None:
        """`batch` was handed to the loop; a stream's `records` of its stream, and the `runs` of those its filter
        dropped before them (`loader.streams.filtered`)."""
        self.__dict__["_delivered_by_iterator"] += 1  # not through DataLoader.__setattr__: Python, 0.3 us a batch
        if self._stream is not None:
            self._stream.deliver()
            filtered = count_dropped(runs)
            records += filtered
            if self.ledger is not None:
                self._record_tails(None)  # their workers' ends are committed with this batch's update
                named = None if runs is None else runs.ravel()
                self.ledger.record(self.epoch, _NO_INDICES, self.update_complete, named)
        else:
            assert self.resumable_sampler is not None, _MAP_STYLE
            self.resumable_sampler.deliver()
            if self._world_size > 1:
                self._publish_update()
            if self.ledger is not None:
                trained, dropped = self._verdicts()
                self.ledger.record(self.epoch, trained, self.update_complete, dropped)
                self._record_end()
        if self.update_complete:
            self.__dict__["_updates"] += 1
        monitor = self.monitor
        if monitor.count_bytes:
            monitor.bytes += batch_nbytes(batch)
        if self._stream is None:  # a map-style batch: its members the filter dropped, from the verdicts
            assert (self._filter is None) == (self._kept is None), _VERDICTS
            filtered = 0 if self._kept is None else len(self._kept) - int(self._kept.sum())
        if monitor.handed(started, perf_counter(), records, filtered):
            self._stalled()
        self._follow_ramp()

    def _dropped_at_end(self, runs: np.ndarray | None) -> None:
        """A stream's worker ended, its filter having dropped `runs` after its last batch: counted now, named with
        the next batch this rank delivers or, once the pass is over, when a state holding their end is taken (their
        end is committed then, not with the step before)."""
        dropped = count_dropped(runs)
        self.monitor.records += dropped
        self.monitor.filtered += dropped
        if runs is not None and self.ledger is not None:
            self._tails.append((self.epoch, runs.ravel()))

    def _record_tails(self, step: int | None) -> None:
        """Name in the ledger the records dropped after workers' last batches (see `_dropped_at_end`), for `step`
        (None: the step under way)."""
        assert self.ledger is not None, "its callers check that a ledger is attached"
        for epoch, runs in self._tails:
            self.ledger.record_filtered(epoch, runs, step)
        self._tails.clear()

    def _follow_ramp(self) -> None:
        """Under a batch-size ramp, the monitor closes a step after the K of the update under way."""
        if self.batch_policy is not None and not self.monitor.in_step:
            self.monitor.grad_accum = self.grad_accum

    def _publish_update(self) -> None:
        """Tell the other ranks when this rank completed an optimizer update (see `loader.checkpoint.lockstep`)."""
        assert self.resumable_sampler is not None, _MAP_STYLE
        if self.resumable_sampler.update_complete:
            self._lockstep.completed_update(self._rank, self.resumable_sampler.progress_id, self._world_size)

    def _fail(self, started: float | None) -> None:
        if self._stream is not None:
            self._stream.deliver()  # the stream moved past it: resuming must not replay it
            samples = 0  # the records it consumed are the stream's own; none was delivered
            if self.ledger is not None:  # no indices, but it may complete a step, which the ledger counts
                self._record_tails(None)
                self.ledger.record_failed(self.epoch, _NO_INDICES, self.update_complete)
        else:
            assert self.resumable_sampler is not None, _MAP_STYLE
            failed = self.resumable_sampler.next_indices()
            assert failed is not None, "the failed batch was dispatched: its indices are the next ones"
            samples = len(failed)
            self.resumable_sampler.fail()
            if self._world_size > 1:
                self._publish_update()
            if self.ledger is not None:
                self.ledger.record_failed(self.epoch, failed, self.update_complete)
                self._record_end()
        if self.update_complete:
            self.__dict__["_updates"] += 1
        now = perf_counter()
        if self.monitor.failed(now if started is None else started, now, samples):
            self._stalled()
        self._follow_ramp()

    # -- metrics (see loader.metrics) --------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Close the monitor's open step if the sampler says its update is complete: the epoch's last update, which
        may be shorter than grad_accum, is closed when the loader next looks (the end of the pass, a new iter(),
        set_epoch, load_state_dict, metrics())."""
        monitor = self.monitor
        if monitor.in_step and self.update_complete and monitor.close(monitor.last_at):
            self._stalled()

    def _source_metrics(self) -> dict:
        """The dataset's own counters (`dataset.metrics()`, e.g. a remote source's cache), if it has any."""
        metrics = getattr(self.dataset, "metrics", None)
        if not callable(metrics):
            return {}
        return self.monitor.source.call(
            f"the dataset's own metrics() ({type(self.dataset).__name__}.metrics)",
            lambda: dict(metrics()),
            {},
            "its source/... counters are left out",
        )

    def _stalled(self) -> None:
        """A stall streak began (note the source's counters), or reached the monitor's length (warn)."""
        monitor = self.monitor
        if monitor.streak.steps == 1:
            monitor.streak_source = self._source_metrics()
        if monitor.warns():
            shuffle = "stream" if self.resumable_sampler is None else self.resumable_sampler.order.shuffle
            message = stall_message(
                monitor.streak, self._rank, self.num_workers, shuffle, monitor.streak_source, self._source_metrics()
            )
            warnings.warn(message, DataStallWarning, stacklevel=4)

    def metrics(self) -> dict:
        """What this loader did, as one flat dict of plain numbers: the last completed optimizer update's (`batches`,
        `samples`, `failed_batches`, `wait_seconds` the loop spent in next(), `step_seconds`, `stall_ratio`,
        `samples_per_second`; with `monitor.configure(count_bytes=True)`, `bytes` and `bytes_per_second`),
        `resume_seconds` (load_state_dict() to the next batch), this launch's totals (`total/...`), the dataset's own
        counters (`source/...`, from its `metrics()`) and, with a ledger attached, the `launch` (its generation) and
        `step`. A step's values are None until one completed. See docs/observability.md."""
        self._settle()
        ledger = self.ledger
        return {
            "launch": None if ledger is None else ledger.generation,
            "step": None if ledger is None else ledger.step,
            **self.monitor.snapshot(),
            **{f"source/{key}": value for key, value in self._source_metrics().items()},
        }

    def _end_pass(self) -> None:
        stream = self._stream
        partial = stream is not None and not stream.ended and stream.delivered % self.grad_accum
        progress = stream or self.resumable_sampler
        assert progress is not None, _EITHER
        progress.end_pass()
        if partial and self.ledger is not None:  # the stream's end completed its last, short update: a step
            self.ledger.record(self.epoch, _NO_INDICES, True)
        self._settle()

    def _end_map_pass(self) -> None:
        """The end of a map-style pass, which must come after this rank's whole share: index lists that ended short
        (their iteration raised, e.g. in the dataset's `planned` hook, and a generator that raised is over) would
        otherwise end the pass as if the share were done, and the next pass would start the next epoch, skipping
        the rest of this one. Refused instead; a new iter() continues after the last delivered batch."""
        sampler = self.resumable_sampler
        assert sampler is not None, _MAP_STYLE
        if not sampler.exhausted:
            left = sampler.view().plan.batches_per_rank - sampler.handed_out
            raise RuntimeError(
                f"this pass's index lists ended with {left} micro-batch(es) of epoch {sampler.epoch} left on rank "
                f"{sampler.rank}: their iteration raised earlier (e.g. in the dataset's planned() hook), so this "
                f"iterator cannot go on. Nothing is skipped: take a new iter(), which continues after the last "
                f"delivered batch"
            ) from None
        if self.ledger is not None:  # a pass with nothing left (fewer samples than ranks, a resumed end) ends it too
            self._record_end()
        self._end_pass()

    def _record_end(self) -> None:
        """Tell the ledger when this rank's share of the epoch is all handed out: the audit learns the epoch's end
        from the loader, in every flow, without a call of the training loop's."""
        assert self.resumable_sampler is not None and self.ledger is not None, "its callers: map-style, with a ledger"
        if self.resumable_sampler.exhausted:
            self.ledger.record_end(self)

    def peek(self) -> Any:
        """The batch the next delivery will hand out, loaded here in this process and not counted: for looking at
        data (shapes, an example to log) where `next(iter(loader))` would consume a batch that is never trained."""
        if self._stream is not None:
            raise TypeError("an IterableDataset cannot be peeked without consuming it")
        sampler = self.resumable_sampler
        assert sampler is not None, _MAP_STYLE
        indices = sampler.next_indices()
        if indices is None:
            raise StopIteration("the next pass is empty: this rank's share of the epoch is delivered")
        ids = indices.tolist()
        if self._carries:  # as a pass dispatches them: next_indices is of the next epoch past an exhausted one
            seed, epoch_aware, carried = self._carry
            ids = carrying(ids, sampler.epoch + sampler.exhausted, seed, epoch_aware, carried and carried())
        batched = self.batch_size is not None
        read = self._read_as()
        batch = _MapDatasetFetcher(read["dataset"], batched, read["collate_fn"], self.drop_last).fetch(
            ids if batched else ids[0]
        )
        return batch.batch if type(batch) is Sifted else batch

    def __len__(self) -> int:
        self._resolve_rank_and_world()
        if self._stream is not None:
            return super().__len__()
        return len(self._next_pass())

    @property
    def batches_left(self) -> int:
        """Micro-batches the next pass yields on this rank (`len()` counts the whole epoch, as DataLoader's)."""
        if self._stream is not None:
            raise TypeError("an IterableDataset does not know how many batches it has left")
        return self._next_pass().batches_left

    @property
    def epoch(self) -> int:
        progress = self._stream or self.resumable_sampler
        assert progress is not None, _EITHER
        return progress.epoch

    def set_epoch(self, epoch: int) -> None:
        """Same epoch: no change (safe to call after a resume). The next epoch after an exhausted pass: the natural
        advance. Another epoch: start it from its beginning (an AbandonedEpochWarning when that leaves the current
        one part way). A change supersedes the active iterator."""
        self._settle()
        progress = self._stream or self.resumable_sampler
        assert progress is not None, _EITHER
        if progress.set_epoch(epoch):
            self._supersede()
            self.monitor.forget_step()

    @property
    def exhausted(self) -> bool:
        """True when this rank has delivered its whole share of the current epoch: a new pass starts the next."""
        if self._stream is not None:
            return self._stream.finished
        assert self.resumable_sampler is not None, _MAP_STYLE
        return self.resumable_sampler.exhausted

    def finished(self, epochs: int) -> bool:
        """True when this rank has trained epochs 0 .. `epochs` - 1: the loop of a run of `epochs` epochs stops
        here, and a relaunch of a finished run (`resume` loads its last checkpoint) trains nothing more unless given
        more epochs. 0 epochs: finished from the start."""
        if not is_int(epochs) or epochs < 0:
            raise ValueError(f"epochs must be an int, 0 or more, got {epochs!r}")
        return self.epoch >= epochs or (self.exhausted and self.epoch + 1 >= epochs)

    @property
    def update_complete(self) -> bool:
        """True when the batch just delivered completes an optimizer update (grad_accum micro-batches, or the
        epoch's final, shorter update): step the optimizer, then checkpoint."""
        if self._stream is not None:
            return self._stream.delivered > 0 and self._stream.completed == self._stream.delivered
        assert self.resumable_sampler is not None, _MAP_STYLE
        return self.resumable_sampler.update_complete

    @property
    def grad_accum(self) -> int:
        """K, the micro-batches of an optimizer update: under a `batch_policy`, of the update the next micro-batch
        belongs to (a ramp changes it by step, a resize by world size), else as given."""
        if self.batch_policy is None:
            return self._grad_accum
        self._resolve_rank_and_world()
        assert self.resumable_sampler is not None, "a batch_policy is a map-style loader's (refused for a stream)"
        return self.resumable_sampler.grad_accum

    @property
    def step(self) -> int | None:
        """The optimizer step the loop is at, as the loader counts it: the step `resume` loaded (0 for a loader that
        resumed nothing), plus every update completed since, also one that a failed micro-batch completed (the
        exception reached the loop, but the update is over: step the optimizer then too). The ledger labels its
        records with the same count, and `save_checkpoint` saves under it by default. None after a plain
        `load_state_dict()`, which cannot know the step: set it then (`loader.step = n`)."""
        return None if self._step_base is None else self._step_base + self._updates

    @step.setter
    def step(self, value: int) -> None:
        if not is_int(value) or value < 0:
            raise ValueError(f"step must be a non-negative int (the optimizer steps completed), got {value!r}")
        self.__dict__.update(_step_base=int(value), _updates=0)

    def change_mixture(self, weights: Sequence[float]) -> MixtureChange | None:
        """Change a Mixture's weights from the training loop: call it on every rank, with the same weights (the
        controller's inputs all-reduced), after an update (`update_complete`). The change applies from the first
        whole window of the mixture after every position any rank was dealt up to `prefetched` micro-batches past
        its cursor (num_workers x prefetch_factor: what the workers may already hold) and after everything
        committed, so batches computed under the old weights stay right, and every rank finds the same window
        without communication. The plan records it (`plan.requests`: the step asked at, the window), the
        checkpoint carries the plan, each batch carries it to the workers (persistent or not) once it holds a
        change. A request at a step the plan already recorded a request at or after (a step replayed after a
        restart) is ignored: the recorded weights stand, never recomputed (returns None then). Under
        torch.distributed the ranks' changes are compared (one all_gather): weights that differ are refused.
        Returns where the change applies: its mixture position, and the step whose update first trains a sample
        under the new weights (None when that lies past this epoch)."""
        if self._stream is not None:
            raise TypeError(
                "change_mixture changes a loader.sources.Mixture's weights; this loader's dataset is "
                f"a {type(self.dataset).__name__}"
            )
        step, sampler = self.step, self.resumable_sampler
        assert sampler is not None, _MAP_STYLE
        check_mixture(self.dataset, sampler.order)
        if step is None:
            raise ValueError(
                "change_mixture needs the loader's step (the plan records the step each change was "
                "asked at, so that a replayed step takes the recorded weights): resume with "
                "loader.checkpoint.resume, or set loader.step"
            )
        if sampler.view().plan.completed(sampler.handed_out) != sampler.handed_out:
            raise ValueError(
                "change_mixture in the middle of an optimizer update: call it after the update's last "
                "micro-batch (loader.update_complete)"
            )
        prefetched = self.num_workers * (self.prefetch_factor or 2)
        position = sampler.undealt(prefetched)
        epoch = sampler.epoch
        plan = planned_change(self.dataset, weights, step, epoch, position, sampler.order.num_samples)
        if plan is None:
            return None
        window = plan.requests[-1][1]
        if _distributed() and len(set(all_gather(plan.fingerprint()))) > 1:
            raise ValueError(
                f"change_mixture at step {step}: the ranks asked for different weights (or have "
                f"different num_workers or prefetch_factor): pass every rank the same weights (all-reduce "
                f"the controller's inputs)"
            )
        cast(Any, self.dataset).use_plan(plan)  # a Mixture's (check_mixture above)
        at = window * plan.window
        local = at - epoch * sampler.order.num_samples if plan.epochs_continue else at
        held = sampler.update_holding(local) if local < sampler.order.num_samples else None
        current = sampler.handed_out // self.grad_accum
        return MixtureChange(at, None if held is None else step + held - current + 1)

    def last_indices(self) -> np.ndarray:
        """Dataset indices of the batch just delivered, one per member in order: the identity of every sample the
        training loop saw (under a filter, the kept ones; with filtered='masked', every member)."""
        if self._stream is not None:
            raise TypeError("an IterableDataset has no sample indices; use a map-style dataset for sample identity")
        assert self.resumable_sampler is not None, _MAP_STYLE
        ids = self.resumable_sampler.last_indices()
        if self._kept is None or self._filter is None or self._filter[1] == MASKED:  # verdicts only with a filter
            return ids
        return ids[self._kept]

    def last_filtered(self) -> np.ndarray:
        """Dataset indices the filter dropped from the batch just delivered (recorded as "filtered by policy",
        never trained): empty without a filter."""
        return self._verdicts()[1]

    def last_kept(self) -> np.ndarray:
        """Per member of the batch just delivered, in order, whether the filter kept it: with filtered='masked'
        the rows to train on (zero the loss of the others); otherwise every member was kept."""
        ids = self.last_indices()
        if self._kept is None or self._filter is None or self._filter[1] == REMOVED:  # verdicts only with a filter
            return np.ones(len(ids), dtype=bool)
        return self._kept.copy()

    def _verdicts(self) -> tuple[np.ndarray, np.ndarray]:
        """The indices of the batch just delivered that the filter kept, and those it dropped."""
        if self._stream is not None:
            raise TypeError(
                "an IterableDataset has no sample indices: its records the filter dropped are counted "
                "(metrics()['filtered'], ['total/filtered']) and named by shard and record in a ledger opened with "
                "Ledger.open_stream (python -m loader audit lists them)"
            )
        assert self.resumable_sampler is not None, _MAP_STYLE
        ids = self.resumable_sampler.last_indices()
        if self._kept is None:
            return ids, ids[:0]
        return ids[self._kept], ids[~self._kept]

    @property
    def _is_accelerate_prepared(self) -> bool:
        """accelerate's `prepare()` asks this first. Its answer for any other DataLoader is to rebuild it with its own
        batch sharding, which would shard this loader's already sharded batches again (half the samples trained at
        2 processes) and drop its state_dict(): so refuse, at prepare time, saying what works instead."""
        raise TypeError(
            "accelerator.prepare() would rebuild this ResumableDataLoader with accelerate's own sharding and lose "
            "its progress: it is already sharded by rank and resumable, so leave it out of prepare(). Prepare the "
            "model and optimizer only, call accelerator.register_for_checkpointing(loader) so that save_state() and "
            "load_state() carry its progress, move each batch with batch.to(accelerator.device), and step the "
            "optimizer when loader.update_complete (see docs/frameworks.md, Hugging Face Accelerate)"
        )

    def close(self) -> None:
        """Release now what the loader holds, rather than at the interpreter's exit, after the process group is gone
        (see docs/checkpoints.md, teardown): the worker processes (the active iterator's, which stops, and
        persistent ones) and the attached ledger's file. Nothing delivered is lost: a new iter() continues after the
        last delivered batch, with new workers. Leaving a `with loader:` block closes it."""
        active = self.__dict__.get("_active")
        delivery = None if active is None else active()
        if delivery is not None and delivery._stopped is None:
            delivery._stop_workers(_CLOSED)
        self._drop_stale_workers(stale=True)
        if self.ledger is not None:
            self.ledger.close()

    def __enter__(self) -> ResumableDataLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self, *, check_lockstep: bool = True) -> dict:
        """This rank's progress in completed updates: small, plain Python types, JSON- and torch.save-able. Its
        `base` entry (the progress this run resumed from) is one shared dict, as modules share tensors: copy the
        state (copy.deepcopy) before editing it.

        Under torch.distributed it also checks that the ranks are in lockstep, so that this state may stand for
        every rank (see `loader.checkpoint.lockstep`); a state taken otherwise is marked and warned about.
        `check_lockstep=False` is for callers that gather every rank's state anyway."""
        # no rank resolution: before the first iter() nothing was delivered, and a state without progress means
        # the same under any layout
        stream = self._stream
        if stream is not None:  # a stream's state is its rank's alone: no lockstep to check
            state = stream.state_dict()
            if self._tails and self.ledger is not None and stream.settled:  # this state holds their workers' ends:
                self._record_tails(self.ledger.step)  # it consumes them, after the step it stands for
            return state
        sampler = self.resumable_sampler
        assert sampler is not None, _EITHER
        state = sampler.state_dict()
        if check_lockstep and self._world_size > 1:
            mark = self._lockstep.check(self._rank, self._world_size, sampler.progress_id)
            if mark is not None:
                warn_out_of_step(self._rank, mark)
                state = {**state, "lockstep": mark}
        return state

    def skip(
        self,
        *,
        updates: int | range | None = None,
        positions: range | ArrayLike | None = None,
        indices: range | ArrayLike | None = None,
        epoch: int | None = None,
    ) -> np.ndarray:
        """Skip data deterministically, e.g. around a loss spike after a rewind to a checkpoint: `updates=n` the
        next n optimizer updates (`range(a, b)`: updates a..b-1 counted from the next one, 0), `positions=` (a
        range or integers) of `epoch` (default: the epoch the next batch comes from), or `indices=`: dataset indices
        (as the ledger and the audit list them), wherever `epoch`'s order puts them. The skipped samples are
        committed as "skipped on request": never served, recorded in the state (and by the ledger, which the audit
        reports in a column of their own), and every other sample stays exactly once at any world size.

        Call it alike on every rank, between optimizer updates (a rank that differs is refused at the next merge,
        naming it). It supersedes the active iterator: iterate a new one. Returns the skipped position intervals."""
        if self._stream is not None:
            raise TypeError("skip() needs sample positions, which an IterableDataset does not have")
        self._resolve_rank_and_world()  # updates count global batches of the world size the job runs at
        self._settle()
        assert self.resumable_sampler is not None, _MAP_STYLE
        spans = self.resumable_sampler.skip(epoch, positions, updates, indices)
        self._supersede()
        return spans

    def load_state_dict(self, state: dict | list | tuple) -> None:
        """A merged state (see `merge_states`), the list of all ranks' states, or one rank's state (standing for
        every rank in lockstep), saved at any world size. It supersedes the active iterator.

        Validated in full first: a rejected state raises StateError and leaves the loader unchanged."""
        self._settle()
        progress = self._stream or self.resumable_sampler
        assert progress is not None, _EITHER
        progress.load_state_dict(state)
        self._tails.clear()  # of the progress the loaded state replaces: its stream names them again if it reads them
        self.__dict__.update(_step_base=None, _updates=0)  # the state holds no step: `resume` sets it
        self._supersede()
        self.monitor.loaded(perf_counter())
        self._follow_ramp()
