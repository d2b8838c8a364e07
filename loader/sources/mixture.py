"""A weighted mixture of map-style sources as one map-style dataset: position -> (source, index), computed.

Why computed: the loader's exactness at any world size comes from positions, so a mixture that is a pure function
of (seed, position) inherits it whole, and nothing (no sample list of 1e9 entries) is stored or replayed.

Positions fall into windows of M = sum(counts) positions; every window holds exactly counts[s] slots of source s
(counts: the weights apportioned to M by largest remainder, so |counts[s] - w_s * M| < 1, and exactly w_s * M when
the weights are multiples of 1/M, which the default window picks when it can). Inside window k the slots are
arranged by a keyed permutation of range(M) (loader.core.order.window_arrangements, keyed by (seed, k)). The m-th slot
of source s in window k, in position order, is that source's draw j = counts[s] * k + m; draw j is index
Order(len_s, seed_s).for_epoch(j // len_s)(j % len_s) (evaluated for many epochs in one pass with
loader.core.order.epoch_round_keys): a source that runs out continues with its next epoch in a new order, and taking a
source's draws in position order, each run [e * len_s, (e + 1) * len_s) is a permutation.
Numbering draws in position order (not in the permuted order) is what keeps a source epoch that ends inside a
window from lending one of its draws to the next epoch.

Under a loader with shuffle=True the mixture orders itself: loader epoch e serves positions [e N, (e + 1) N) of one
stream (`MixturePlan.epochs_continue`), so every epoch has windows of its own and each source's draws run on, and a
loader position is a mixture position at any world size. An online change of weights (`change_weights`, asked by
`ResumableDataLoader.change_mixture`) is a change of schedule from a window nothing was dealt from yet.

A schedule makes counts[s] a function of the window k, piece by piece: constant, or a linear ramp from count vector
A to B over L windows, whose window j holds c_s(j) = A_s + floor(P_s j / L) - floor(P_{s-1} j / L), where P_s is the
sum of (B_t - A_t) over t <= s: each c_s(j) is the floor or the ceiling of A_s + (B_s - A_s) j / L, and they sum to M.
Draw numbers then start at C_s(k), the sum of c_s over the windows before k: a floor sum, O(log L) in closed form
(`_floor_sum`), so a position near 1e12 costs what position 0 does. A change of schedule keeps the pieces before its
window and continues with the new schedule's from there; C_s runs on across it, so no draw repeats or is left out.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import Any

import numpy as np
import torch
import torch.utils.data
from numpy.typing import ArrayLike

from loader.core.checks import MAX_SAMPLES, check_num_samples, check_positive_int, is_int
from loader.core.order import ORDER_VERSION, Order, epoch_round_keys, permute, window_arrangements
from loader.core.rows import Rows
from loader.core.state import Progress, StateError, check_fingerprint, progress_of
from loader.sources.tokens import TokenSource

__all__ = ["MAX_WINDOW", "Mixture", "MixturePlan", "Piece", "schedule_pieces", "window_counts"]

MAX_WINDOW = 10_000  # the default window is the smallest M <= this that represents every weight exactly
LARGEST_WINDOW = 1 << 20  # a window's slot table is O(M) per process
BLOCK = 2048  # positions mapped per vectorised call when access is sequential (the usual shuffle=False case): a
# block costs ~50 numpy calls, and its temporaries stay within 1 MB
SMALL_BATCH = 64  # up to this many positions inside one block, a batch is grouped by source in Python (~0.1 us a
# position), not by numpy (~6 us a batch in fixed costs)
PLAN_KIND, PLAN_VERSION = "loader.MixturePlan", 1
SCHEDULED_VERSION = 2  # a plan with a schedule: a release that reads version 1 only refuses it, never ignores it
CONTINUING_VERSION = 3  # a plan whose loader epochs continue one stream (`epochs_continue`): positions of epoch e
# name other samples than an earlier release would, so a release that reads versions 1 and 2 only refuses it
_EXACT = 1e-6  # a weight times M within this of an integer counts as exact (weights written with 6 decimals)


def _normalised(weights: ArrayLike, where: str = "weights", zero_ok: bool = False) -> np.ndarray:
    """Weights as fractions of one; a schedule's may hold zeros (a source not drawn yet), a fixed mixture's not."""
    try:
        w = np.asarray(weights, dtype=float)
    except (TypeError, ValueError):
        w = np.zeros(0)
    sign_ok = (w >= 0).all() and w.sum() > 0 if zero_ok else (w > 0).all()
    if w.ndim != 1 or not len(w) or not np.isfinite(w).all() or not sign_ok:
        what = "non-negative finite numbers, not all zero" if zero_ok else "positive finite numbers"
        raise ValueError(f"{where} must be {what}, one per source, got {weights!r}")
    return w / w.sum()


def _smallest_window(rows: np.ndarray) -> int:
    """The smallest M <= MAX_WINDOW at which every weight of every row times M is a whole number, else MAX_WINDOW
    (a row at a time: a schedule of many segments costs no more memory than one weight vector)."""
    exact = np.ones(MAX_WINDOW, dtype=bool)
    for row in np.reshape(rows, (-1, np.shape(rows)[-1])):
        sizes = np.arange(1, MAX_WINDOW + 1)[:, None] * row
        exact &= (np.abs(sizes - np.round(sizes)) <= _EXACT).all(axis=1)
    found = np.nonzero(exact)[0]
    return int(found[0]) + 1 if len(found) else MAX_WINDOW


def _apportion(w: np.ndarray, window: int) -> tuple[int, ...]:
    """Largest remainder (ties to the earlier source): each count within one of w * window, summing to window."""
    check_positive_int("window", window)
    if window > LARGEST_WINDOW:
        raise ValueError(
            f"window={window}: each process builds a window's slot table, O(window) memory; pass a "
            f"window of at most {LARGEST_WINDOW}"
        )
    ideal = w * window
    counts = np.floor(ideal).astype(np.int64)
    counts[np.argsort(counts - ideal, kind="stable")[: window - int(counts.sum())]] += 1
    return tuple(int(c) for c in counts)


def window_counts(weights: Sequence[float], window: int | None = None) -> tuple[int, ...]:
    """Slots of each source per window: the normalised weights times M, rounded by largest remainder (ties to the
    earlier source), so each count is within one of w * M and they sum to M. Without `window`, M is the smallest
    size up to MAX_WINDOW at which every w * M is a whole number, else MAX_WINDOW."""
    w = _normalised(weights)
    return _apportion(w, _smallest_window(w) if window is None else window)


@dataclass(frozen=True)
class Piece:
    """Windows [start, next piece's start) of a schedule: counts `first` at window `anchor`, moving linearly to
    `last` at window anchor + ramp (a constant piece: first == last). A piece that a change of schedule cut keeps
    its anchor, so its windows hold what the uncut ramp held there."""

    start: int
    anchor: int
    ramp: int
    first: tuple[int, ...]
    last: tuple[int, ...]

    def to_json(self) -> dict:
        return {
            "start": self.start,
            "anchor": self.anchor,
            "ramp": self.ramp,
            "from": list(self.first),
            "to": list(self.last),
        }

    @cached_property
    def _steps(self) -> list[int]:
        """P_s = sum over t <= s of (last_t - first_t), with P_{-1} = 0 in front (see the module docstring)."""
        return [0, *accumulate(b - a for a, b in zip(self.first, self.last))]

    def counts(self, windows: np.ndarray) -> np.ndarray:
        """Counts (len(windows), sources) at windows of this piece, exactly (Python ints: P_s * j may pass 2**63)."""
        j = (np.asarray(windows, dtype=np.int64) - self.anchor).astype(object)[:, None]
        floors = (j * np.array(self._steps, dtype=object)[None, :]) // self.ramp
        return (np.array(self.first, dtype=object)[None, :] + floors[:, 1:] - floors[:, :-1]).astype(np.int64)

    def drawn(self, window: int) -> list[int]:
        """Each source's slots in this piece's formula over windows [anchor, window), in closed form."""
        j = window - self.anchor
        floors = [_floor_sum(j, self.ramp, step) for step in self._steps]
        return [a * j + hi - lo for a, hi, lo in zip(self.first, floors[1:], floors[:-1])]


def _floor_sum(n: int, m: int, a: int) -> int:
    """sum of floor(a * i / m) for i in [0, n), any sign of a, m > 0: the Euclid-like reduction, O(log m) steps."""
    total, b = 0, 0
    if a < 0:  # floor(a i / m) = floor((a mod m) i / m) - ((a mod m) - a) / m * i
        total -= n * (n - 1) // 2 * ((a % m - a) // m)
        a %= m
    while n:
        total += n * (n - 1) // 2 * (a // m) + n * (b // m)
        a, b = a % m, b % m
        top = a * n + b
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


SEGMENT_FIELDS = ({"weights"}, {"from", "to"})  # a constant segment, a linear ramp; each with "windows"


def schedule_pieces(schedule: Sequence[dict], sources: int, window: int | None) -> tuple[int, tuple[Piece, ...]]:
    """The window M and the pieces of a schedule: a JSON-like list of segments, each {"weights": [...]} (constant)
    or {"from": [...], "to": [...]} (a linear ramp, which reaches "to" at the window after its last), with
    "windows": how many windows it lasts (only the last segment may leave it out: to the end). After a last segment
    with "windows", its final weights hold. Every weight vector is realised as counts of M by largest remainder;
    errors name the segment and the field."""
    if isinstance(schedule, (str, bytes, dict)) or not isinstance(schedule, Sequence) or not schedule:
        raise ValueError(
            f'schedule must be a non-empty list of segments ({{"weights": [...], "windows": n}} or '
            f'{{"from": [...], "to": [...], "windows": n}}), got {schedule!r}'
        )
    segments = []
    for i, segment in enumerate(schedule):
        where = f"schedule[{i}]"
        keys = set(segment) - {"windows"} if isinstance(segment, dict) else None
        if keys not in SEGMENT_FIELDS:
            raise ValueError(
                f'{where} must be a dict with "weights" (constant) or "from" and "to" (a linear '
                f'ramp), and "windows", got {segment!r}'
            )
        vectors = []
        for k in (k for k in ("weights", "from", "to") if k in segment):
            vectors.append(_normalised(segment[k], f"{where}.{k}", zero_ok=True))
            if len(vectors[-1]) != sources:
                raise ValueError(
                    f"{where}.{k} has {len(vectors[-1])} weights for {sources} sources: pass one per source"
                )
        length = segment.get("windows")
        if length is None and (i < len(schedule) - 1 or "from" in segment):
            raise ValueError(f"{where}.windows is missing: only a last constant segment may run to the end")
        if length is not None and (not is_int(length) or not 0 < length <= MAX_SAMPLES):
            raise ValueError(
                f"{where}.windows must be a positive int (windows of mix.window positions), got {length!r}"
            )
        segments.append((vectors[0], vectors[-1], length))
    if window is None:
        window = _smallest_window(np.stack([w for first, last, _ in segments for w in (first, last)]))
    pieces, start = [], 0
    for first, last, length in segments:
        a, b = _apportion(first, window), _apportion(last, window)
        ramp = 1
        if a != b:
            assert length is not None, "a ramp's windows were checked above"
            ramp = length
        pieces.append(Piece(start, start, ramp, a, b))
        start += length or 0
    if segments[-1][2] is not None:
        pieces.append(Piece(start, start, 1, pieces[-1].last, pieces[-1].last))
    return window, tuple(_merged(pieces))


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent constant pieces of equal counts as one: the same windows, fewer pieces to search."""
    out: list[Piece] = []
    for piece in pieces:
        if out and out[-1].ramp == piece.ramp == 1 and out[-1].first == out[-1].last == piece.first == piece.last:
            continue
        out.append(piece)
    return out


def _source_seed(seed: int, name: str) -> int:
    """Each source's own order seed, from the mixture seed and the source's name (not its place in the list)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class MixturePlan:
    """The arithmetic of a mixture, without its data: which (source, index) sits at each position. Enough to
    audit a run by source (`python -m loader audit RUN_DIR --mixture PLAN.json`); `save`/`load` as JSON. With a
    `schedule`, the counts vary by window (`window_table`) and `counts` are window 0's."""

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    num_samples: int
    seed: int = 0
    shuffle: bool = True
    schedule: tuple[Piece, ...] = ()  # empty: `counts` in every window; else the pieces, `counts` window 0's
    changes: tuple[int, ...] = ()  # the windows at which the schedule was changed during the run
    epochs_continue: bool = False  # loader epoch e serves positions [e N, (e + 1) N) of one stream (a loader with
    # shuffle=True leaves the order to the mixture): every epoch has windows of its own, each source's draws run on
    requests: tuple[tuple[int, int], ...] = ()  # (step, window) of each change made online: the step after whose
    # update the loop asked for it, and the window from which it applies (`ResumableDataLoader.change_mixture`)

    def __post_init__(self) -> None:
        sources = len(self.names)
        if not sources or len(set(self.names)) != sources or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"names must be distinct non-empty strings, one per source, got {list(self.names)!r}")
        for field, values in (("lengths", self.lengths), ("counts", self.counts)):
            if len(values) != sources:
                raise ValueError(f"{field}: {len(values)} values for {sources} sources")
            for name, value in zip(self.names, values):
                if not is_int(value) or value < (0 if self.schedule and field == "counts" else 1):
                    what = "is empty" if field == "lengths" else "has no slot in a window: raise its weight or window="
                    raise ValueError(f"source {name!r} {what} ({field} {value!r})")
        check_num_samples("num_samples", self.num_samples, least=1)
        if self.window > LARGEST_WINDOW:  # a plan file is data: its slot table must fit as a Mixture's would
            raise ValueError(f"counts: a window of {self.window} slots, more than the {LARGEST_WINDOW} a mixture has")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.epochs_continue, bool):
            raise ValueError(f"epochs_continue must be true or false, got {self.epochs_continue!r}")
        pairs = [tuple(r) if isinstance(r, (list, tuple)) else () for r in self.requests]
        if (
            any(len(r) != 2 or not all(is_int(v) and 0 <= v <= MAX_SAMPLES for v in r) for r in pairs)
            or pairs != sorted(pairs)
            or [w for _, w in pairs] != sorted(w for _, w in pairs)
        ):
            raise ValueError(
                f"requests must be increasing [step, window] pairs of non-negative ints, got {list(self.requests)!r}"
            )
        object.__setattr__(self, "requests", tuple(pairs))
        if self.schedule:
            self._check_schedule()

    def _check_schedule(self) -> None:
        """Pieces from window 0 on, in order, each count vector of the window's size, a ramp ended before the next
        piece, the last piece constant; changes at piece starts. A plan file is data: it is checked, not believed."""
        pieces, m = self.schedule, self.window
        for i, piece in enumerate(pieces):
            where = f"schedule piece {i}"
            ints = (piece.start, piece.anchor, piece.ramp)
            if (
                not all(is_int(v) and 0 <= v <= MAX_SAMPLES for v in ints)
                or piece.ramp < 1
                or piece.anchor > piece.start
            ):
                raise ValueError(
                    f"{where}: start, anchor, ramp must be ints with anchor <= start and ramp >= 1, got {ints}"
                )
            for field, counts in (("from", piece.first), ("to", piece.last)):
                if len(counts) != len(self.names) or not all(is_int(c) and c >= 0 for c in counts) or sum(counts) != m:
                    raise ValueError(
                        f"{where}.{field} must be {len(self.names)} non-negative ints summing to the "
                        f"window {m}, got {list(counts)!r}"
                    )
            stop = pieces[i + 1].start if i + 1 < len(pieces) else None
            if (
                stop is not None
                and stop <= piece.start
                or (piece.first != piece.last and (stop is None or stop > piece.anchor + piece.ramp))
            ):
                raise ValueError(
                    f"{where}: pieces must start in increasing order from window 0, and a ramp end by "
                    f"its last window; the last piece must be constant"
                )
        if pieces[0].start != 0 or pieces[0].first != self.counts:
            raise ValueError("schedule piece 0 must start at window 0 with the plan's counts")
        starts = {p.start for p in pieces}
        if list(self.changes) != sorted(set(self.changes)) or not set(self.changes) <= starts:
            raise ValueError(f"changes must be increasing windows at which a piece starts, got {list(self.changes)!r}")

    @property
    def window(self) -> int:
        return sum(self.counts)

    @property
    def end(self) -> int:
        """The positions there are: num_samples, or (epochs continuing) those of every epoch the stream may reach."""
        return int(np.iinfo(np.int64).max) if self.epochs_continue else self.num_samples

    def in_epoch(self, positions: ArrayLike, epoch: int) -> np.ndarray:
        """The stream positions of loader positions of `epoch`: offset by epoch * num_samples when epochs continue."""
        positions = np.asarray(positions, dtype=np.int64)
        return positions + epoch * self.num_samples if self.epochs_continue else positions

    @cached_property
    def _pieces(self) -> tuple[Piece, ...]:
        return self.schedule or (Piece(0, 0, 1, self.counts, self.counts),)

    @cached_property
    def _starts(self) -> tuple[np.ndarray, list[list[int]]]:
        """Each piece's first window, and each source's draws before it (C_s there)."""
        drawn = [[0] * len(self.names)]
        for before, piece in zip(self._pieces, self._pieces[1:]):
            inside = zip(before.drawn(piece.start), before.drawn(before.start))
            drawn.append([c + hi - lo for c, (hi, lo) in zip(drawn[-1], inside)])
        return np.array([p.start for p in self._pieces], dtype=np.int64), drawn

    @cached_property
    def _source_seeds(self) -> np.ndarray:
        return np.array([_source_seed(self.seed, name) for name in self.names], dtype=np.uint64)

    def window_table(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each source's slots in each of these windows, and its draws before it (C_s(k)), both (len(windows),
        sources). O(log) per window in closed form; a run of consecutive windows by a running sum from its first."""
        windows = np.asarray(windows, dtype=np.int64)
        if not self.schedule:
            counts = np.broadcast_to(np.asarray(self.counts, dtype=np.int64), (len(windows), len(self.names)))
            return counts, windows[:, None] * counts
        starts, drawn_at = self._starts
        piece_of = np.searchsorted(starts, windows, side="right") - 1
        counts = np.empty((len(windows), len(self.names)), dtype=np.int64)
        drawn = np.empty_like(counts)
        for p in np.unique(piece_of).tolist():
            at, piece = np.nonzero(piece_of == p)[0], self._pieces[p]
            ks = windows[at]
            counts[at] = piece.counts(ks)
            first_of_run = np.concatenate(([True], np.diff(ks) != 1))
            run = np.cumsum(first_of_run) - 1
            origin = piece.drawn(piece.start)
            base = np.array(
                [
                    [c + d - o for c, d, o in zip(drawn_at[p], piece.drawn(k), origin)]
                    for k in ks[first_of_run].tolist()
                ],
                dtype=np.int64,
            )
            running = np.cumsum(counts[at], axis=0) - counts[at]  # slots before each window of this piece's ks
            drawn[at] = base[run] + running - running[first_of_run][run]
        return counts, drawn

    def _slot_tables(self, windows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each window (rows) and slot (columns): its source, and its rank among that source's slots of the
        window in position order. O(M) per window, all windows in one vectorised pass."""
        bounds = np.concatenate((np.zeros((len(windows), 1), np.int64), np.cumsum(counts, axis=1)), axis=1)
        m = self.window
        # slot values [bounds[s], bounds[s + 1]) of a window's permutation belong to source s: one search over
        # every row's inner bounds at once, each row's shifted past the one before
        inner, shift = bounds[:, 1:-1], np.arange(len(windows), dtype=np.int64)[:, None] * (m + 1)
        shifted = window_arrangements(self.seed, windows, m) + shift
        source = np.searchsorted((inner + shift).reshape(-1), shifted, side="right") - shift // (m + 1) * inner.shape[1]
        by_source = np.argsort(source, axis=1, kind="stable")  # each source's slots, in position order
        rank = np.empty_like(by_source)
        first_of = np.take_along_axis(bounds, np.take_along_axis(source, by_source, axis=1), axis=1)
        np.put_along_axis(rank, by_source, np.arange(m) - first_of, axis=1)
        return source, rank

    def _slots(self, positions: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(draws of its source before the position's window, source, rank among the source's slots of the
        window) at each position."""
        positions = np.asarray(positions, dtype=np.int64)
        end = self.end
        if positions.size and (positions.min() < 0 or positions.max() >= end):
            bad = positions[(positions < 0) | (positions >= end)][0]
            raise IndexError(f"mixture position {bad} out of range for {end} positions")
        windows, slot = np.divmod(positions, self.window)
        distinct, row = np.unique(windows, return_inverse=True)
        counts, drawn = self.window_table(distinct)
        sources, ranks = self._slot_tables(distinct, counts)
        source = sources[row, slot]
        return drawn[row, source], source, ranks[row, slot]

    def source_of(self, positions: ArrayLike, epoch: int = 0, *, names: bool = False) -> np.ndarray:
        """The source at each position (of loader `epoch`: see `in_epoch`): its number, or with `names=True` the
        name the Mixture was given for it."""
        sources = self._slots(self.in_epoch(positions, epoch))[1]
        return np.asarray(self.names)[sources] if names else sources

    def locate(self, positions: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(source number, index within that source) at each position: a pure function of (plan, position)."""
        before, source, rank = self._slots(positions)
        draw = before + rank
        length = np.asarray(self.lengths)[source]
        epoch, at = np.divmod(draw, length)
        if not self.shuffle:
            return source, at
        n = len(self.names)  # a block draws from few (source, epoch) pairs: keys once per pair
        pairs, pair = np.unique(epoch * n + source, return_inverse=True)
        keys = epoch_round_keys(self._source_seeds[pairs % n], pairs // n)
        return source, permute(at, length, keys[:, pair]).astype(np.int64)

    def samples_per_source(self) -> tuple[int, ...]:
        """Positions of each source in [0, num_samples): the draws before the last window plus its part."""
        whole, rest = divmod(self.num_samples, self.window)
        counts, drawn = self.window_table(np.array([whole]))
        tail = np.bincount(self._slot_tables(np.array([whole]), counts)[0][0, :rest], minlength=len(self.names))
        return tuple(int(d) + int(t) for d, t in zip(drawn[0], tail))

    def describe(self) -> str:
        """The schedule's pieces by position range, each source's slots per window, constant or a ramp, and the
        positions where the schedule was changed during the run."""
        pieces = self.schedule or (Piece(0, 0, 1, self.counts, self.counts),)
        ends = [piece.start * self.window for piece in pieces[1:]] + [self.num_samples]
        parts = [
            f"{piece.start * self.window}-{min(end, self.num_samples) - 1} "
            + "/".join(map(str, piece.first))
            + ("" if piece.first == piece.last else " -> " + "/".join(map(str, piece.last)))
            for piece, end in zip(pieces, ends)
            if piece.start * self.window < self.num_samples
        ]
        changed = "".join(f", changed at position {k * self.window} (window {k})" for k in self.changes)
        return (
            f"mixture schedule, {'/'.join(self.names)} slots per window of {self.window}, by position: "
            f"{', '.join(parts)}{changed}"
        )

    def amended(self, schedule: tuple[Piece, ...], window: int) -> MixturePlan:
        """This plan up to `window`, then `schedule` from there on (its pieces cut at `window`, keeping their
        anchors): the windows before keep what they held, and every source's draws run on across the change."""
        kept = [p for p in self._pieces if p.start < window]
        ahead = [p for p in schedule if p.start >= window]
        at = [p for p in schedule if p.start <= window][-1]
        cut = Piece(window, at.anchor, at.ramp, at.first, at.last)
        pieces = tuple(_merged(kept + [cut] + [p for p in ahead if p.start > window]))
        changes = tuple(sorted({*self.changes, window} & {p.start for p in pieces}))
        return MixturePlan(
            self.names,
            self.lengths,
            pieces[0].first,
            self.num_samples,
            self.seed,
            self.shuffle,
            pieces if len(pieces) > 1 or 0 in pieces[0].first or changes else (),
            changes,
            self.epochs_continue,
            self.requests,
        )

    def with_weights(self, weights: Sequence[float], window: int, step: int) -> MixturePlan:
        """This plan with `weights` (zeros allowed: a source paused) from `window` on, each source's draws running
        on, recorded as requested at `step`: an online change (`ResumableDataLoader.change_mixture`)."""
        w = _normalised(weights, "weights", zero_ok=True)
        if len(w) != len(self.names):
            raise ValueError(f"{len(w)} weights for {len(self.names)} sources: pass one weight per source")
        counts = _apportion(w, self.window)
        plan = self.amended((Piece(0, 0, 1, counts, counts),), window)
        return replace(plan, schedule=plan._pieces, requests=(*self.requests, (step, window)))

    def extends(self, base: MixturePlan) -> bool:
        """Whether this plan is `base` with online changes added: the same mixture, the same windows before the
        first change that `base` has not made."""
        ahead = self.requests[len(base.requests) :]
        if self.requests[: len(base.requests)] != base.requests or not ahead:
            return self == base
        same = replace(base.amended(self._pieces, ahead[0][1]), changes=self.changes, requests=self.requests)
        return replace(same, schedule=same._pieces) == replace(self, schedule=self._pieces)

    def to_dict(self) -> dict:
        """The JSON form; a plan without a schedule is written as before schedules existed (same fingerprint)."""
        plain = {
            "kind": PLAN_KIND,
            "version": PLAN_VERSION,
            "order_version": ORDER_VERSION,
            "names": list(self.names),
            "lengths": list(self.lengths),
            "counts": list(self.counts),
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }
        if not self.schedule and not self.epochs_continue:
            return plain
        version = CONTINUING_VERSION if self.epochs_continue else SCHEDULED_VERSION
        return {
            **plain,
            "version": version,
            "schedule": [p.to_json() for p in self.schedule],
            "changes": list(self.changes),
            **({"epochs_continue": True} if self.epochs_continue else {}),
            **({"requests": [list(r) for r in self.requests]} if self.requests else {}),
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "mixture plan") -> MixturePlan:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: holds a JSON {type(data).__name__}, not a mixture plan's object")
        found = tuple(data.get(k) for k in ("kind", "version", "order_version"))
        readable = [(PLAN_KIND, v, ORDER_VERSION) for v in (PLAN_VERSION, SCHEDULED_VERSION, CONTINUING_VERSION)]
        if found not in readable:
            raise ValueError(
                f"{where}: (kind, version, order_version) is {found}, this loader reads {readable}: "
                "save the plan again with this version (Mixture.plan.save)"
            )
        try:
            schedule = (
                tuple(
                    Piece(p["start"], p["anchor"], p["ramp"], tuple(p["from"]), tuple(p["to"]))
                    for p in data["schedule"]
                )
                if found[1] != PLAN_VERSION
                else ()
            )
            return cls(
                tuple(data["names"]),
                tuple(data["lengths"]),
                tuple(data["counts"]),
                data["num_samples"],
                data["seed"],
                data["shuffle"],
                schedule,
                tuple(data["changes"]) if schedule else (),
                found[1] == CONTINUING_VERSION and data["epochs_continue"],
                tuple(data.get("requests", ())) if schedule else (),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: no field {err}; the file is truncated or not a mixture plan") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON (atomically: a reader never sees half a file)."""
        tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> MixturePlan:
        with open(path) as f:
            return cls.from_dict(json.load(f), where=os.fspath(path))

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


_NO_LISTS: tuple[int, list[int], list[int]] = (-1, [], [])  # no block's lists yet (-1: no block)


def _fetch(source: Any, indices: list[int]) -> list:
    """A source's samples at these indices, in one call when it takes batches (TokenSource, HF datasets)."""
    getitems = getattr(source, "__getitems__", None)
    return getitems(indices) if getitems else [source[i] for i in indices]


def _token_span(sources: Sequence[Any]) -> int | None:
    """seq_len + 1 when every source is a TokenSource (its own __getitems__) of plain samples, all of one seq_len:
    a batch of the mixture is then one int64 array that each source fills in place (`TokenSource._fill`). Else
    None: the samples are whatever the sources return, fetched per source and put back in position order."""
    tokens = [
        s
        for s in sources
        if isinstance(s, TokenSource) and type(s).__getitems__ is TokenSource.__getitems__ and s.plain
    ]
    if len(tokens) == len(sources) and len({s.seq_len for s in tokens}) == 1:
        return tokens[0].seq_len + 1
    return None


def _source_fingerprint(source: Any) -> str | None:
    """A source's own digest when it has one (`fingerprint()`; Hugging Face datasets keep `_fingerprint`)."""
    fingerprint = getattr(source, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else getattr(source, "_fingerprint", None)


def _amend(old: MixturePlan, new: MixturePlan, change_at: int) -> MixturePlan:
    """`old` up to the first whole window from `change_at`, `new` from there: refused, naming the field, when
    anything but the weights differs (those would move the past's samples too)."""
    for field in ("names", "lengths", "num_samples", "seed", "shuffle", "window"):
        if getattr(old, field) != getattr(new, field):
            raise ValueError(
                f"amends: the plan's {field} is {getattr(old, field)!r}, this mixture's "
                f"{getattr(new, field)!r}: a change of schedule changes the weights only; build the "
                f"mixture with the {field} of the run it continues"
            )
    end = old.end - (new.window if old.epochs_continue else 0)
    if not is_int(change_at) or not 0 <= change_at < end:
        raise ValueError(f"change_at must be a position in [0, {end}), got {change_at!r}")
    first = -(-change_at // new.window)
    if first * new.window >= new.num_samples and not old.epochs_continue:  # else the change would never apply
        last = (new.num_samples - 1) // new.window * new.window
        raise ValueError(
            f"change_at={change_at} is inside the mixture's last window ({last} to "
            f"{new.num_samples - 1}): a change applies from the first whole window at or after change_at, "
            f"and none follows, so it would never apply; pass change_at <= {last}"
        )
    return old.amended(new._pieces, first)


class Mixture(torch.utils.data.Dataset):
    """`num_samples` positions drawn from `sources` in the proportions `weights`, exactly per window of
    `mix.window` positions, each position a pure function of (seed, position) -> (source, index). The mixture
    already interleaves: a loader with shuffle=True leaves the order to it (`continue_epochs`: loader epoch e is
    its positions [e N, (e + 1) N), fresh windows, draws running on), one with shuffle=False serves its positions
    in order, the same every epoch. `ResumableDataLoader.change_mixture` changes its weights from the training loop.

    Args:
        sources: map-style datasets (TokenSource, WebDatasetSource, Hugging Face `datasets.Dataset`, ...).
        weights: relative weights, one per source (normalised; realised as `counts` / `window`).
        num_samples: positions in the mixture: the training budget in samples. A source whose epoch is used up
            continues with its next epoch in a new order.
        seed: keys the arrangement inside each window and every source's order.
        names: one per source, the identity the audit reports (default "source-0", "source-1", ...).
        window: M, the positions per window; default: the smallest M <= MAX_WINDOW that holds every weight exactly.
        shuffle: each source epoch in a keyed order (True) or in index order (False).
        schedule: instead of `weights`, weights that change with the window: a JSON-like list of segments (see
            `schedule_pieces`): {"weights": [...], "windows": n} constant, {"from": [...], "to": [...],
            "windows": n} a linear ramp.
        amends, change_at: change the schedule (or weights) of a running job: `amends` is the plan it trained with
            (`MixturePlan.load` of the saved mixture.json), `change_at` a position after every mixture position it
            trained (under a shuffled loader order those are spread over the whole epoch: `check_change`). Windows
            before the first whole window from `change_at` keep the old plan (refused when none follows), the rest
            follow the new one, each source's draws running on; the plan records the change (`plan.changes`), and
            a checkpoint saved under the old plan resumes (anything else about the mixture must stay the same).
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float] | None,
        num_samples: int,
        seed: int = 0,
        *,
        names: Sequence[str] | None = None,
        window: int | None = None,
        shuffle: bool = True,
        schedule: Sequence[dict] | None = None,
        amends: MixturePlan | None = None,
        change_at: int | None = None,
    ) -> None:
        self.sources = list(sources)
        if (weights is None) == (schedule is None):
            raise ValueError("pass weights= (fixed) or schedule= (changing with the window), one of them")
        if weights is not None and len(weights) != len(self.sources):
            raise ValueError(f"{len(weights)} weights for {len(self.sources)} sources: pass one weight per source")
        names = tuple(names) if names is not None else tuple(f"source-{s}" for s in range(len(self.sources)))
        if (amends is None) != (change_at is None):
            raise ValueError(
                "amends= (the plan the run trained with) and change_at= (where the change begins) go together"
            )
        window = amends.window if window is None and amends is not None else window
        pieces: tuple[Piece, ...]
        if schedule is None:
            assert weights is not None, "weights= or schedule=, checked above"
            counts, pieces = window_counts(weights, window), ()
        else:
            window, pieces = schedule_pieces(schedule, len(self.sources), window)
            counts = pieces[0].first
        self.plan = MixturePlan(
            names,
            tuple(len(s) for s in self.sources),
            counts,
            num_samples,
            seed,
            bool(shuffle),
            pieces if len(pieces) > 1 or 0 in counts else (),
        )
        self.amends = amends
        if amends is not None:
            assert change_at is not None, "amends= and change_at= go together, checked above"
            self.plan = _amend(amends, self.plan, change_at)
            self._change_at = -(-change_at // self.plan.window) * self.plan.window  # the first window it changes
        self._block = -(-BLOCK // self.plan.window) * self.plan.window  # whole windows
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lists: tuple[int, list[int], list[int]] = _NO_LISTS
        self._span = _token_span(self.sources)  # decided once; an int, so it travels to workers with the mixture

    @property
    def names(self) -> tuple[str, ...]:
        return self.plan.names

    @property
    def window(self) -> int:
        return self.plan.window

    @property
    def counts(self) -> tuple[int, ...]:
        return self.plan.counts

    @property
    def weights(self) -> tuple[float, ...]:
        """The proportions as realised: counts / window."""
        return tuple(c / self.window for c in self.counts)

    def __len__(self) -> int:
        return self.plan.num_samples

    @property
    def epoch_aware(self) -> bool:
        """The loader's epoch reaches the mixture (on each index) when its epochs continue, and its sources when one
        of them takes it (a PackedSource)."""
        return self.plan.epochs_continue or any(getattr(source, "epoch_aware", False) for source in self.sources)

    def use_plan(self, plan: MixturePlan) -> None:
        """From now on, `plan` (one of `change_weights`, checked by the caller), in this process."""
        self.plan, self._lists = plan, _NO_LISTS
        self._cache.clear()

    def carried_plan(self) -> MixturePlan | None:
        """The plan each batch carries to the workers (their copies were made at iter()): this one, once it holds an
        online change; before, nothing (a batch costs no more than it did)."""
        return self.plan if self.plan.requests else None

    def change_weights(self, weights: Sequence[float], position: int, step: int) -> MixturePlan:
        """The plan with `weights` from the first whole window at or after mixture `position` (nothing at or after
        it trained or dispatched: the loader says where, `ResumableDataLoader.change_mixture`), recorded as asked
        at `step`; `use_plan` makes it this mixture's."""
        if not self.plan.epochs_continue and position >= len(self):
            raise ValueError(
                f"no whole window of this epoch is left to change (the change would begin at position "
                f"{position} of {len(self)}): under shuffle=False every epoch serves the same "
                f"positions; change the weights earlier, or run the loader with shuffle=True (each epoch "
                f"continues the mixture's stream)"
            )
        return self.plan.with_weights(weights, -(-position // self.window), step)

    def recorded_plan(self, recorded: dict, base: MixturePlan | None = None) -> MixturePlan:
        """The plan a checkpoint recorded (`MixturePlan.to_dict`, read as JSON, never unpickled), with the online
        changes of the run it continues, for `use_plan`: refused unless it is this mixture's (or `base`, the plan
        before changes this process made itself) with changes added."""
        plan = MixturePlan.from_dict(recorded, "the checkpoint's mixture plan")
        if not plan.extends(self.plan if base is None else base):
            raise StateError(
                "the checkpoint's mixture plan (with the weights changed online) is not this mixture's "
                "plan with changes added: build the Mixture with the sources, weights or schedule, "
                "seed, window and num_samples of the run it resumes (and the loader's shuffle=)"
            )
        return plan

    def continue_epochs(self) -> None:
        """Serve a loader that leaves the order to this mixture (shuffle=True): loader epoch e is positions
        [e N, (e + 1) N) of one stream, with windows (and so arrangements) of its own, each source's draws running
        on. A loader position is then a mixture position, at any world size: a change of schedule is checked
        against what was committed exactly, in O(intervals). Called by the loader, before its workers start."""
        if self.plan.epochs_continue:
            return
        if self.amends is not None and not self.amends.epochs_continue:
            raise StateError(
                "amends= is a plan of a run whose loader had shuffle=False (its epochs repeat the same "
                "positions): continue it with shuffle=False"
            )
        self.plan = replace(self.plan, epochs_continue=True)
        self._cache.clear()
        self._lists = _NO_LISTS

    def _block_table(self, block: int) -> np.ndarray:
        """Rows (source, index) of a whole block of positions, kept for the next batches (two blocks per process):
        one array, so that a batch is looked up by one fancy index."""
        if block not in self._cache:
            low = block * self._block
            self._cache[block] = np.stack(self.plan.locate(np.arange(low, min(low + self._block, self.plan.end))))
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return self._cache[block]

    def locate(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source number, index within it) per position: `plan.locate`, through a per-process cache of the last
        blocks when positions come in order (shuffle=False at any world size), where a batch then costs a lookup."""
        if not len(positions):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        low, high = min(positions), max(positions)
        first, last = low // self._block, high // self._block
        if last - first > 1 or low < 0 or high >= self.plan.end:
            return self.plan.locate(positions)
        table, origin = self._block_table(first), first * self._block
        if last != first:
            table = np.concatenate((table, self._block_table(last)), axis=1)
        # column c is position origin + c (not take(mode="wrap"): numpy wraps an index by repeated subtraction,
        # O(position / block) per position)
        source, index = table.take(np.subtract(positions, origin), axis=1)
        return source, index

    def _block_lists(self, block: int) -> tuple[list[int], list[int]]:
        """A block's table as Python lists (sources, indices), for small batches (`_shares`); the last block's."""
        lists = self._lists  # read once: one tuple, so another thread's swap never mixes two blocks
        if lists[0] != block:
            table = self._block_table(block)
            lists = self._lists = (block, table[0].tolist(), table[1].tolist())
        return lists[1], lists[2]

    def _shares(self, positions: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
        """Each source's share of a batch: (source number, its rows in the batch, its indices), sources in order,
        rows in position order. A small batch inside one block is looked up in the block's lists and grouped in
        Python: at a few positions, cheaper than the numpy calls of `locate` and `_by_source` together."""
        if 0 < len(positions) <= SMALL_BATCH:
            low, high = min(positions), max(positions)
            block = low // self._block
            if low >= 0 and high < self.plan.end and high // self._block == block:
                sources, indices = self._block_lists(block)
                shares: dict[int, tuple[list[int], list[int]]]  # a source's rows in the batch and its indices
                origin, shares = block * self._block, {}
                for row, position in enumerate(positions):
                    at = position - origin
                    share = shares.get(sources[at])
                    if share is None:
                        share = shares[sources[at]] = ([], [])
                    share[0].append(row)
                    share[1].append(indices[at])
                return [(s, *shares[s]) for s in sorted(shares)]
        return list(self._by_source(*self.locate(positions)))

    def _by_source(self, source: np.ndarray, index: np.ndarray) -> Iterator[tuple[int, list[int], list[int]]]:
        """Each source's share of a batch: (source number, its rows in the batch, its indices), in position order."""
        by_source = source.argsort(kind="stable")
        ends = accumulate(np.bincount(source, minlength=len(self.sources)).tolist())
        rows, indices = by_source.tolist(), index[by_source].tolist()
        low = 0
        for s, high in enumerate(ends):
            if low < high:
                yield s, rows[low:high], indices[low:high]
            low = high

    def _stream(self, positions: Sequence[int]) -> Sequence[int]:
        """The mixture positions of a batch: the loader's positions of its epoch, offset by epoch * num_samples when
        the plan's epochs continue (the epoch rides on each index, `loader.SampleIndex.epoch`). A worker's copy of
        the mixture takes the plan the batch carries when it holds online changes this copy has not seen."""
        carried = getattr(positions[0], "plan", None) if len(positions) else None
        if carried is not None and carried is not self.plan and carried.requests != self.plan.requests:
            self.use_plan(carried)
        if not self.plan.epochs_continue or not len(positions):
            return positions
        n, epoch = self.plan.num_samples, getattr(positions[0], "epoch", 0)
        if min(positions) < 0 or max(positions) >= n:
            raise IndexError(f"mixture position {max(positions)} out of range for an epoch of {n} positions")
        return [p + epoch * n for p in positions] if epoch else positions

    def _tokens(self, positions: Sequence[int]) -> torch.Tensor:
        """The int64 tensor (len(positions), seq_len + 1) of a batch of TokenSources, each filling its rows."""
        assert self._span is not None, "read as tokens only with a token span (batch_reader, __getitems__)"
        out = np.empty((len(positions), self._span), dtype=np.int64)
        for s, rows, indices in self._shares(self._stream(positions)):
            self.sources[s]._fill(out, rows, indices)
        return torch.from_numpy(out)

    def batch_reader(self) -> Callable[[Sequence[int]], torch.Tensor] | None:
        """The batch as the tensor that the loader's collate makes of `__getitems__`'s Rows, read without the Rows
        (`loader.core.rows.batch_reader`): where the batch is one int64 array (TokenSources of plain samples and
        one seq_len), and not in a subclass with its own `__getitems__`, whose batches this would not be."""
        own = type(self).__getitems__ is Mixture.__getitems__
        return self._tokens if self._span is not None and own else None

    def __getitems__(self, positions: Sequence[int]) -> list:
        """A batch: each source asked once, for its share. TokenSources of plain samples and one seq_len fill
        their rows of one int64 array in place, returned as its `Rows` (which the loader's collate hands on as
        that array: no per-source allocation, no reordering, no stacking); other sources are asked in one call
        when they take batches, and their samples put back in position order."""
        if self._span is not None:
            return Rows(self._tokens(positions))
        carried = len(positions) and hasattr(positions[0], "carried_to")  # the loader's SampleIndex
        carriers: Sequence[Any] = positions  # then ints with what they carry (sources may not import the loader)
        out: list = [None] * len(positions)
        for s, rows, indices in self._shares(self._stream(positions)):
            if carried:  # a source index carries its position's seed and epoch
                indices = [carriers[r].carried_to(i) for r, i in zip(rows, indices)]
            for row, sample in zip(rows, _fetch(self.sources[s], indices)):
                out[row] = sample
        return out

    def __getitem__(self, position: int) -> Any:
        return self.__getitems__([position])[0]

    def sample_key(self, position: int, epoch: int = 0) -> tuple[str, int]:
        """(source name, index within the source): the identity of the sample at `position` of loader `epoch`."""
        (source,), (index,) = self.locate(self.plan.in_epoch([position], epoch))
        return self.names[source], int(index)

    def fingerprint(self, plan: MixturePlan | None = None) -> str:
        """Digest of the plan (this mixture's, or another of these sources) and of the sources' own fingerprints,
        for the checkpoint manifest."""
        return self._digest(self.plan if plan is None else plan, [_source_fingerprint(s) for s in self.sources])

    @staticmethod
    def _digest(plan: MixturePlan, sources: list[str | None]) -> str:
        layout = {"plan": plan.to_dict(), "sources": sources}
        return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]

    def fingerprint_of_earlier_release(self) -> str | None:
        """The fingerprint the previous release recorded, where a source's differs (a TokenSource's held no file
        content then): such a checkpoint resumes as it would have there, with a warning."""
        earlier = [getattr(s, "fingerprint_of_earlier_release", None) for s in self.sources]
        earlier = [e() if callable(e) else None for e in earlier]
        if all(e is None for e in earlier):
            return None
        return self._digest(
            self.plan, [_source_fingerprint(s) if e is None else e for e, s in zip(earlier, self.sources)]
        )

    def fingerprint_before_change(self) -> str | None:
        """The fingerprint a checkpoint saved before this mixture's change of schedule holds (None: no change)."""
        return None if self.amends is None else self.fingerprint(self.amends)

    def check_change(self, progress: dict, order: Order) -> None:
        """A progress saved before the change must have trained nothing at or after the change's first window:
        those positions were trained under the old plan, and the new one names other samples there. It commits
        positions of the loader's `order`, which hold mixture positions through it: when the plan's epochs continue
        (a loader that leaves the order to the mixture), position p of epoch e is mixture position e N + p and every
        epoch before the progress's was trained whole, so the check is exact in O(intervals); under a shuffled
        order, they are spread over the whole mixture (`EpochOrder.last_index` finds the last one, in bounded
        memory)."""
        if self.amends is None or self.plan == self.amends:
            return
        at = self._change_at
        saved = progress_of(progress)
        check_fingerprint(saved.fingerprint, order.fingerprint(), "the loader progress")
        if self.plan.epochs_continue:
            return self._check_continuing(saved, at)
        shuffled = order.shuffle != "none" or order.lanes is not None
        for epoch, spans in sorted(saved.committed.items()):  # epochs finished before it served the old plan whole
            last = order.for_epoch(epoch).last_index(spans, at)
            if last is None:
                continue
            held = (
                f"positions of the loader's shuffled order that hold mixture positions up to {last}"
                if shuffled
                else f"positions up to {last}"
            )
            if -(-(last + 1) // self.window) * self.window < len(self):
                advice = f"pass change_at >= {last + 1}"
            else:
                advice = (
                    f"no change_at fits before epoch {epoch} ends: finish it under the old plan (resume with the "
                    f"mixture it trained with) and change from a checkpoint saved at its end, where any "
                    f"change_at fits"
                )
            if shuffled:
                advice += (
                    ". A Mixture interleaves its sources by itself: in a loader with shuffle=True (which leaves "
                    "the order to it) or shuffle=False (and no lanes) a change from just after what was "
                    "committed fits"
                )
            raise StateError(
                f"the schedule change begins at position {at} (window {at // self.window}), but epoch "
                f"{epoch} committed {held} under the old plan: {advice}"
            )

    def _check_continuing(self, saved: Progress, at: int) -> None:
        """`check_change` where loader epoch e is mixture positions [e N, (e + 1) N): the last position trained is
        the largest committed one, or the end of the epochs finished before the progress's."""
        n = len(self)
        last = saved.epoch * n - 1
        for epoch, spans in saved.committed.items():
            if len(spans):
                last = max(last, epoch * n + int(spans[-1, 1]) - 1)
        if last >= at:
            epoch, position = divmod(last, n)
            raise StateError(
                f"the schedule change begins at mixture position {at} (window {at // self.window}), but "
                f"the run committed mixture position {last} (epoch {epoch}, position {position}; loader "
                f"epoch e serves mixture positions from e * {n}) under the old plan: pass change_at >= "
                f"{last + 1}"
            )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": OrderedDict(), "_lists": _NO_LISTS}

    def __repr__(self) -> str:
        shares = ", ".join(f"{n}: {c}/{self.window}" for n, c in zip(self.names, self.counts))
        scheduled = f" in window 0, a schedule of {len(self.plan.schedule)} pieces" if self.plan.schedule else ""
        return f"Mixture({len(self)} positions; {shares} per window{scheduled}; fingerprint={self.fingerprint()})"
