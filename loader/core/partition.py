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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

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


@dataclass(frozen=True)
class EpochPlan:
    """The partition of `remaining` samples under a layout; identical on every rank. Its sizes are computed once:
    the loader asks for them at every delivered batch."""

    remaining: int
    layout: Layout

    @cached_property
    def full_updates(self) -> int:
        return self.remaining // self.layout.global_batch

    @cached_property
    def tail(self) -> Tail:
        """The module docstring's cases; empty (share 0) when nothing follows the full updates: drop_last, no
        leftover, or R < W."""
        W, K, B, G = self.layout.world_size, self.layout.grad_accum, self.layout.batch_size, self.layout.global_batch
        full = self.full_updates
        leftover = self.remaining - full * G
        if self.layout.drop_last or leftover == 0 or self.remaining < W:
            return Tail(full * K, full * G, 0, 0)
        if leftover < W:
            return Tail(full * K - 1, full * G - W * B, B, leftover)
        return Tail(full * K, full * G, leftover // W, leftover % W)

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

    def _tail_share(self, rank: int) -> int:
        return self.tail.share + (rank < self.tail.extra)

    def batch_bounds(self, rank: int | np.ndarray, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remaining-index intervals [start, stop) of rank's micro-batches (an int64 array of batch numbers); `rank`
        may be an array of one rank per batch, so that a merge computes every rank's batches in one call."""
        W, K, B = self.layout.world_size, self.layout.grad_accum, self.layout.batch_size
        j = np.asarray(batches, dtype=np.int64)
        rank = np.broadcast_to(np.asarray(rank, dtype=np.int64), j.shape)
        update, step = np.divmod(j, K)
        starts = update * self.layout.global_batch + step * (W * B) + rank * B
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
        return delivered - delivered % self.layout.grad_accum
