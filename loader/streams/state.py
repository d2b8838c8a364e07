"""The state of a stream (IterableDataset): its serialised form, its validation, and the merge of per-rank states.

A rank's stream state says where its pass stands (epoch, batches delivered in completed updates, whether the stream
was exhausted and whether its end was handed out) and, per worker (one, the main process, at num_workers=0):
`workers`, its snapshot after the last batch delivered (None: none yet in this pass), and `origins`, its state when
the pass began (the end of the previous pass, where the dataset objects live on: persistent workers or the main
process; None: a fresh copy seeded from `base_seed`; before the first pass at num_workers=0, the main process's
dataset as it stood). `next_worker` is the worker torch's round robin serves next.
A sharded stream adds its shard list's identity, the order's seed and the global shard progress the rank started
from (`base`). `stream` names the stream the state belongs to (see `stream_identity`). A snapshot's progress (its
batches, whether its stream ended, its shard position) and a rank's (its epoch, batch count, flags, next worker and
shard progress) carry a checksum (`check`, see `checksum`). Everything is validated before anything changes; a bad
state is a short StateError.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import zlib
from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from loader.core.checks import is_int
from loader.core.progress import normalize
from loader.core.state import (
    FORMAT,
    LARGEST,
    MAX_EPOCHS_AHEAD,
    VERSION,
    StateError,
    _check_ranks,
    _get,
    check_header,
    intervals_from_json,
    intervals_to_json,
    short,
)
from loader.streams.shards import EpochShards, RankShards, ShardDeal, ShardProgress, merge

SNAPSHOT_KEYS = ("batches", "ended", "dataset", "iterator", "shard", "rng", "check")
STATE_KEYS = (
    "format",
    "version",
    "kind",
    "world_size",
    "rank",
    "epoch",
    "batches",
    "exhausted",
    "ended",
    "num_workers",
    "base_seed",
    "next_worker",
    "origins",
    "workers",
    "shards",
    "stream",
    "check",
)
IDENTITY_KEYS = ("class", "length", "fingerprint")
_RNG_FIXED = 8 * 3 + 8 * 2 + 4 * 624 + 4 * 625  # see loader.streams.rng


def _seed(value: Any, where: str) -> int | None:
    if value is not None and not (is_int(value) and 0 <= value < 2**64):
        raise StateError(f"{where} must be None or a 64-bit seed, got {short(value)}: the state is corrupted")
    return value


def _check_rng(text: object, where: str) -> None:
    if text is None:
        return
    try:
        packed = base64.b64decode(text, validate=True) if isinstance(text, str) else None
    except (binascii.Error, ValueError):
        packed = None
    if packed is None or len(packed) != _RNG_FIXED + torch.get_rng_state().numel():
        raise StateError(f"{where}.rng is not a random state of this torch: the state is corrupted")


# A worker's snapshot as the loader keeps it: the tuple (batches, ended, dataset, iterator, shard, rng), `shard` a
# (task, next record) tuple or None. Made with every batch and sent with it: a tuple pickles and unpickles 3-5x
# faster than the dict a state holds, and nothing can change it once made. It becomes that dict, with its checksum,
# only when a state is taken (`snapshot_dict`).
BATCHES, ENDED, DATASET, ITERATOR, SHARD, RNG = range(6)


# A check taken with every state is `checksum`'s CRC continued over the parts of its text: the repr of the count
# that moves with every batch is formatted, the parts that stay (the rest of a rank's progress, a snapshot's end)
# are formatted once per pass (`PassState`) or are constants (`_SNAPSHOT_ENDS`): the same CRC of the same text,
# half the instructions of formatting it whole.
_OPEN = zlib.crc32(b"(")
_SNAPSHOT_ENDS = {ended: f", {ended!r}, None)".encode() for ended in (False, True)}  # of a plain stream's snapshot


def snapshot_dict(snapshot: tuple, check: int | None = None) -> dict:
    """A snapshot as a state holds it, a new dict each time, so that editing a state taken changes nothing the
    loader holds; with its check, `checksum(batches, ended, shard)` (its shard as a list), computed here unless
    given (the check of this snapshot computed before)."""
    batches, ended, dataset, iterator, shard, rng = snapshot
    if shard is not None:
        shard = list(shard)
    if check is None:
        end = _SNAPSHOT_ENDS[ended] if shard is None else f", {ended!r}, {shard!r})".encode()
        check = zlib.crc32(repr(batches).encode() + end, _OPEN)
    return {
        "batches": batches,
        "ended": ended,
        "dataset": dataset,
        "iterator": iterator,
        "shard": shard,
        "rng": rng,
        "check": check,
    }


def _copied(snapshot: dict) -> dict:
    """A snapshot's serialised form as a new dict (a C-level copy), its shard a new list."""
    copy = snapshot.copy()
    if copy["shard"] is not None:
        copy["shard"] = list(copy["shard"])
    return copy


def snapshot_of(value: dict | None) -> tuple | None:
    """Undo `snapshot_dict` (of a validated dict)."""
    if value is None:
        return None
    shard = value["shard"]
    return (
        value["batches"],
        value["ended"],
        value["dataset"],
        value["iterator"],
        None if shard is None else tuple(shard),
        value["rng"],
    )


def checksum(*progress: object) -> int:
    """A CRC-32 of progress that nothing else in a state confirms: whether a worker's stream ended (its length is the
    stream's, which the loader does not know), its batch count and shard position, a rank's epoch (a sharded rank
    past an epoch read all of its share of it) and shard progress. Changed after the state was saved, they would
    silently drop or repeat records; with it, such a state is refused. It guards against corruption and careless
    edits, not against someone who recomputes it."""
    return zlib.crc32(repr(progress).encode())


def _check_snapshot(value: dict, where: str, rank: int) -> None:
    check, batches, ended, shard = value["check"], value["batches"], value["ended"], value["shard"]
    if check == checksum(batches, ended, shard):
        return
    if check == checksum(batches, not ended, shard):
        changed = f"{where}.ended was changed (it would {'drop' if ended else 'read on past'} that worker's rest)"
    else:
        changed = f"{where}.batches, .shard or .check was changed"
    raise StateError(
        f"the state of rank {rank}: {changed} after the state was saved: they do not match "
        f"{where}.check. The state is corrupted: load the state as it was saved"
    )


def _earlier_release(where: str, field: str) -> StateError:
    return StateError(
        f"{where} was saved by an earlier release, which did not record {field}: resuming it could skip "
        f"or repeat records. Start the stream's epoch again (construct the loader without loading it)"
    )


def _snapshot(value: Any, where: str, sharded: bool, rank: int) -> dict | None:
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == set(SNAPSHOT_KEYS) - {"check"}:
        raise _earlier_release(where, "its check")
    if not isinstance(value, dict) or set(value) != set(SNAPSHOT_KEYS):
        raise StateError(f"{where} must be None or a dict with fields {SNAPSHOT_KEYS}, got {short(value)}")
    _get(value, "batches", int, where)
    _get(value, "ended", bool, where)
    _get(value, "check", int, where)
    _check_rng(value["rng"], where)
    shard = value["shard"]
    if sharded:
        if not (isinstance(shard, list) and len(shard) == 2 and all(is_int(v) and 0 <= v < LARGEST for v in shard)):
            raise StateError(f"{where}.shard must be [task, next record], got {short(shard)}")
        if value["dataset"] is not None or value["iterator"] is not None:
            raise StateError(f"{where} of a sharded stream holds a dataset state: the state is corrupted")
    elif shard is not None:
        raise StateError(f"{where}.shard is set, but the stream is not sharded: the state is corrupted")
    _check_snapshot(value, where, rank)
    return value


def stream_identity(dataset: Any) -> dict:
    """What a stream state is compared with on load: the stream's class, its len() when it has one, and its
    `fingerprint()` when it offers one (a str naming its content: files, a version). Not its repr, which by default
    names the object's address, another in every process."""
    try:
        length = len(dataset)
    except TypeError:  # no len(), or one that says so
        length = None
    fingerprint = dataset.fingerprint() if callable(getattr(dataset, "fingerprint", None)) else None
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise TypeError(f"{type(dataset).__name__}.fingerprint() must return a str, got {short(fingerprint)}")
    return {
        "class": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "length": length,
        "fingerprint": fingerprint,
    }


def check_identity(saved: dict | None, current: dict, rank: int) -> None:
    """A state of another stream names other records: refused, naming what differs. A state saved before the
    identity was recorded (None) is not compared."""
    if saved is None:
        return
    for name, hint in (
        ("class", "construct the loader with the stream class that saved it"),
        ("length", "the stream's len() changed: its progress would name other records"),
        ("fingerprint", "the stream's fingerprint() changed: it reads other records"),
    ):
        if saved[name] != current[name]:
            raise StateError(
                f"the state of rank {rank}: stream.{name} is {short(saved[name])} in the saved state "
                f"but {short(current[name])} in this loader: {hint}"
            )


def _identity(value: Any, where: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(IDENTITY_KEYS):
        raise StateError(f"{where} must be None or a dict with fields {IDENTITY_KEYS}, got {short(value)}")
    _get(value, "class", str, where)
    if value["length"] is not None:
        _get(value, "length", int, where)
    _get(value, "fingerprint", (str, type(None)), where)
    return value


def check_payloads(ranks: list[RankStream], dataset: IterableDataset, stateful: bool) -> None:
    """A snapshot may hold a dataset state only for a dataset with load_state_dict (`stateful`), and an iterator state
    only where __iter__ is no generator function (a generator keeps no state): anything else would fail in a
    worker, after the state was accepted."""
    generator = inspect.isgeneratorfunction(type(dataset).__iter__)
    for r in ranks:
        for name, snapshots in (("origins", r.origins), ("workers", r.workers)):
            for i, snapshot in enumerate(snapshots):
                if snapshot is None:
                    continue
                if snapshot["dataset"] is not None and not stateful:
                    raise StateError(
                        f"the state of rank {r.rank}: {name}[{i}] holds a dataset state, but "
                        f"{type(dataset).__name__} has no load_state_dict: construct the loader with the dataset "
                        f"class that saved it"
                    )
                if snapshot["iterator"] is not None and generator:
                    raise StateError(
                        f"the state of rank {r.rank}: {name}[{i}] holds an iterator state, but "
                        f"{type(dataset).__name__}.__iter__ is a generator, which keeps none: construct the loader "
                        f"with the dataset class that saved it"
                    )


def _progress_to_dict(progress: ShardProgress) -> dict:
    return {
        "epoch": progress.epoch,
        "epochs": [
            {
                "epoch": e,
                "done": intervals_to_json(_spans(s.done)),
                "offsets": [[shard, offset] for shard, offset in sorted(s.offsets.items())],
            }
            for e, s in sorted(progress.epochs.items())
        ],
    }


def _spans(shards: Collection[int]) -> np.ndarray:
    """A set of shard indices as sorted, disjoint, non-touching intervals: a finished run of shards is one pair."""
    starts = np.fromiter(shards, dtype=np.int64, count=len(shards))
    return normalize(np.stack((starts, starts + 1), axis=1))


def _progress_from_dict(value: Any, count: int, where: str) -> ShardProgress:
    epoch = _get(value, "epoch", int, where)
    epochs = {}
    for i, entry in enumerate(_get(value, "epochs", list, where)):
        at = f"{where}.epochs[{i}]"
        e = _get(entry, "epoch", int, at)
        if e < epoch or e in epochs or e - epoch > MAX_EPOCHS_AHEAD:
            raise StateError(f"{at}.epoch is {e}: epochs must be distinct and from {epoch} on")
        (spans,) = intervals_from_json([_get(entry, "done", list, at)], count, lambda _: f"{at}.done")  # noqa: B023 (called here)
        done = set(np.concatenate([np.arange(a, b) for a, b in spans]).tolist()) if len(spans) else set()
        offsets = {}
        for pair in _get(entry, "offsets", list, at):
            if (
                not (
                    isinstance(pair, list)
                    and len(pair) == 2
                    and is_int(pair[0])
                    and 0 <= pair[0] < count
                    and is_int(pair[1])
                    and 0 < pair[1] < LARGEST
                )
                or pair[0] in done
                or pair[0] in offsets
            ):
                raise StateError(
                    f"{at}.offsets must be [shard, next record > 0] of unfinished shards, got {short(pair)}"
                )
            offsets[pair[0]] = pair[1]
        epochs[e] = EpochShards(frozenset(done), offsets)
    return ShardProgress(count, epoch, epochs)


@dataclass(frozen=True)
class Shards:
    """A sharded stream's identity (count and digest of its shard list, the order's seed and mode) and the global
    progress its rank started from."""

    count: int
    digest: str
    seed: int
    shuffle: bool
    base: ShardProgress

    @cached_property
    def serialised(self) -> dict:
        """Built once: the shards and their base progress do not change while a rank runs."""
        return {
            "count": self.count,
            "digest": self.digest,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "base": _progress_to_dict(self.base),
        }

    @cached_property
    def check(self) -> int:
        """The checksum of the shards and their base progress, in their canonical form (see `checksum`)."""
        return checksum(self.serialised)

    @classmethod
    def from_dict(cls, value: Any, where: str) -> Shards:
        count = _get(value, "count", int, where)
        digest = _get(value, "digest", str, where)
        seed = _get(value, "seed", int, where)
        shuffle = _get(value, "shuffle", bool, where)
        return cls(
            count, digest, seed, shuffle, _progress_from_dict(_get(value, "base", dict, where), count, f"{where}.base")
        )

    def deal(self, world_size: int, workers: int) -> ShardDeal:
        return ShardDeal(self.base, world_size, workers, self.seed, self.shuffle)

    def from_epoch(self, epoch: int) -> Shards:
        """These shards with no progress from `epoch` on, which set_epoch() starts from its start: a base of a
        resize past it would otherwise deal none of its shards (or only the rest), as no loader of the same layout
        does."""
        base = self.base
        kept = {e: s for e, s in base.epochs.items() if e < epoch}
        return replace(self, base=ShardProgress(base.count, min(base.epoch, epoch), kept))


@dataclass(frozen=True)
class RankStream:
    """One rank's stream state, parsed."""

    world_size: int
    rank: int
    epoch: int
    batches: int
    exhausted: bool
    ended: bool
    num_workers: int
    base_seed: int | None
    next_worker: int
    origins: tuple
    workers: tuple
    shards: Shards | None
    stream: dict | None

    def to_dict(self) -> dict:
        fixed = PassState(
            self.world_size,
            self.rank,
            self.epoch,
            self.num_workers,
            self.base_seed,
            list(self.origins),
            self.shards,
            self.stream,
        )
        return fixed.state(self.batches, self.exhausted, self.ended, self.next_worker, list(self.workers))

    @classmethod
    def from_dict(cls, state: Any, where: str = "state") -> RankStream:
        check_header(state, ("stream",), where)
        for field in ("num_workers", "check"):
            if field not in state:
                raise _earlier_release(where, field)
        if unknown := set(state) - set(STATE_KEYS):
            raise StateError(
                f"{where} has unknown fields {short(sorted(map(str, unknown)))}: the state is "
                f"corrupted or not a stream state of this release"
            )
        world_size, rank = _get(state, "world_size", int, where), _get(state, "rank", int, where)
        if world_size == 0 or rank >= world_size:
            raise StateError(f"{where}.rank is {rank}, outside world_size {world_size}: the state is corrupted")
        epoch, batches = _get(state, "epoch", int, where), _get(state, "batches", int, where)
        exhausted, ended = _get(state, "exhausted", bool, where), _get(state, "ended", bool, where)
        num_workers = _get(state, "num_workers", int, where)
        count = max(num_workers, 1)
        shards_value = _get(state, "shards", (dict, type(None)), where)
        shards = None if shards_value is None else Shards.from_dict(shards_value, f"{where}.shards")
        lists = {}
        for name in ("origins", "workers"):
            value = _get(state, name, list, where)
            if len(value) != count:
                raise StateError(
                    f"{where}.{name} has {len(value)} entries for {count} worker(s): the state is corrupted"
                )
            lists[name] = tuple(
                _snapshot(v, f"{where}.{name}[{i}]", shards is not None, rank) for i, v in enumerate(value)
            )
        next_worker = _get(state, "next_worker", int, where)
        delivered = sum(s["batches"] for s in lists["workers"] if s is not None)
        if (
            next_worker >= count
            or delivered != batches
            or (ended and not exhausted)
            or (exhausted and not all(s is not None and s["ended"] for s in lists["workers"]))
        ):
            raise StateError(
                f"{where}: its workers' snapshots ({delivered} batches, next worker {next_worker} of {count}) do not "
                f"add up to its progress ({batches} batches, exhausted={exhausted}, ended={ended}): the state is "
                f"corrupted"
            )
        if shards is not None and not (
            shards.base.epoch <= epoch <= shards.base.epoch + MAX_EPOCHS_AHEAD
            or (epoch == shards.base.epoch - 1 and exhausted and not batches)
        ):
            raise StateError(
                f"{where}.epoch is {epoch}, not within its shard progress from epoch "
                f"{shards.base.epoch}: the state is corrupted"
            )
        _check_rank(
            _get(state, "check", int, where), epoch, batches, exhausted, ended, next_worker, shards, where, rank
        )
        base_seed = _seed(_get(state, "base_seed", (int, type(None)), where), f"{where}.base_seed")
        stream = _identity(_get(state, "stream", (dict, type(None)), where, default=None), f"{where}.stream")
        rank_stream = cls(
            world_size,
            rank,
            epoch,
            batches,
            exhausted,
            ended,
            num_workers,
            base_seed,
            next_worker,
            lists["origins"],
            lists["workers"],
            shards,
            stream,
        )
        if shards is not None:
            rank_stream.check_positions(where)
        return rank_stream

    def check_positions(self, where: str) -> None:
        """Every worker's shard position must name one of its tasks in this epoch, at or after the task's start; a
        worker whose stream ended stands in its last task (its reader ends there)."""
        assert self.shards is not None, "checked for the states of a sharded stream only"
        deal = self.shards.deal(self.world_size, len(self.workers))
        for worker, value in enumerate(self.workers):
            if value is None or self.epoch < self.shards.base.epoch:
                continue
            tasks = deal.tasks(self.epoch, self.rank, worker)
            task, offset = value["shard"]
            if (task, offset) != (0, 0) and not (task < len(tasks) and offset >= tasks[task][1]):
                raise StateError(
                    f"{where}.workers[{worker}].shard is {[task, offset]}, but that worker reads {len(tasks)} "
                    f"shard(s) in epoch {self.epoch}: the state is corrupted or belongs to another run"
                )
            if value["ended"] and tasks and task != len(tasks) - 1:
                raise StateError(
                    f"the state of rank {self.rank}: {where}.workers[{worker}].ended is true, but its shard "
                    f"position {[task, offset]} is in task {task} of the {len(tasks)} it reads in epoch {self.epoch}: "
                    f"the state is corrupted"
                )

    def shard_positions(self) -> RankShards:
        positions = [None if s is None else "ended" if s["ended"] else tuple(s["shard"]) for s in self.workers]
        if self.exhausted:
            positions = ["ended"] * len(self.workers)
        return RankShards(self.rank, self.epoch, positions)


def _rank_check(epoch: int, batches: int, exhausted: bool, ended: bool, next_worker: int, shards: Shards | None) -> int:
    """`checksum(epoch, batches, exhausted, ended, next_worker, the shards' check)` (`PassState` continues it with
    every state)."""
    return checksum(epoch, batches, exhausted, ended, next_worker, None if shards is None else shards.check)


def _check_rank(
    check: int,
    epoch: int,
    batches: int,
    exhausted: bool,
    ended: bool,
    next_worker: int,
    shards: Shards | None,
    where: str,
    rank: int,
) -> None:
    if check == _rank_check(epoch, batches, exhausted, ended, next_worker, shards):
        return
    changed = [
        name
        for name, flipped in (("exhausted", (not exhausted, ended)), ("ended", (exhausted, not ended)))
        if check == _rank_check(epoch, batches, *flipped, next_worker, shards)
    ]
    fields = (
        f"{where}.{changed[0]} was" if changed else (f"{where}.epoch, .batches, .next_worker, .shards or .check was")
    )
    raise StateError(
        f"the state of rank {rank}: {fields} changed after the state was saved: they do not match "
        f"{where}.check. The state is corrupted: load the state as it was saved"
    )


class PassState:
    """What a rank's stream state holds that stays while a pass runs (its layout, epoch, base seed, origins, shards
    and identity), built once per pass, and the state of its progress (`state`), built per state_dict() call, i.e.
    per step: a copy of those fields (one C call: a 17-key dict built field by field costs twice its instructions)
    with the progress set, and its check's CRC continued from the epoch's (see `_SNAPSHOT_ENDS`). `origins`: the
    snapshots in their serialised form (`snapshot_dict`), kept here and copied into each state."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        epoch: int,
        num_workers: int,
        base_seed: int | None,
        origins: list[dict | None],
        shards: Shards | None,
        stream: dict | None,
    ) -> None:
        self.fixed: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "kind": "stream",
            "world_size": world_size,
            "rank": rank,
            "epoch": epoch,
            "batches": None,
            "exhausted": None,
            "ended": None,
            "num_workers": num_workers,
            "base_seed": base_seed,
            "next_worker": None,
            "origins": origins,
            "workers": None,
            "shards": None if shards is None else shards.serialised,
            "stream": stream,
            "check": None,
        }
        self._start = zlib.crc32(f"({epoch!r}, ".encode())
        self._of_shards = None if shards is None else shards.check
        self._ends: dict[tuple, bytes] = {}  # the check's text after `batches`, per (exhausted, ended, next worker)
        self._origins_held = any(o is not None for o in origins)

    def state(self, batches: int, exhausted: bool, ended: bool, next_worker: int, workers: list[dict | None]) -> dict:
        """The state at this progress, a new dict, its origins copied, so that editing a state taken changes
        nothing the loader holds. `workers`: the snapshots in their serialised form, new ones."""
        state = self.fixed.copy()
        state["batches"] = batches
        state["exhausted"] = exhausted
        state["ended"] = ended
        state["next_worker"] = next_worker
        origins = state["origins"]
        state["origins"] = [None if o is None else _copied(o) for o in origins] if self._origins_held else [*origins]
        state["workers"] = workers
        key = (exhausted, ended, next_worker)
        end = self._ends.get(key)
        if end is None:
            end = self._ends[key] = f", {exhausted!r}, {ended!r}, {next_worker!r}, {self._of_shards!r})".encode()
        state["check"] = zlib.crc32(repr(batches).encode() + end, self._start)
        return state


def merge_stream_states(states: list[dict]) -> dict:
    """The states of all ranks side by side, each checked, one per rank (a stream's positions are per rank)."""
    ranks = _parse_all(states)
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "streams",
        "world_size": ranks[0].world_size,
        "ranks": [r.to_dict() for r in ranks],
    }


def _parse_all(states: object) -> list[RankStream]:
    if not isinstance(states, (list, tuple)) or not states:
        raise StateError("stream progress needs a non-empty list of per-rank states (one per rank)")
    ranks = [RankStream.from_dict(s, f"states[{i}]") for i, s in enumerate(states)]
    world_size = ranks[0].world_size
    if any(r.world_size != world_size for r in ranks):
        raise StateError("stream states were saved at different world sizes: pass the states of one step")
    _check_ranks([r.rank for r in ranks], world_size)
    return sorted(ranks, key=lambda r: r.rank)


def rank_streams(state: Any) -> list[RankStream]:
    """Every rank's parsed state out of a merged state, a list of states, or the state of a one-rank run: a stream
    has no progress that one rank's state could stand for in the others."""
    if isinstance(state, (list, tuple)):
        return _parse_all(state)
    kind = check_header(state, ("stream", "streams"), "state")
    if kind == "stream":
        return _parse_all([state])
    if set(state) != {"format", "version", "kind", "world_size", "ranks"}:
        raise StateError(
            f"state must have exactly the fields format, version, kind, world_size and ranks, got "
            f"{short(sorted(map(str, state)))}: the state is corrupted"
        )
    ranks = _parse_all(_get(state, "ranks", list, "state"))
    if _get(state, "world_size", int, "state") != len(ranks):
        raise StateError(
            f"state.world_size is {state['world_size']}, but it holds the states of {len(ranks)} ranks: "
            f"the state is corrupted"
        )
    return ranks


def regathered(ranks: list[RankStream]) -> tuple[ShardProgress, int, bool]:
    """The global shard progress of all ranks' committed positions, to deal again at another layout; with the epoch
    a restored rank stands in and whether that epoch is over for every rank (each had handed out its end). An epoch
    whose every record was read but whose end some rank had not handed out is the one a restored rank stands in (its
    pass ends empty), as at the same layout: not the next one, which would start in the pass that ends this one."""
    first = ranks[0]
    for r in ranks:
        if r.shards is None or r.shards != first.shards or r.num_workers != first.num_workers:
            raise StateError(
                f"the state of rank {r.rank} has another shard list, order or number of workers than rank "
                f"{first.rank}'s: pass the states of one step of one run"
            )
    assert first.shards is not None, "refused in the loop above"
    deal = first.shards.deal(first.world_size, max(first.num_workers, 1))
    progress = merge(deal, [r.shard_positions() for r in ranks])
    last = max(r.epoch for r in ranks)
    consumed = progress.epoch == last + 1
    return progress, last if consumed else progress.epoch, consumed and all(r.epoch == last and r.ended for r in ranks)
