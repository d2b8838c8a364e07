"""How an epoch's remaining samples are dealt out to ranks, micro-batches and optimizer updates.

With world size W, accumulation K, micro-batch B and global batch G = W*K*B, rank r's micro-batch j = g*K + m
(update g, micro-step m) covers remaining indices [g*G + m*W*B + r*B, ... + B). Hence:
- update g always covers remaining indices [g*G, (g+1)*G), whatever W, K and B are: with G unchanged, a resize
  does not change which samples form a global step;
- the ranks' slices are disjoint and cover everything served: exactly once by construction.

The tail R mod G: with drop_last it is dropped by policy. Otherwise the largest multiple of W in it is split
evenly, each rank's share into ceil(share / B) near-equal micro-batches, so every rank yields the same number of
micro-batches (DDP never waits on a missing one) and none is empty; the last R mod W samples (fewer than W)
are dropped by policy, as DistributedSampler(drop_last=True) does. With W = 1 nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from loader._checks import check_positive_int


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
    def tail_share(self) -> int:
        """Samples each rank gets in the final, short update (0 with drop_last)."""
        if self.layout.drop_last:
            return 0
        return (self.remaining - self.full_updates * self.layout.global_batch) // self.layout.world_size

    @cached_property
    def tail_batches(self) -> int:
        return -(-self.tail_share // self.layout.batch_size)

    @cached_property
    def batches_per_rank(self) -> int:
        return self.full_updates * self.layout.grad_accum + self.tail_batches

    @cached_property
    def served(self) -> int:
        """Remaining indices [0, served) are dealt out; [served, remaining) are dropped by policy."""
        return self.full_updates * self.layout.global_batch + self.tail_share * self.layout.world_size

    def batch_bounds(self, rank: int, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remaining-index intervals [start, stop) of rank's micro-batches (an int64 array of batch numbers)."""
        W, K, B = self.layout.world_size, self.layout.grad_accum, self.layout.batch_size
        j = np.asarray(batches, dtype=np.int64)
        update, step = np.divmod(j, K)
        starts = update * self.layout.global_batch + step * (W * B) + rank * B
        stops = starts + B
        in_tail = j >= self.full_updates * K
        if in_tail.any():
            piece = j[in_tail] - self.full_updates * K
            share, pieces = self.tail_share, self.tail_batches
            base = self.full_updates * self.layout.global_batch + rank * share
            starts[in_tail] = base + piece * share // pieces
            stops[in_tail] = base + (piece + 1) * share // pieces
        return starts, stops

    def samples_from(self, batch: int) -> int:
        """Samples in each rank's micro-batches [batch, batches_per_rank), in closed form (no per-batch arrays):
        whole micro-batches of the full updates, then what is left of the tail share."""
        if batch >= self.batches_per_rank:
            return 0
        full_batches = self.full_updates * self.layout.grad_accum
        if batch <= full_batches:
            return (full_batches - batch) * self.layout.batch_size + self.tail_share
        return self.tail_share - (batch - full_batches) * self.tail_share // self.tail_batches

    def completed(self, delivered: int) -> int:
        """Micro-batches that belong to whole updates among the first `delivered` ones.

        A half-accumulated update does not count: after a restart it is replayed. The final short update is whole
        once its last micro-batch is delivered."""
        if delivered >= self.batches_per_rank:
            return self.batches_per_rank
        return delivered - delivered % self.layout.grad_accum
