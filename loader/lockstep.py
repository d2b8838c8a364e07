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
marked, with a warning, and loading it alone is refused (`loader.state.progress_of`).
"""

from __future__ import annotations

import collections
import os
import warnings

import torch.distributed as dist

from loader.collectives import distributed

_PREFIX = "loader/lockstep"
_identities: collections.Counter = collections.Counter()  # loaders of one identity that published so far here


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
        self._off = False  # the store failed once: a check never breaks training, it stops (with a warning)

    def _store(self):
        return None if self._off else _store()

    def _give_up(self, error: RuntimeError) -> None:
        self._off = True
        warnings.warn(f"the lockstep check is off for this loader: the process group's store failed ({error!r}); "
                      f"a state taken out of lockstep will not be marked", LockstepWarning, stacklevel=4)

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
        key = self._key(rank)
        try:
            current = _updates_in(store.compare_set(key, self._published, value), token)
            if current not in (token[2], token[2] + 1):  # a peer is at most an update ahead: else it is stale
                store.set(key, value)
                store.check([key])  # answered after the set is applied
        except RuntimeError as error:  # torch.distributed's store errors are RuntimeErrors
            self._give_up(error)
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
        try:
            values = store.multi_get(keys) if store.check(keys) else [
                store.get(key) if store.check([key]) else b"" for key in keys
            ]
        except RuntimeError as error:
            self._give_up(error)
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
