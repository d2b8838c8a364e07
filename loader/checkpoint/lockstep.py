"""Whether the ranks ran in lockstep, so that one rank's `state_dict()` may stand for every rank.

Why: most scripts and frameworks (Lightning, Accelerate) save rank 0's state alone. That is exact when every
optimizer update involved every rank, as under DDP or FSDP, and silently wrong otherwise (a rank that left its
loop early, ranks that consume unequal amounts): the restart would re-serve what the others trained, or skip it.

How, without a collective (a rank-0-only caller must never block): each rank publishes, through the process
group's key-value store, how many updates it completed since its progress was last set (one round trip per
optimizer update, and only with more than one rank). `state_dict()` compares: data rank 0 with every rank, the
others with rank 0. A state taken after the optimizer step of a lockstep run sees every other rank at the same
count or one update ahead (it cannot finish the next update before this rank joins it), never behind (that
rank's batches of this update fed this step) and never further. A state taken otherwise, whether the ranks drifted
apart or the state was taken before the step (which would count an update the model has not learnt from), is
marked, with a warning, and loading it alone is refused (`loader.core.state.progress_of`).

Each round trip runs on a daemon thread that the rank waits for a bounded time (`round_trip_bound`), since torch's
store client never returns from a host that stopped answering, whatever its timeout: the check must never hold a
rank where the job itself would not wait. A store that fails or stalls turns the check off, with a warning.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import warnings
from typing import Any, Callable

import torch.distributed as dist

from loader.core.collectives import distributed

_PREFIX = "loader/lockstep"
_identities: collections.Counter = collections.Counter()  # loaders of one identity that published so far here
MOST_WAIT = 5.0  # seconds a round trip may take, at most: a store this slow is as good as stopped for the check


class LockstepWarning(UserWarning):
    """A rank's state was taken while another rank had completed a different number of updates: the state does
    not stand for every rank, so it must not be saved alone."""


def out_of_step(own_updates: int, other_updates: int) -> bool:
    """Whether another rank's count of completed updates is impossible at a step of a lockstep run."""
    return not 0 <= other_updates - own_updates <= 1  # taken after this rank's optimizer step


def _updates_in(value: bytes, token: tuple[int, str, int]) -> int | None:
    """The updates a published value counts, if it counts them from the same progress as `token`."""
    fields = value.decode(errors="replace").split(":")
    if len(fields) != 3 or fields[:2] != [str(token[0]), token[1]] or not fields[2].isdigit():
        return None
    return int(fields[2])


def _store():
    """The default process group's store, or None (one process, or a torch without it: then nothing is checked)."""
    if not distributed():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def round_trip_bound() -> float:
    """Seconds to wait for a store round trip: MOST_WAIT, or a quarter of the default process group's timeout
    (every backend's) when that is shorter, so that a rank facing a stopped store reaches its next collective, and
    fails there as plain torch would, well before that collective's own timeout."""
    try:
        group = dist.distributed_c10d._get_default_group()
        timeouts = [group._get_backend(device).options._timeout.total_seconds() for device in group._device_types]
    except (AttributeError, RuntimeError, ValueError):  # torch's internals moved: the fixed bound alone
        timeouts = []
    return min([MOST_WAIT, *(timeout / 4 for timeout in timeouts)])


class _Stalled(TimeoutError):
    """A store round trip that did not return in time."""


class _StoreThread:
    """The daemon thread that makes this process's store round trips, one at a time, in order. One abandoned in a
    round trip that never returned is replaced by a new one (as is one a fork left behind)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._abandoned = False
        self._thread = threading.Thread(target=self._serve, name="loader-lockstep-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._abandoned:
            self._jobs.get()()

    def usable(self) -> bool:
        return not self._abandoned and self._thread.is_alive()

    def call(self, fn: Callable[[], Any], bound: float) -> Any:
        """fn()'s result or error; _Stalled after `bound` seconds, fn left to finish (or not) on its own."""
        done, outcome = threading.Lock(), []  # released when done: a lock is the cheapest handoff (an Event's
        done.acquire()  # wait costs twice as much)

        def job() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as error:  # handed to the caller, whatever it is
                outcome.append((False, error))
            done.release()

        self._jobs.put(job)
        if not done.acquire(timeout=bound):
            self._abandoned = True
            raise _Stalled(f"the process group's store did not answer within {bound:g} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


_store_thread: _StoreThread | None = None
_store_thread_lock = threading.Lock()


def _round_trip(fn: Callable[[], Any]) -> Any:
    """fn() (store calls) on the store thread, waited for at most `round_trip_bound()` seconds."""
    global _store_thread
    with _store_thread_lock:
        if _store_thread is None or not _store_thread.usable():
            _store_thread = _StoreThread()
        thread = _store_thread
    return thread.call(fn, round_trip_bound())


class LockstepWatch:
    """One loader's publication of its completed updates, and its comparison with the other ranks'.

    A published value is "generation:base digest:updates", so counts are compared only between ranks that set
    their progress the same number of times to the same base (a rank that has not yet loaded the checkpoint the
    others loaded is not compared, rather than compared wrongly)."""

    def __init__(self, identity: str):
        self._identity = identity
        self._keys: str | None = None  # the key prefix, fixed at the first publication (see `_key`)
        self._published: str = ""
        self._progress: tuple[int, str] | None = None  # the progress_id updates are counted from
        self._updates = 0
        self._off = False  # the store failed or stalled once (see `_ask`): never touched again

    def _store(self):
        return None if self._off else _store()

    def _ask(self, calls: Callable[[], Any]) -> Any:
        """calls() (store calls) on the store thread; None, with the check off for good, when the store fails or
        stalls: a check never breaks or holds training, it stops with a warning."""
        try:
            return _round_trip(calls)
        except (RuntimeError, _Stalled) as error:  # torch.distributed's store errors are RuntimeErrors
            self._off = True
            cause = str(error) if isinstance(error, _Stalled) else f"the process group's store failed ({error!r})"
            warnings.warn(f"the lockstep check is off for this loader: {cause}; a state taken out of lockstep will "
                          f"not be marked", LockstepWarning, stacklevel=5)
            return None

    def _token(self, progress_id: tuple[int, str]) -> tuple[int, str, int]:
        if progress_id != self._progress:  # the progress was set anew: nothing completed since
            self._progress, self._updates = progress_id, 0
        return (*progress_id, self._updates)

    def completed_update(self, rank: int, progress_id: tuple[int, str]) -> None:
        """This rank delivered the last micro-batch of an optimizer update."""
        self._token(progress_id)
        self._updates += 1
        self.publish(rank, (*progress_id, self._updates))

    def _key(self, rank: int) -> str:
        if self._keys is None:  # SPMD: every rank makes its loaders in the same order, so the n-th loader of an
            _identities[self._identity] += 1  # identity is the same loader on every rank; torchrun's restart
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")  # count keeps a store shared across
            self._keys = f"{_PREFIX}/{attempt}/{self._identity}/{_identities[self._identity]}"  # launches apart
        return f"{self._keys}/{rank}"

    def publish(self, rank: int, token: tuple[int, str, int]) -> None:
        """Make this rank's (generation, base digest, updates) visible to the others before returning: the store
        answers a compare-and-set, so a rank that reads after this rank's next collective sees it. Ranks sharing a
        data rank (tensor parallel) publish the same sequence: a value one of them set already (this count or the
        next) is left as it is, anything else (an older count, a value of an earlier use of the store) replaced."""
        store = self._store()
        if store is None:
            return
        value = ":".join(map(str, token))
        if value == self._published:
            return
        key, published = self._key(rank), self._published

        def write() -> None:
            current = _updates_in(store.compare_set(key, published, value), token)
            if current not in (token[2], token[2] + 1):  # a peer is at most an update ahead: else it is stale
                store.set(key, value)
                store.check([key])  # answered after the set is applied

        self._ask(write)
        self._published = value

    def check(self, rank: int, world_size: int, progress_id: tuple[int, str]) -> dict | None:
        """The first rank found out of step with this one, as the mark a state carries, or None."""
        store = self._store()
        if store is None or world_size == 1:
            return None
        token = self._token(progress_id)
        self.publish(rank, token)
        others = [r for r in (range(world_size) if rank == 0 else (0,)) if r != rank]
        keys = [self._key(r) for r in others]

        def read() -> list[bytes]:
            return store.multi_get(keys) if store.check(keys) else [
                store.get(key) if store.check([key]) else b"" for key in keys
            ]

        values = None if self._off else self._ask(read)  # off: the publication just failed
        if values is None:
            return None
        for other, value in zip(others, values):
            updates = _updates_in(value, token)
            if updates is not None and out_of_step(token[2], updates):
                return {"rank": other, "updates": updates, "own_updates": token[2]}
        return None


def warn_out_of_step(rank: int, mark: dict) -> None:
    warnings.warn(
        f"rank {rank}'s state_dict() was taken while rank {mark['rank']} had completed {mark['updates']} optimizer "
        f"updates since the progress was last set, and rank {rank} {mark['own_updates']}: the ranks are not in "
        f"lockstep (or this state was taken before the optimizer step), so it does not stand for every rank and a "
        f"restart refuses it alone. Take it after the optimizer step; for ranks that consume unequal amounts, save "
        f"every rank's progress: loader.checkpoint.save_checkpoint (or LoaderState for DCP), or the list of every "
        f"rank's state_dict()",
        LockstepWarning,
        stacklevel=3,
    )
