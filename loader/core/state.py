"""The progress state: its serialised format, validation, and the merge of per-rank states.

A rank's state is O(1) beyond the progress it started from (its *base*): the layout it ran under, its rank, its
epoch and how many micro-batches it delivered in completed updates. `merge_rank_states` turns the states of all ranks
into the global progress: per epoch, the committed positions as intervals, which a restart at any world size
reads as one small object. Everything is plain Python types, so a state is JSON- and torch.save-able.

Map-style datasets get the full guarantee. Stream (IterableDataset) states are defined in `loader.streams.state`;
`loader.checkpoint.merge_states` takes either kind.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import reprlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from loader.core.checks import MAX_SAMPLES, is_int
from loader.core.partition import EpochPlan, Layout, plan_at
from loader.core.progress import EMPTY, Remaining, complement, normalize, total, union

FORMAT = "loader.progress"
VERSION = 1
FINGERPRINT_FIELDS = ("num_samples", "seed", "shuffle", "blocks", "order_version", "lanes")
FINGERPRINT_DEFAULTS = {"order_version": 1, "lanes": None}  # fields added after the first release: what a state
# without them had
LARGEST = MAX_SAMPLES + 1  # no count, epoch or size in a state reaches this (a position, at most num_samples, comes
# nearest); anything larger is corruption, refused before numpy (int64) or a Python loop would meet it
MAX_EPOCHS_AHEAD = 10_000  # how far a rank state may run ahead of its base: the merge walks each epoch between
MAX_DRIFT = 2**16  # micro-batches a merge of any world size may enumerate beyond the prefix every rank completed
DRIFT_PER_RANK = 16  # and per rank given, beyond that: see `drift_limit`
LAYOUT_FIELDS = ("world_size", "grad_accum", "batch_size", "drop_last")


class StateError(ValueError):
    """A state that cannot be loaded into this loader; the message says which field and what to do."""


def intervals_to_json(intervals: np.ndarray) -> list[int]:
    """The JSON form: [start0, stop0, start1, stop1, ...]."""
    return intervals.reshape(-1).tolist()


def intervals_from_json(flats: list, n: int, name: Callable[[int], str]) -> list[np.ndarray]:
    """Parse and check JSON interval lists, all at once (a state holds up to one per epoch for thousands of epochs,
    where numpy's cost per call would dominate); `name(i)` names the i-th in an error message."""
    sizes = []
    for i, flat in enumerate(flats):
        if (
            not isinstance(flat, (list, tuple))
            or len(flat) % 2
            or not all(is_int(v) and abs(v) < LARGEST for v in flat)
        ):
            raise StateError(f"{name(i)} must be a flat list of int pairs [start, stop, ...], got {short(flat)}")
        sizes.append(len(flat) // 2)
    if not any(sizes):
        return [EMPTY] * len(flats)
    ends = np.cumsum(sizes, dtype=np.int64)
    values = itertools.chain.from_iterable(flats)
    spans = np.fromiter(values, dtype=np.int64, count=2 * int(ends[-1])).reshape(-1, 2)
    bad = (spans[:, 0] < 0) | (spans[:, 1] > n) | (spans[:, 1] <= spans[:, 0])
    firsts = ends - sizes  # each list's first pair, which follows no pair of its own list
    follows = np.ones(len(spans), dtype=bool)
    follows[firsts[firsts < len(spans)]] = False
    bad[1:] |= follows[1:] & (spans[1:, 0] <= spans[:-1, 1])
    if bad.any():
        first = int(np.searchsorted(ends, np.argmax(bad), side="right"))
        raise StateError(
            f"{name(first)} must be sorted, disjoint, non-touching, non-empty intervals inside [0, {n}); "
            f"the state is corrupted or belongs to a dataset of another length"
        )
    return np.split(spans, ends[:-1])


def short(value: object) -> str:
    """A value for an error message: a corrupted state can hold megabytes (or lists nested a million deep), a
    message stays one short line."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 40, 40, 40
_MISSING: Any = object()  # a sentinel that compares with any field's value


def _get(state: dict, key: str, kind: type[Any] | tuple[type[Any], ...], where: str, default: Any = _MISSING) -> Any:
    """state[key] checked to be of `kind` (int: a non-negative int below LARGEST, never a bool); `default` for
    fields added after the first release, which older states lack."""
    if type(state) is dict:  # the common case first, in a few operations: a merge of 65,536 ranks reads a dozen
        value = state.get(key, _MISSING)  # fields of each state
        if type(value) is kind and (kind is not int or 0 <= value < LARGEST):
            return value
    return _checked(state, key, kind, where, default)


def _checked(state: dict, key: str, kind: type[Any] | tuple[type[Any], ...], where: str, default: Any) -> Any:
    """`_get` in full, with the error that says what is wrong."""
    if not isinstance(state, dict):
        raise StateError(f"{where} must be a dict, got {type(state).__name__}: the state is corrupted")
    if key not in state:
        if default is not _MISSING:
            return default
        raise StateError(f"{where} has no field {key!r}: the state is truncated or not a loader state")
    value = state[key]
    if kind is int and (not is_int(value) or not 0 <= value < LARGEST):
        raise StateError(f"{where}.{key} must be a non-negative int, got {short(value)}: the state is corrupted")
    if kind is not int and not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise StateError(f"{where}.{key} must be of type {names}, got {short(value)}: the state is corrupted")
    return value


def check_header(state: dict, kinds: tuple[str, ...], where: str) -> str:
    if _get(state, "format", str, where) != FORMAT:
        raise StateError(f"{where}.format is {short(state['format'])}, expected {FORMAT!r}: not a loader state")
    version = _get(state, "version", int, where)
    if version != VERSION:
        raise StateError(
            f"{where}.version is {version}, this loader reads version {VERSION}: "
            f"load it with the loader release that wrote it"
        )
    kind = _get(state, "kind", str, where)
    if kind not in kinds:
        raise StateError(f"{where}.kind is {short(kind)}, expected one of {kinds}")
    return kind


def _shuffle_hint(saved: object, current: str) -> str:
    """How to resume a progress saved under another shuffle mode; "self" is a loader with shuffle=True over a
    dataset that orders itself (a Mixture)."""
    if saved == "self":
        return (
            "the state was saved by a loader with shuffle=True over a Mixture (which orders itself): construct "
            "the loader with shuffle=True (and no shuffle_blocks or lanes)"
        )
    if current == "self":
        return (
            "a loader with shuffle=True leaves the order to a Mixture (each epoch continues its stream, mixture "
            "plan version 3) since this release; the saved state is of a loader that shuffled the mixture's "
            "positions (an earlier release, or shuffle_blocks=/lanes=), whose positions name other samples here: "
            "resume it with the release that saved it, or start the run anew"
        )
    return f"construct the loader with the shuffle mode {short(saved)} of the saved run"


def check_fingerprint(saved: dict, current: dict, where: str = "state") -> None:
    """Positions mean the same dataset indices only if these match; say exactly which does not."""
    for name in FINGERPRINT_FIELDS:
        if name not in saved and name not in FINGERPRINT_DEFAULTS:
            raise StateError(f"{where}.fingerprint has no field {name!r}: the state is truncated")
        saved_value = saved.get(name, FINGERPRINT_DEFAULTS.get(name))
        if type(saved_value) is not type(current[name]) or saved_value != current[name]:  # True is not seed 1
            saved_value = short(saved_value)
            hint = {
                "num_samples": "the dataset changed length; this progress cannot be applied to it",
                "seed": f"construct the loader with seed={saved_value} to resume this run",
                "shuffle": _shuffle_hint(saved.get(name), current[name]),
                "blocks": "construct the loader with the shuffle_blocks of the saved run",
                "order_version": "positions map to other samples under this release's order; resume with the "
                "loader release that saved the state",
                "lanes": "construct the loader with the lanes= and lane_chunk= of the saved run ([lanes, chunk]; "
                "None: no lanes)",
            }[name]
            raise StateError(
                f"{where}.fingerprint.{name} is {saved_value} in the saved state but {current[name]!r} in this "
                f"loader: {hint}"
            )


@dataclass(frozen=True)
class Progress:
    """Global progress: every epoch before `epoch` is finished; `committed` holds epochs >= `epoch`."""

    fingerprint: dict
    epoch: int
    committed: dict[int, np.ndarray]
    finished: tuple[tuple[int, np.ndarray], ...] = ()  # (epoch, positions dropped by policy) of the epochs
    # finished by the merge that made this progress (or, when it finished none, its base's)
    end_of_epoch: bool | None = None  # None, or: every rank sat exhausted at the end of epoch `epoch - 1`, and
    # whether that pass had also handed out its end (StopIteration): a restored loader is then where they were
    done_in_epoch: int = 0  # micro-batches per rank delivered in the cursor's epoch up to here (the most any rank
    # did, across restarts): what a framework's restored batch counter holds, so len() adds them back
    samples_done_in_epoch: int = 0  # the same in samples, for len(loader.sampler)
    skipped: dict[int, np.ndarray] = field(default_factory=dict)  # positions skipped on request (`skip`), per
    # epoch: committed, so never dealt, but never trained; kept for the epochs from `epoch` on and those `finished`
    # lists, so that the ledger records them with the checkpoint
    schedule: tuple[tuple[int, int], ...] | None = None  # the global batch by optimizer step ((first step, G), ...)
    # of a batch-size ramp, or None: the layout's own K throughout (and no step is kept)
    step: int = 0  # with a schedule: the optimizer updates completed up to here, all epochs (the most any rank did)

    @property
    def cursor_epoch(self) -> int:
        """The epoch a loader restored from this progress sits in."""
        return self.epoch if self.end_of_epoch is None else self.epoch - 1

    @property
    def num_samples(self) -> int:
        return self.fingerprint["num_samples"]

    def committed_in(self, epoch: int) -> np.ndarray:
        return self.committed.get(epoch, EMPTY)

    def to_dict(self) -> dict:
        """The serialised form, built once: a progress never changes, and a rank embeds its base in every
        state_dict() (one per step). Callers share the dict, as modules share tensors: copy it to edit it."""
        return self._serialised

    @cached_property
    def _serialised(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": "global",
            "fingerprint": dict(self.fingerprint),
            "epoch": self.epoch,
            "committed": [[e, intervals_to_json(spans)] for e, spans in sorted(self.committed.items())],
            "finished": [{"epoch": e, "dropped": intervals_to_json(dropped)} for e, dropped in self.finished],
            "end_of_epoch": None
            if self.end_of_epoch is None
            else {"epoch": self.epoch - 1, "ended": self.end_of_epoch},
            "done_in_epoch": self.done_in_epoch,
            "samples_done_in_epoch": self.samples_done_in_epoch,
            **(
                {"skipped": [[e, intervals_to_json(spans)] for e, spans in sorted(self.skipped.items())]}
                if self.skipped
                else {}
            ),  # absent when empty: a state without skips reads as before them
            **(
                {"batch_schedule": [list(point) for point in self.schedule], "step": self.step}
                if self.schedule is not None
                else {}
            ),  # absent without a ramp: such a state reads as before them
        }

    @classmethod
    def from_dict(cls, state: dict, where: str = "state") -> Progress:
        """Checks what every merge keeps true: committed epochs from `epoch` to at most MAX_EPOCHS_AHEAD after it,
        each once; finished epochs before `epoch`, in increasing order; and no more micro-batches or samples done
        in the cursor epoch than it has committed positions."""
        check_header(state, ("global",), where)
        fingerprint = _get(state, "fingerprint", dict, where)
        n = _get(fingerprint, "num_samples", int, f"{where}.fingerprint")
        epoch = _get(state, "epoch", int, where)
        entries = _get(state, "committed", list, where)
        _check_count(entries, f"{where}.committed")
        for entry in entries:
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and is_int(entry[0])
                and epoch <= entry[0] <= epoch + MAX_EPOCHS_AHEAD
            ):
                raise StateError(
                    f"{where}.committed entries must be [epoch in [{epoch}, {epoch + MAX_EPOCHS_AHEAD}], intervals], "
                    f"got {short(entry)}"
                )
        epochs = [entry[0] for entry in entries]
        if len(set(epochs)) < len(epochs):
            twice = next(e for e, count in collections.Counter(epochs).items() if count > 1)
            raise StateError(f"{where}.committed lists epoch {twice} twice: the state is corrupted")
        spans = intervals_from_json(
            [entry[1] for entry in entries], n, lambda i: f"{where}.committed[epoch {epochs[i]}]"
        )
        committed = dict(zip(epochs, spans))
        records = _get(state, "finished", list, where)
        _check_count(records, f"{where}.finished")
        done_epochs = [_get(record, "epoch", int, f"{where}.finished[{i}]") for i, record in enumerate(records)]
        if any(b <= a for a, b in zip(done_epochs, done_epochs[1:])) or done_epochs and done_epochs[-1] >= epoch:
            raise StateError(
                f"{where}.finished must list epochs before {epoch} in increasing order, got "
                f"{short(done_epochs)}: the state is corrupted"
            )
        dropped = [_get(record, "dropped", list, f"{where}.finished[{i}]") for i, record in enumerate(records)]
        finished = tuple(zip(done_epochs, intervals_from_json(dropped, n, lambda i: f"{where}.finished[{i}].dropped")))
        end = _get(state, "end_of_epoch", (dict, type(None)), where, default=None)
        if end is not None:
            if _get(end, "epoch", int, f"{where}.end_of_epoch") != epoch - 1:
                raise StateError(f"{where}.end_of_epoch must name the epoch before {epoch}, which is finished")
            end = _get(end, "ended", bool, f"{where}.end_of_epoch")
        done = _get(state, "done_in_epoch", int, where, default=0)
        samples_done = _get(state, "samples_done_in_epoch", int, where, default=0)
        in_cursor_epoch = n if end is not None else total(committed.get(epoch, EMPTY))
        if not done <= samples_done <= in_cursor_epoch:
            raise StateError(
                f"{where} reports {done} micro-batches and {samples_done} samples done in its epoch, which has "
                f"{in_cursor_epoch} committed positions: the state is corrupted"
            )
        skipped = _skipped_from(_get(state, "skipped", list, where, default=[]), committed, finished, epoch, n, where)
        schedule = _get(state, "batch_schedule", list, where, default=None)
        if schedule is not None:
            schedule = schedule_from(schedule, f"{where}.batch_schedule")
        step = _get(state, "step", int, where, default=0)
        return cls(fingerprint, epoch, committed, finished, end, done, samples_done, skipped, schedule, step)


def schedule_from(points: object, where: str) -> tuple[tuple[int, int], ...]:
    """A global batch schedule as a tuple of (first step, global batch): from step 0, first steps increasing, global
    batches positive; a ValueError (a StateError when read from a state) names `where` otherwise."""
    error = StateError if where.startswith("state") else ValueError
    if not isinstance(points, (list, tuple)) or not points or len(points) > LARGEST:
        raise error(f"{where} must be a non-empty list of (first step, global batch) pairs, got {short(points)}")
    pairs = []
    for point in points:
        if not (
            isinstance(point, (list, tuple))
            and len(point) == 2
            and all(is_int(v) for v in point)
            and 0 <= point[0] < LARGEST
            and 0 < point[1] < LARGEST
        ):
            raise error(
                f"{where} must hold (first step, global batch) pairs of ints, a step >= 0 and a global "
                f"batch > 0, got {short(point)}"
            )
        pairs.append((int(point[0]), int(point[1])))
    if pairs[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])):
        raise error(
            f"{where} must start at step 0 and name each first step once, in increasing order, got {short(points)}"
        )
    return tuple(pairs)


def check_schedule(
    saved: Progress,
    current: tuple[tuple[int, int], ...] | None,
    amends: tuple[tuple[int, int], ...] | None,
    change_at: int | None,
) -> Progress:
    """A state's global batch schedule against the loader's: the same, or the loader's amends the saved one from a
    step the state has not passed (`change_at` >= its step); returned with the loader's schedule. Else refused,
    naming the field: a step of the saved run would take other samples under another schedule."""
    if saved.schedule == current:
        return saved
    where = "state.batch_schedule"
    if saved.schedule is not None and amends == saved.schedule and change_at is not None:
        if change_at < saved.step:
            raise StateError(
                f"{where}: the loader's schedule changes at step {change_at}, but the state has "
                f"completed {saved.step} steps under the saved schedule: pass change_at >= {saved.step}"
            )
        return dataclasses.replace(saved, schedule=current)
    saved_text = "none (a fixed grad_accum)" if saved.schedule is None else [list(p) for p in saved.schedule]
    current_text = "none (a fixed grad_accum)" if current is None else [list(p) for p in current]
    raise StateError(
        f"{where} is {short(saved_text)} in the saved state but {short(current_text)} in this loader: a step would "
        f"train other samples than the saved run's. Construct the loader with the saved schedule, or change it "
        f"explicitly: BatchPolicy(global_batch=NEW, micro_batch=B, amends=SAVED, change_at=STEP) with STEP >= the "
        f"state's step ({saved.step})"
    )


def _skipped_from(entries: list, committed: dict, finished: tuple, epoch: int, n: int, where: str) -> dict:
    """Skipped positions per epoch: each of an epoch this progress commits (and inside what it commits) or of one
    its `finished` lists."""
    _check_count(entries, f"{where}.skipped")
    done = {e for e, _ in finished}
    for entry in entries:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and is_int(entry[0])
            and (entry[0] in done or epoch <= entry[0] <= epoch + MAX_EPOCHS_AHEAD)
        ):
            raise StateError(
                f"{where}.skipped entries must be [epoch, intervals] of an epoch it commits or lists "
                f"finished, got {short(entry)}: the state is corrupted"
            )
    epochs = [entry[0] for entry in entries]
    if len(set(epochs)) < len(epochs):
        raise StateError(f"{where}.skipped lists an epoch twice: the state is corrupted")
    spans = intervals_from_json([entry[1] for entry in entries], n, lambda i: f"{where}.skipped[epoch {epochs[i]}]")
    for e, skipped in zip(epochs, spans):
        if e >= epoch and total(union(committed.get(e, EMPTY), skipped)) != total(committed.get(e, EMPTY)):
            raise StateError(
                f"{where}.skipped[epoch {e}] holds positions its committed list does not: skipped "
                f"positions are committed (never dealt); the state is corrupted"
            )
    return dict(zip(epochs, spans))


def _check_count(entries: list, where: str) -> None:
    """A merge walks at most MAX_EPOCHS_AHEAD + 1 epochs, so it never lists more."""
    if len(entries) > MAX_EPOCHS_AHEAD + 1:
        raise StateError(
            f"{where} has {len(entries)} entries, more than the {MAX_EPOCHS_AHEAD + 1} epochs a merge "
            f"lists: the state is corrupted"
        )


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress: its base, the layout it ran under, micro-batches of completed updates, and whether its
    pass had handed out its end (StopIteration) after the last of them."""

    base: Progress
    layout: Layout
    rank: int
    epoch: int
    completed: int
    ended: bool = False
    out_of_step: dict | None = None  # another rank's count of updates when this state was taken, if it showed
    # the ranks were not in lockstep (see `loader.checkpoint.lockstep`): then this state does not stand for every rank

    def to_dict(self) -> dict:
        state = rank_state(self.base, self.layout, self.rank, self.epoch, self.completed, self.ended)
        return state if self.out_of_step is None else {**state, "lockstep": self.out_of_step}

    @classmethod
    def from_dict(cls, state: dict, where: str = "state", parsed: dict | None = None) -> RankProgress:
        """`parsed` (id of a base dict -> its Progress, checked layout fields -> their Layout) parses a base, and a
        layout, shared by many states only once."""
        check_header(state, ("rank",), where)
        base_dict = _get(state, "base", dict, where)
        parsed = {} if parsed is None else parsed
        if id(base_dict) not in parsed:
            parsed[id(base_dict)] = Progress.from_dict(base_dict, f"{where}.base")
        base = parsed[id(base_dict)]
        saved_layout = _get(state, "layout", dict, where)
        if saved_layout.keys() != _LAYOUT_KEYS:
            raise StateError(f"{where}.layout must have exactly the fields {LAYOUT_FIELDS}: the state is corrupted")
        at = f"{where}.layout"
        fields = (
            _get(saved_layout, "world_size", int, at),
            _get(saved_layout, "grad_accum", int, at),
            _get(saved_layout, "batch_size", int, at),
            _get(saved_layout, "drop_last", bool, at),
        )
        layout = parsed.get(fields) or _layout(fields, where)  # checked types: as a key, True never stands for 1
        parsed[fields] = layout
        rank = _get(state, "rank", int, where)
        if rank >= layout.world_size:
            raise StateError(f"{where}.rank is {rank}, outside world_size {layout.world_size}")
        epoch, completed = _get(state, "epoch", int, where), _get(state, "completed", int, where)
        at_base_end = epoch == base.epoch - 1 and completed == 0  # restored at the end of that epoch, not moved on
        if epoch < base.epoch and not at_base_end:
            raise StateError(f"{where}.epoch is {epoch}, before its base epoch {base.epoch}: the state is corrupted")
        if epoch - base.epoch > MAX_EPOCHS_AHEAD:
            raise StateError(
                f"{where}.epoch is {epoch}, more than {MAX_EPOCHS_AHEAD} epochs after its base epoch {base.epoch}: "
                f"the state is corrupted (or merge states at least every {MAX_EPOCHS_AHEAD} epochs)"
            )
        mark = _get(state, "lockstep", dict, where, default=None)
        if mark is not None:
            if set(mark) != {"rank", "updates", "own_updates"}:
                raise StateError(
                    f"{where}.lockstep must have the fields rank, updates, own_updates: the state is corrupted"
                )
            mark = {name: _get(mark, name, int, f"{where}.lockstep") for name in ("rank", "updates", "own_updates")}
        return cls(base, layout, rank, epoch, completed, _get(state, "ended", bool, where, default=False), mark)


_LAYOUT_KEYS = frozenset(LAYOUT_FIELDS)


def _layout(fields: tuple, where: str) -> Layout:
    try:
        layout = Layout(*fields)
    except ValueError as err:  # a count of 0
        raise StateError(f"{where}.layout is invalid ({err}): the state is corrupted") from None
    if layout.global_batch >= LARGEST:
        raise StateError(f"{where}.layout has a global batch of {layout.global_batch}: the state is corrupted")
    return layout


def rank_state(base: Progress, layout: Layout, rank: int, epoch: int, completed: int, ended: bool) -> dict:
    """A RankProgress in its serialised form, built without the dataclass: the sampler makes one per state_dict()
    call, i.e. per step, and a frozen dataclass costs more to construct than the dict itself."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "rank",
        "base": base.to_dict(),
        "layout": layout.as_dict(),
        "rank": rank,
        "epoch": epoch,
        "completed": completed,
        "ended": ended,
    }


def drift_limit(world_size: int) -> int:
    """Micro-batches a merge of `world_size` rank states may enumerate beyond the prefix every rank completed, in
    all the epochs it walks: each can leave a hole in the merged state, and a corrupted count (2**40) must be
    refused before it is enumerated. MAX_DRIFT at any world size (one rank 65,536 micro-batches ahead of another:
    a merged state of about a megabyte), and DRIFT_PER_RANK per rank beyond 4,096 ranks: ranks a few micro-batches
    apart (DDP Join) at any scale, while the merged state stays O(world size), about as large as the rank states
    it is made from (a hole is two ints, ~20 bytes of JSON, against a rank state's ~300), and the merge's work
    proportional to what it was given."""
    return max(MAX_DRIFT, DRIFT_PER_RANK * world_size)


def _common_batches(plan: EpochPlan, completed: np.ndarray) -> int:
    """Micro-batches of the whole updates every rank completed before the tail (whose extra samples lie beyond
    them): a prefix."""
    return plan.completed(min(int(completed.min()), plan.tail.first_batch))


def _delivered_spans(plan: EpochPlan, completed: np.ndarray) -> np.ndarray:
    """Remaining-index intervals delivered by ranks 0..W-1 that completed the given micro-batch counts.

    The common updates are a prefix; only the part beyond it is enumerated (every rank's batches in one vectorised
    call), so the cost grows with how far the ranks drifted apart, not with the position or the world size."""
    if completed.min() == completed.max():  # lockstep (also one state standing for every rank): a prefix
        done = int(completed[0])
        return np.array([[0, plan.served if done == plan.batches_per_rank else plan.start_of(done)]])
    first = _common_batches(plan, completed)
    beyond = completed - first
    ends = np.cumsum(beyond)
    batches = first + np.arange(ends[-1]) - np.repeat(ends - beyond, beyond)
    starts, stops = plan.batch_bounds(np.repeat(np.arange(len(completed)), beyond), batches)
    prefix = np.array([[0, plan.start_of(first)]], dtype=np.int64)
    return normalize(np.concatenate((prefix, np.stack((starts, stops), axis=1))))


def _completed_in(plan: EpochPlan, epoch: int, epochs: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each rank's completed micro-batches of `epoch`: all of them in an epoch it left, none in one ahead."""
    return np.where(epochs > epoch, plan.batches_per_rank, np.where(epochs == epoch, counts, 0))


def merge(ranks: list[RankProgress], uneven: bool = False) -> Progress:
    """The global progress committed by all ranks of one layout (given in rank order; a single state of a
    multi-rank layout stands for every rank in lockstep). Unless `uneven`, the ranks must have completed the same
    micro-batches in every epoch, as the ranks of a lockstep run do at any one step. The ranks' counts are arrays:
    a merge of 65,536 ranks does no Python work per rank and epoch."""
    base, layout = ranks[0].base, ranks[0].layout
    n = base.num_samples
    epochs = np.fromiter((r.epoch for r in ranks), dtype=np.int64, count=len(ranks))
    counts = np.fromiter((r.completed for r in ranks), dtype=np.int64, count=len(ranks))
    epoch, finished, last, plans = base.epoch, [], int(epochs.max()), {}
    committed = {e: spans for e, spans in base.committed.items() if e > last}  # ahead of every rank: untouched
    fresh = Remaining(EMPTY, n)  # every epoch the base committed nothing in, and its plans (one without a batch-size
    fresh_plans: dict[tuple, EpochPlan] = {}  # ramp; one per stretch of the schedule the epoch starts in with one)
    walked: dict[tuple | None, tuple[np.ndarray, np.ndarray]] = {}  # such an epoch's (spans, their complement) per
    # plan and completed counts: a rank thousands of epochs ahead of its base walks them at the cost of one
    drift, limit, everyone_in = 0, drift_limit(len(ranks)), int(epochs.min())
    step, first_steps = base.step, {}  # the step each epoch's first update is (kept with a schedule only)
    for e in range(base.epoch, last + 1):
        remaining = Remaining(base.committed[e], n) if e in base.committed else fresh
        plan = _plan(remaining.count, layout, base.schedule, step)
        if e not in base.committed:
            plan = fresh_plans.setdefault((plan.layout.grad_accum, plan.changes), plan)
        plans[e], first_steps[e] = plan, step
        step += plan.updates
        if e < everyone_in:  # every rank left this epoch: its whole share, as one rank standing for all
            completed = np.array([plan.batches_per_rank])
        else:
            completed = _completed_in(plan, e, epochs, counts)
            bad = ~plan.whole(completed)
            if bad.any():
                i = int(np.argmax(bad))
                raise StateError(
                    f"rank {ranks[i].rank} reports {completed[i]} completed micro-batches in epoch {e}, but its share "
                    f"is {plan.batches_per_rank} in updates of {plan.grad_accum_at(int(completed[i]))}: the state is "
                    f"corrupted or belongs to another run"
                )
        if completed.min() != completed.max():
            if not uneven:
                raise _different_steps(ranks, completed, e)
            beyond = completed - _common_batches(plan, completed)
            drift += int(beyond.max())
            if drift <= limit:  # the sum is safe from int64 overflow (huge corrupted counts) only now
                drift += int(beyond.sum()) - int(beyond.max())
            if drift > limit:
                raise StateError(
                    f"the ranks' completed micro-batches differ by {drift} or more (in epoch {e}), beyond the {limit} "
                    f"the ranks of one step ever leave apart at {len(ranks)} ranks (see drift_limit): the states are "
                    f"corrupted"
                )
        key = None if e in base.committed else (id(plan), completed.tobytes())
        if key is None or key not in walked:
            spans = union(base.committed_in(e), remaining.covering_spans(_delivered_spans(plan, completed)))
            walked[key] = spans, complement(spans, n)
        spans, dropped = walked[key]
        if epoch == e and completed.min() == plan.batches_per_rank:  # after every earlier epoch
            epoch = e + 1
            finished.append((e, dropped))
        elif len(spans):
            committed[e] = spans
    at_end = everyone_in == last == epoch - 1 and (last not in plans or counts.min() == plans[last].batches_per_rank)
    end_of_epoch = all(r.ended for r in ranks) if at_end else None
    cursor = epoch - 1 if at_end else epoch
    done = (0, 0)
    if cursor in plans:
        done = _done_in(plans[cursor], _completed_in(plans[cursor], cursor, epochs, counts), [r.rank for r in ranks])
    before = (base.done_in_epoch, base.samples_done_in_epoch) if cursor == base.cursor_epoch else (0, 0)
    finished_now = tuple(finished) or base.finished
    listed = {e for e, _ in finished_now}
    skipped = {e: spans for e, spans in base.skipped.items() if e >= epoch or e in listed}
    step = base.step if base.schedule is None else _merged_step(base, plans, first_steps, epochs, counts)
    return Progress(
        base.fingerprint,
        epoch,
        committed,
        finished_now,
        end_of_epoch,
        before[0] + done[0],
        before[1] + done[1],
        skipped,
        base.schedule,
        step,
    )


def _plan(remaining: int, layout: Layout, schedule: tuple | None, step: int) -> EpochPlan:
    try:
        return plan_at(remaining, layout, schedule, step)
    except ValueError as err:
        raise StateError(
            f"state.batch_schedule cannot be served by the saved layout ({err}): the state is corrupted"
        ) from None


def _merged_step(base: Progress, plans: dict, first_steps: dict, epochs: np.ndarray, counts: np.ndarray) -> int:
    """The optimizer step the ranks reached: the most updates any rank completed (under DDP Join the ranks that ran
    out step with the others), counted from the base's step through every epoch walked. One count per distinct
    (epoch, completed) pair, not per rank."""
    most = base.step  # a rank restored at the end of the epoch before its base, not moved on, is at the base's step
    for e, done in np.unique(np.stack((epochs, counts), axis=1), axis=0).tolist():
        if e in plans:
            most = max(most, first_steps[e] + plans[e].updates_in(done))
    return most


def _different_steps(ranks: list[RankProgress], completed: np.ndarray, epoch: int) -> StateError:
    most, least = int(np.argmax(completed)), int(np.argmin(completed))
    return StateError(
        f"rank {ranks[most].rank} completed {completed[most]} micro-batches of epoch {epoch}, rank {ranks[least].rank} "
        f"{completed[least]}: the states come from different steps. Pass the states of one step, or merge_states("
        f"states, uneven=True) for a run whose ranks consume unequal amounts (DDP Join), as save_checkpoint does"
    )


def _done_in(plan: EpochPlan, completed: np.ndarray, rank_ids: list[int]) -> tuple[int, int]:
    """The most micro-batches, and the most samples, any rank completed of an epoch (each rank's count given, in
    rank order). A rank's samples depend on its rank only through the tail's one more sample of the first ranks,
    so each distinct count is measured once, on the first rank that has it (whose share is the largest of them)."""
    values, firsts = np.unique(completed, return_index=True)
    samples = [
        plan.samples_from(rank_ids[i], 0) - plan.samples_from(rank_ids[i], int(done))
        for done, i in zip(values.tolist(), firsts.tolist())
    ]
    return int(values[-1]), max(samples)


def merge_rank_states(states: list[dict], uneven: bool = False) -> dict:
    """Combine the map-style states of all ranks, saved at one step of one world size, into the global progress.

    A pure function: usable without torch.distributed, e.g. offline on saved files. The states carry no step, but
    at any one step the ranks of a lockstep run (DDP, FSDP) have completed the same micro-batches, so states that
    differ were saved at different steps and are refused. `uneven=True` merges ranks that deliberately consumed
    unequal amounts (DDP Join); it is for states known to come from one step, as a collective gathers them
    (`loader.checkpoint.global_progress`)."""
    if not isinstance(states, (list, tuple)) or not states:
        raise StateError("merge_states takes a non-empty list of per-rank state dicts (one per rank)")
    parsed: dict = {}
    ranks = [RankProgress.from_dict(s, f"states[{i}]", parsed) for i, s in enumerate(states)]
    first = ranks[0]
    for i, r in enumerate(ranks):
        same_base = r.base is first.base or r.base.to_dict() == first.base.to_dict()
        for name, same in (("layout", r.layout == first.layout), ("base", same_base)):
            if not same:
                raise StateError(
                    f"states[{i}] (rank {r.rank}) has another {name} than states[0] (rank {first.rank}): "
                    f"pass the states of one step of one run"
                    + (
                        f" (or: loader.skip() was not called alike on ranks {first.rank} and {r.rank}: call it "
                        f"with the same arguments on every rank, after the same update)"
                        if name == "base"
                        else ""
                    )
                )
    _check_ranks([r.rank for r in ranks], first.layout.world_size)
    return merge(sorted(ranks, key=lambda r: r.rank), uneven).to_dict()


def progress_of(state: dict | list | tuple) -> Progress:
    """The global progress in whatever form a checkpoint holds it: a merged state, the list of all ranks' states,
    or one rank's state. One rank's state of a multi-rank run stands for every rank, which is exact when the ranks
    ran in lockstep (every optimizer update involved every rank, as under DDP or FSDP): what most scripts and
    frameworks save is rank 0's `state_dict()`."""
    if isinstance(state, (list, tuple)):
        state = merge_rank_states(list(state))
    elif isinstance(state, dict) and state.get("kind") == "rank":
        alone = RankProgress.from_dict(state)
        if alone.out_of_step is not None and alone.layout.world_size > 1:
            raise _not_standing_for_all(alone, alone.out_of_step)
        return merge([alone])
    return Progress.from_dict(state)


def _not_standing_for_all(alone: RankProgress, mark: dict) -> StateError:
    return StateError(
        f"this is rank {alone.rank}'s state alone, taken after rank {mark['rank']} had completed {mark['updates']} "
        f"optimizer updates and rank {alone.rank} {mark['own_updates']}: the ranks were not in lockstep (or it was "
        f"taken before the optimizer step), so it does not say what every rank trained (resuming from it would "
        f"repeat or skip samples). Resume from a checkpoint holding every rank's progress: saved by "
        f"loader.checkpoint.save_checkpoint or LoaderState (DCP), or the list of every rank's state_dict(). Only if "
        f"you know every rank had trained exactly what this rank had when it was saved, delete its 'lockstep' entry"
    )


def base_digest(base: dict) -> str:
    """The digest of a serialised base: equal on the ranks that set their progress to the same base."""
    return hashlib.sha256(json.dumps(base, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def detach_base(state: dict) -> dict:
    """A rank state with its base replaced by the base's digest, for exchanging between ranks: the base is the
    same on every rank of one run and is the only part that grows (with the holes an uneven stop left), so a gather
    of detached states costs O(world size) whatever the base holds. Other states pass unchanged."""
    if not isinstance(state, dict) or state.get("kind") != "rank":
        return state
    return {**state, "base": {"digest": base_digest(state["base"])}}


def attach_base(states: list[dict], base: dict) -> list[dict]:
    """Undo `detach_base` with this rank's own base (one shared object, parsed once by `merge_states`), refusing a
    rank that started from another base."""
    digest = base_digest(base)
    attached = []
    for i, state in enumerate(states):
        if isinstance(state, dict) and state.get("kind") == "rank":
            if _get(state, "base", dict, f"states[{i}]").get("digest") != digest:
                raise StateError(
                    f"states[{i}] (rank {short(state.get('rank'))}) started from another progress than this rank: "
                    f"every rank must load the same checkpoint before training, and call loader.skip() alike (the "
                    f"same arguments, after the same update)"
                )
            state = {**state, "base": base}
        attached.append(state)
    return attached


def _first(values: Collection[object], limit: int = 8) -> str:
    shown = ", ".join(map(str, itertools.islice(values, limit)))
    return f"[{shown}, ...]" if len(values) > limit else f"[{shown}]"


def _check_ranks(ranks: list[int], world_size: int) -> None:
    if len(ranks) == world_size and len(set(ranks)) == world_size:
        return  # every rank is < world_size (checked per state), so these are exactly 0..world_size-1
    present = set(ranks)
    missing = list(itertools.islice((r for r in range(world_size) if r not in present), 9))
    repeated = sorted(r for r, count in collections.Counter(ranks).items() if count > 1)
    raise StateError(
        f"the states were saved at world_size {world_size} but {len(ranks)} were given (missing ranks "
        f"{_first(missing)}, repeated ranks {_first(repeated)}): pass exactly one state per rank"
    )
