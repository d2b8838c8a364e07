"""How an epoch's remaining samples are dealt out to ranks, micro-batches and optimizer updates.

With world size W, accumulation K, micro-batch B and global batch G = W*K*B, rank r's micro-batch j = g*K + m
(update g, micro-step m) covers remaining indices [g*G + m*W*B + r*B, ... + B). Hence:
- update g covers remaining indices [g*G, (g+1)*G), whatever W, K and B are (the epoch's last update excepted,
  which covers the rest, see below): with G unchanged, a resize does not change which samples form a global step;
- the ranks' slices are disjoint and cover everything served: exactly once by construction.

The tail T = R mod G. With drop_last it is dropped by policy. Otherwise nothing is dropped unless R < W, and every
rank still yields the same number of non-empty micro-batches, so DDP never waits on a missing one; micro-batches
of the epoch's last update may differ in size by one sample (at most B + 1), which the global-count loss
normalisation absorbs:
- T >= W: a final, short update covers [R - T, R). Each rank takes a contiguous share of T // W samples, the
  first T mod W ranks one more, split into ceil((T // W) / B) near-equal micro-batches on every rank (so the one
  more exceeds B only when T // W is a multiple of B);
- 0 < T < W after at least one full update: a short update would leave a rank empty, so the T samples ride on the
  last full update instead, whose final micro-step then covers W*B + T samples, one more on ranks 0..T-1: the
  epoch's last update covers [R - T - G, R);
- R < W (no full update, fewer samples than ranks): the R samples are dropped by policy.
Whether the tail is an update of its own depends on W (T >= W or not), so across a resize that keeps G the
updates are the same except the epoch's last one or two.

A batch-size ramp (a global batch schedule by optimizer step, `plan_at`) changes K, and so G, at given updates of
the epoch: update u covers remaining indices [P(u), P(u) + G(u)) with P(u) the sum of G over the epoch's earlier
updates, computed per stretch of one K (O(#changes), never per update). B and W stay, so micro-step m of update u
still covers W*B samples, rank r's B of them at offset r*B: the same samples per update at any W. The tail rule
applies after the last full update, with the G of the update it would be.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple, overload

import numpy as np

from loader.core.checks import check_positive_int


@dataclass(frozen=True)
class Layout:
    """The shape of consumption: who takes how much per micro-step and per optimizer update."""

    world_size: int
    grad_accum: int
    batch_size: int
    drop_last: bool

    def __post_init__(self) -> None:
        for name in ("world_size", "grad_accum", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.drop_last, bool):
            raise ValueError(f"drop_last must be a bool, got {self.drop_last!r}")

    @property
    def global_batch(self) -> int:
        return self.world_size * self.grad_accum * self.batch_size

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }


class Tail(NamedTuple):
    """What follows the plain micro-batches: each rank's contiguous share, split into near-equal micro-batches. It
    starts after the full updates, or at the last one's final micro-step when the leftover rides on it."""

    first_batch: int  # micro-batches before it are plain (B samples each, in update order)
    start: int  # the remaining index it starts at
    share: int  # samples of every rank in it; ranks 0..extra-1 take one more
    extra: int


class Stretch(NamedTuple):
    """Updates of one K in an epoch's plan, as lists with one entry per stretch reached: its first update, first
    micro-batch and first remaining index, and its K."""

    updates: list[int]
    batches: list[int]
    starts: list[int]
    ks: list[int]


@dataclass(frozen=True)
class EpochPlan:
    """The partition of `remaining` samples under a layout; identical on every rank. Its sizes are computed once:
    the loader asks for them at every delivered batch. `changes`: (update counted from this plan's first, K from
    it on), increasing, of a batch-size ramp (`plan_at`); `layout.grad_accum` is K at the first update."""

    remaining: int
    layout: Layout
    changes: tuple[tuple[int, int], ...] = ()

    @cached_property
    def stretches(self) -> Stretch:
        """The stretches of one K that the epoch's full updates reach (the last one may hold none of them)."""
        W, B = self.layout.world_size, self.layout.batch_size
        s = Stretch([0], [0], [0], [self.layout.grad_accum])
        for update, k in self.changes:
            n, per_update = update - s.updates[-1], W * s.ks[-1] * B
            if (self.remaining - s.starts[-1]) // per_update < n:
                break
            s.updates.append(update)
            s.batches.append(s.batches[-1] + n * s.ks[-1])
            s.starts.append(s.starts[-1] + n * per_update)
            s.ks.append(k)
        return s

    @cached_property
    def _full(self) -> tuple[int, int, int]:
        """(full updates, their micro-batches per rank, the remaining index after them)."""
        s, W, B = self.stretches, self.layout.world_size, self.layout.batch_size
        per_update = W * s.ks[-1] * B
        n = (self.remaining - s.starts[-1]) // per_update
        return s.updates[-1] + n, s.batches[-1] + n * s.ks[-1], s.starts[-1] + n * per_update

    @cached_property
    def full_updates(self) -> int:
        return self._full[0]

    @cached_property
    def tail(self) -> Tail:
        """The module docstring's cases; empty (share 0) when nothing follows the full updates: drop_last, no
        leftover, or R < W."""
        W, B = self.layout.world_size, self.layout.batch_size
        _, batches, end = self._full
        leftover = self.remaining - end
        if self.layout.drop_last or leftover == 0 or self.remaining < W:
            return Tail(batches, end, 0, 0)
        if leftover < W:
            return Tail(batches - 1, end - W * B, B, leftover)
        return Tail(batches, end, leftover // W, leftover % W)

    @cached_property
    def updates(self) -> int:
        """Optimizer updates of the plan: the full ones and a short one, if the tail is an update of its own."""
        return self.full_updates + int(self.tail.share > 0 and self.tail.first_batch == self._full[1])

    def _stretch(self, batch: int) -> int:
        return bisect.bisect_right(self.stretches.batches, batch) - 1

    def grad_accum_at(self, batch: int) -> int:
        """K of the update that micro-batch `batch` belongs to (the short update at the end included)."""
        return self.stretches.ks[self._stretch(batch)]

    def updates_in(self, batches: int) -> int:
        """Updates whole among the first `batches` micro-batches (a count of whole updates: `completed`)."""
        if batches >= self.batches_per_rank:
            return self.updates
        s, i = self.stretches, self._stretch(batches)
        return s.updates[i] + (batches - s.batches[i]) // s.ks[i]

    def start_of(self, batches: int) -> int:
        """The remaining index where the update after the first `batches` micro-batches (whole updates) starts."""
        s, i = self.stretches, self._stretch(batches)
        W, B = self.layout.world_size, self.layout.batch_size
        return s.starts[i] + (batches - s.batches[i]) // s.ks[i] * W * s.ks[i] * B

    @cached_property
    def tail_batches(self) -> int:
        return -(-self.tail.share // self.layout.batch_size)

    @cached_property
    def batches_per_rank(self) -> int:
        return self.tail.first_batch + self.tail_batches

    @cached_property
    def served(self) -> int:
        """Remaining indices [0, served) are dealt out; [served, remaining) are dropped by policy."""
        return self.tail.start + self.tail.share * self.layout.world_size + self.tail.extra

    @overload
    def _tail_share(self, rank: int) -> int: ...
    @overload
    def _tail_share(self, rank: np.ndarray) -> np.ndarray: ...
    def _tail_share(self, rank: int | np.ndarray) -> int | np.ndarray:
        return self.tail.share + (rank < self.tail.extra)

    def batch_bounds(self, rank: int | np.ndarray, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remaining-index intervals [start, stop) of rank's micro-batches (an int64 array of batch numbers); `rank`
        may be an array of one rank per batch, so that a merge computes every rank's batches in one call."""
        W, B = self.layout.world_size, self.layout.batch_size
        j = np.asarray(batches, dtype=np.int64)
        rank = np.broadcast_to(np.asarray(rank, dtype=np.int64), j.shape)
        s = self.stretches
        if len(s.ks) == 1:
            update, step = np.divmod(j, s.ks[0])
            starts = update * (W * s.ks[0] * B) + step * (W * B) + rank * B
        else:
            i = np.searchsorted(np.array(s.batches), j, side="right") - 1
            k = np.array(s.ks, dtype=np.int64)[i]
            update, step = np.divmod(j - np.array(s.batches, dtype=np.int64)[i], k)
            starts = np.array(s.starts, dtype=np.int64)[i] + update * (W * B) * k + step * (W * B) + rank * B
        stops = starts + B
        in_tail = j >= self.tail.first_batch
        if in_tail.any():
            piece, tail_rank = j[in_tail] - self.tail.first_batch, rank[in_tail]
            share, pieces = self._tail_share(tail_rank), self.tail_batches
            base = self.tail.start + tail_rank * self.tail.share + np.minimum(tail_rank, self.tail.extra)
            starts[in_tail] = base + piece * share // pieces
            stops[in_tail] = base + (piece + 1) * share // pieces
        return starts, stops

    def samples_from(self, rank: int, batch: int) -> int:
        """Samples in rank's micro-batches [batch, batches_per_rank), in closed form (no per-batch arrays): whole
        micro-batches before the tail, then what is left of the rank's tail share."""
        if batch >= self.batches_per_rank:
            return 0
        first, share = self.tail.first_batch, self._tail_share(rank)
        if batch <= first:
            return (first - batch) * self.layout.batch_size + share
        return share - (batch - first) * share // self.tail_batches

    def completed(self, delivered: int) -> int:
        """Micro-batches that belong to whole updates among the first `delivered` ones.

        A half-accumulated update does not count: after a restart it is replayed. The final short update is whole
        once its last micro-batch is delivered."""
        if delivered >= self.batches_per_rank:
            return self.batches_per_rank
        s = self.stretches
        if len(s.ks) == 1:
            return delivered - delivered % s.ks[0]
        i = self._stretch(delivered)
        return delivered - (delivered - s.batches[i]) % s.ks[i]

    def whole(self, counts: np.ndarray) -> np.ndarray:
        """Per count of micro-batches, whether it ends on a whole update (or is the rank's whole share)."""
        s = self.stretches
        i = np.searchsorted(np.array(s.batches), counts, side="right") - 1
        on_update = (counts - np.array(s.batches, dtype=np.int64)[i]) % np.array(s.ks, dtype=np.int64)[i] == 0
        return (counts == self.batches_per_rank) | ((counts < self.batches_per_rank) & on_update)


def plan_at(remaining: int, layout: Layout, schedule: tuple[tuple[int, int], ...] | None, step: int) -> EpochPlan:
    """The plan of `remaining` samples whose first update is optimizer step `step` under a global batch `schedule`
    ((first step, global batch), increasing from step 0; None: the layout's K throughout). Each global batch must be
    a multiple of W*B (ValueError otherwise): K = G / (W*B). Changes past what the epoch can reach are left out, so
    plans of epochs after the schedule's last change are equal."""
    if schedule is None:
        return EpochPlan(remaining, layout)
    per_step = layout.world_size * layout.batch_size
    ks = []
    for first, global_batch in schedule:
        if global_batch % per_step:
            raise ValueError(
                f"the global batch {global_batch} from step {first} is not a multiple of world_size * "
                f"batch_size = {per_step}"
            )
        ks.append(global_batch // per_step)
    at = bisect.bisect_right([first for first, _ in schedule], step) - 1
    changes = tuple(
        (first - step, k) for (first, _), k in zip(schedule[at + 1 :], ks[at + 1 :]) if first - step <= remaining
    )
    return EpochPlan(remaining, replace(layout, grad_accum=ks[at]), changes)


def samples_of_updates(schedule: tuple[tuple[int, int], ...], step: int, updates: int) -> int:
    """Σ G(s) over steps [step, step + updates) of a global batch `schedule` ((first step, global batch),
    increasing from step 0): the remaining samples those updates take, as `plan_at` lays them out (the epoch's end
    aside). O(#changes)."""
    total = 0
    ends = [first for first, _ in schedule[1:]] + [step + updates]
    for (first, global_batch), end in zip(schedule, ends):
        total += global_batch * max(0, min(end, step + updates) - max(first, step))
    return total


def updates_of_samples(schedule: tuple[tuple[int, int], ...], step: int, remaining: int) -> int:
    """The updates from `step` that take `remaining` samples, the last one short where they do not fill it (the
    inverse of `samples_of_updates`, rounded up). O(#changes)."""
    updates, left = 0, remaining
    ends = [first for first, _ in schedule[1:]] + [None]
    for (_, global_batch), end in zip(schedule, ends):
        if end is not None and end <= step + updates:
            continue
        if end is None or left <= global_batch * (end - step - updates):
            return updates - (-left // global_batch)
        left -= global_batch * (end - step - updates)
        updates = end - step
    raise AssertionError("unreachable: the schedule's last global batch runs on")
