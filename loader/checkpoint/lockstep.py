"""Whether the ranks ran in lockstep, so that one rank's `state_dict()` may stand for every rank.

Why: most scripts and frameworks (Lightning, Accelerate) save rank 0's state alone. That is exact when every
optimizer update involved every rank, as under DDP or FSDP, and silently wrong otherwise (a rank that left its
loop early, ranks that consume unequal amounts): the restart would re-serve what the others trained, or skip it.

How, without a collective (a rank-0-only caller must never block): ranks publish, through the process group's
key-value store, how many updates they completed since their progress was last set, and compare. In a lockstep
run, a rank that delivers the last micro-batch of its update u sees any other rank at u - 1 or u (every rank
delivered update u - 1 before this rank's step of it, and none delivers u + 1 before this rank's step of u); a
state taken after the optimizer step of update c sees every other rank at c or c + 1, never behind (that rank's
batches of update c fed this step) and never further. A state taken otherwise, whether the ranks drifted apart or
the state was taken before the step (which would count an update the model has not learnt from), is marked, with
a warning, and loading it alone is refused (`loader.core.state.progress_of`).

Up to EXACT ranks the check is exact: every rank publishes at every optimizer update (one round trip), and
`state_dict()` compares data rank 0 with every rank, the others with rank 0. Beyond, one store must not serve a
request per rank per step (65,536 at the largest jobs), so the ranks take turns: rank 0 publishes at every update,
each other rank at one update in `period(W)` (a rotation: at most SAMPLE ranks at any update). A rank at its turn
publishes and reads rank 0's count; rank 0 at each update reads the counts of the ranks whose turn was the update
before; whoever finds the two out of step leaves a mark that every later `state_dict()` of rank 0 carries until
the progress is set anew. So a rank out of step with rank 0 for `period(W)` consecutive updates (1,024 at 65,536
ranks) is always caught, one out of step at fewer is caught with probability 1 / period(W) per update (each rank
is seen once per period), and the store serves at most EXACT requests per step whatever W, besides one
per rank at the first update after the progress is set (so that a rank that stops before its first turn leaves a
count behind; the job's rendezvous costs as much). Between a divergence and its discovery rank 0's states are not
marked; states of other ranks keep the exact comparison with rank 0 at any W.

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
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from loader.core.collectives import distributed

_PREFIX = "loader/lockstep"
_identities: collections.Counter = collections.Counter()  # loaders of one identity that published so far here
MOST_WAIT = 5.0  # seconds a round trip may take, at most: a store this slow is as good as stopped for the check
SAMPLE = 64  # ranks besides rank 0 that take their turn at one update, at most
EXACT = 3 * (1 + SAMPLE)  # requests per step the turns cost at most (rank 0's and each turn's: a publication, and a
# check and a read of counts): up to as many ranks, every rank publishes at every update, which costs no more


class LockstepWarning(UserWarning):
    """A rank's state was taken while another rank had completed a different number of updates: the state does
    not stand for every rank, so it must not be saved alone."""


def out_of_step(own_updates: int, other_updates: int, stepped: bool = True) -> bool:
    """Whether another rank's count of completed updates is impossible in a lockstep run, seen after this rank's
    optimizer step (`stepped`), or as this rank delivers the last micro-batch of its update, before the step."""
    low = 0 if stepped else -1
    return not low <= other_updates - own_updates <= low + 1


def period(world_size: int) -> int:
    """Updates between two turns of a rank other than 0: 1 (every rank at every update) up to EXACT ranks."""
    return 1 if world_size <= EXACT else -(-(world_size - 1) // SAMPLE)


def due(rank: int, updates: int, world_size: int) -> bool:
    """Whether a rank other than 0 takes its turn at its `updates`-th update since its progress was set."""
    return (updates + rank) % period(world_size) == 0


def due_ranks(updates: int, world_size: int) -> range:
    """The ranks other than 0 whose turn is their `updates`-th update: each residue of rank mod `period` in turn,
    at most SAMPLE of them."""
    step = period(world_size)
    return range((-updates) % step or step, world_size, step)


def _counts(value: bytes, token: tuple[int, str, int], fields: int) -> list[int] | None:
    """The counts a published value holds after its progress (generation, base digest), if it counts them from
    the same progress as `token`."""
    parts = value.decode(errors="replace").split(":")
    if len(parts) != 2 + fields or parts[:2] != [str(token[0]), token[1]] or not all(p.isdecimal() for p in parts[2:]):
        return None
    return [int(p) for p in parts[2:]]


def _read(store: dist.Store, keys: list[str]) -> list[bytes]:
    """The values of the keys, b"" for a key not set yet (a plain get would wait for it)."""
    return (
        store.multi_get(keys) if store.check(keys) else [store.get(key) if store.check([key]) else b"" for key in keys]
    )


def _store() -> dist.Store | None:
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

    def __init__(self) -> None:
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
    others loaded is not compared, rather than compared wrongly). `store`: a store client of this watch's own,
    called directly rather than through the store thread, whose keys the identity alone names (many ranks
    simulated in one process, as `benchmarks.scale` does); by default the process group's store."""

    def __init__(self, identity: str, store: dist.Store | None = None) -> None:
        self._identity = identity
        self._given = store
        self._keys: str | None = None if store is None else f"{_PREFIX}/{identity}"  # the key prefix, else fixed
        # at the first publication (see `_key`)
        self._published: str = ""
        self._progress: tuple[int, str] | None = None  # the progress_id updates are counted from
        self._updates = 0
        self._found: dict | None = None  # beyond EXACT ranks, since the progress was set: on rank 0 the mark
        # of the first rank found out of step, which every later state of rank 0 carries; on the others the one they
        # left for rank 0 (once)
        self._off = False  # the store failed or stalled once (see `_ask`): never touched again

    def _store(self) -> dist.Store | None:
        return None if self._off else self._given if self._given is not None else _store()

    def _ask(self, calls: Callable[[], Any]) -> Any:
        """calls() (store calls) on the store thread; None, with the check off for good, when the store fails or
        stalls: a check never breaks or holds training, it stops with a warning."""
        try:
            return calls() if self._given is not None else _round_trip(calls)
        except (RuntimeError, _Stalled) as error:  # torch.distributed's store errors are RuntimeErrors
            self._off = True
            cause = str(error) if isinstance(error, _Stalled) else f"the process group's store failed ({error!r})"
            warnings.warn(
                f"the lockstep check is off for this loader: {cause}; a state taken out of lockstep will not be marked",
                LockstepWarning,
                stacklevel=5,
            )
            return None

    def _token(self, progress_id: tuple[int, str]) -> tuple[int, str, int]:
        if progress_id != self._progress:  # the progress was set anew: nothing completed since, nothing found
            self._progress, self._updates, self._found = progress_id, 0, None
        return (*progress_id, self._updates)

    def completed_update(self, rank: int, progress_id: tuple[int, str], world_size: int) -> None:
        """This rank delivered the last micro-batch of an optimizer update: publish (every rank up to EXACT ranks,
        else rank 0, the ranks whose turn it is, and every rank at its first update since its progress was set, so
        that a rank that stops before its first turn leaves a count behind) and, beyond EXACT ranks, compare
        (see the module)."""
        self._token(progress_id)
        self._updates += 1
        token = (*progress_id, self._updates)
        if rank == 0 or period(world_size) == 1 or self._updates == 1 or due(rank, self._updates, world_size):
            self.publish(rank, token)
        if period(world_size) == 1 or self._found is not None:
            return
        if rank == 0:  # the ranks whose turn was the update before: each published it before rank 0 got here
            others = list(due_ranks(self._updates - 1, world_size)) if self._updates > 1 else []
            self._found = self._compare(others, token, stepped=False)
        elif due(rank, self._updates, world_size):
            self._found = self._compare([0], token, stepped=False)
            store = self._store()
            if self._found is not None and store is not None:  # left for rank 0, as rank 0 would have found it
                key, found = (
                    self._key("found"),
                    ":".join(map(str, (*token[:2], rank, self._updates, self._found["updates"]))),
                )
                self._ask(lambda: store.set(key, found))

    def _key(self, rank: int | str) -> str:
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
            current = _counts(store.compare_set(key, published, value), token, 1)
            if current not in ([token[2]], [token[2] + 1]):  # a peer is at most an update ahead: else it is stale
                store.set(key, value)
                store.check([key])  # answered after the set is applied

        self._ask(write)
        self._published = value

    def _compare(self, others: list[int], token: tuple[int, str, int], stepped: bool) -> dict | None:
        """The first of `others` whose published count is out of step with this rank's, as the mark a state
        carries, or None (also when nothing is to be read, or the store is off)."""
        store = self._store()
        if store is None or not others:
            return None
        keys = [self._key(r) for r in others]  # here: the first call counts this loader's identity
        values = self._ask(lambda: _read(store, keys))
        for other, value in zip(others, values or ()):
            counts = _counts(value, token, 1)
            if counts is not None and out_of_step(token[2], counts[0], stepped):
                return {"rank": other, "updates": counts[0], "own_updates": token[2]}
        return None

    def check(self, rank: int, world_size: int, progress_id: tuple[int, str]) -> dict | None:
        """The first rank found out of step with this one, as the mark a state carries, or None. Up to EXACT
        ranks: rank 0 reads every rank's count, the others rank 0's. Beyond: rank 0 carries what it or the ranks at
        their turns found, else compares with the ranks whose turn was its last update; the others read rank 0's."""
        if self._store() is None or world_size == 1:
            return None
        token, exact = self._token(progress_id), period(world_size) == 1
        if rank == 0 or exact:
            self.publish(rank, token)
        if rank != 0:
            return self._compare([0], token, stepped=True)
        if exact:
            return self._compare(list(range(1, world_size)), token, stepped=True)
        store = self._store()
        if self._found is None and store is not None:
            key = self._key("found")
            values = self._ask(lambda: _read(store, [key]))
            counts = _counts(values[0], token, 3) if values else None
            if counts is not None:
                self._found = {"rank": counts[0], "updates": counts[1], "own_updates": counts[2]}
        if self._found is None and token[2] > 0:
            return self._compare(list(due_ranks(token[2], world_size)), token, stepped=True)
        return self._found


def warn_out_of_step(rank: int, mark: dict) -> None:
    warnings.warn(
        f"rank {rank}'s state_dict() was taken after rank {mark['rank']} had completed {mark['updates']} optimizer "
        f"updates since the progress was last set, and rank {rank} {mark['own_updates']}: the ranks are not in "
        f"lockstep (or this state was taken before the optimizer step), so it does not stand for every rank and a "
        f"restart refuses it alone. Take it after the optimizer step; for ranks that consume unequal amounts, save "
        f"every rank's progress: loader.checkpoint.save_checkpoint (or LoaderState for DCP), or the list of every "
        f"rank's state_dict()",
        LockstepWarning,
        stacklevel=3,
    )
