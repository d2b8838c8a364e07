"""Committed progress inside one epoch: a set of positions kept as sorted, disjoint half-open intervals.

Why intervals of *positions*: ranks that advance in lockstep always commit a prefix [0, p) of the epoch's order,
one interval however far training got; ranks that advance unevenly leave holes, and the set grows with the
number of holes only, never with N. The positions not yet committed, in increasing order, are the *remaining*
ones; index j into them is a remaining index, which is what the partition deals out to ranks.

Intervals are int64 arrays of shape (k, 2); all functions here are pure.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

EMPTY = np.zeros((0, 2), dtype=np.int64)


def normalize(intervals: ArrayLike) -> np.ndarray:
    """Sort, drop empty intervals and merge overlapping or touching ones."""
    spans = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
    spans = spans[spans[:, 1] > spans[:, 0]]
    if len(spans) < 2:
        return spans.copy()
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    reach = np.maximum.accumulate(spans[:, 1])
    starts_new = np.concatenate(([True], spans[1:, 0] > reach[:-1]))
    group_end = np.concatenate((np.nonzero(starts_new)[0][1:], [len(spans)])) - 1
    return np.stack((spans[starts_new, 0], reach[group_end]), axis=1)


def whole(n: int) -> np.ndarray:
    """Every position of an epoch of n samples."""
    return np.array([[0, n]], dtype=np.int64) if n > 0 else EMPTY


def union(*interval_sets: ArrayLike) -> np.ndarray:
    return normalize(np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1, 2) for s in interval_sets]))


def total(intervals: np.ndarray) -> int:
    return int((intervals[:, 1] - intervals[:, 0]).sum())


def complement(intervals: np.ndarray, n: int) -> np.ndarray:
    """[0, n) minus a normalized interval set."""
    starts = np.concatenate(([0], intervals[:, 1]))
    stops = np.concatenate((intervals[:, 0], [n]))
    return normalize(np.stack((starts, stops), axis=1))


def difference(intervals: np.ndarray, other: np.ndarray, n: int) -> np.ndarray:
    """A normalized interval set inside [0, n) minus another."""
    return complement(union(complement(intervals, n), other), n)


def contains(intervals: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Per position, whether a normalized interval set holds it: a binary search each, O(log #intervals)."""
    after = np.searchsorted(intervals[:, 1], positions, side="right")  # the first interval ending after it
    inside = after < len(intervals)
    inside[inside] = positions[inside] >= intervals[after[inside], 0]
    return inside


def spans_of(positions: ArrayLike) -> np.ndarray:
    """Positions as intervals: a range of step 1 in O(1) (range(0, 10**12) is one interval), else any integers."""
    if isinstance(positions, range) and positions.step == 1:
        return normalize([[positions.start, positions.stop]])
    values = np.unique(np.asarray(positions, dtype=np.int64).reshape(-1))
    if not len(values):
        return EMPTY
    cuts = np.nonzero(np.diff(values) != 1)[0] + 1
    starts = values[np.concatenate(([0], cuts))]
    stops = values[np.concatenate((cuts - 1, [len(values) - 1]))] + 1
    return np.stack((starts, stops), axis=1)


class Remaining:
    """The positions of an epoch that are not committed, addressed by remaining index j = 0, 1, ...

    Built in O(#intervals); maps a remaining index to its position by a binary search over the prefix sums of the
    gaps between committed intervals (no search at all when nothing inside the epoch is committed)."""

    def __init__(self, committed: np.ndarray, num_samples: int):
        gaps = complement(committed, num_samples)
        self._gap_starts = gaps[:, 0]
        self._offsets = np.concatenate(([0], np.cumsum(gaps[:, 1] - gaps[:, 0])))
        self.count = int(self._offsets[-1])

    def positions(self, j: np.ndarray) -> np.ndarray:
        j = np.asarray(j, dtype=np.int64)
        if len(self._gap_starts) == 1:
            return j + self._gap_starts[0]
        gap = np.searchsorted(self._offsets, j, side="right") - 1
        return self._gap_starts[gap] + (j - self._offsets[gap])

    def covering_spans(self, spans: np.ndarray | list[list[int]]) -> np.ndarray:
        """Position intervals [pos(a), pos(b - 1) + 1) for remaining-index intervals [a, b).

        They also cover committed positions lying between pos(a) and pos(b - 1), so the result is exact only
        after a union with the committed set, which is how it is used: committed ∪ covering == committed ∪ image."""
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        spans = spans[spans[:, 1] > spans[:, 0]]
        return np.stack((self.positions(spans[:, 0]), self.positions(spans[:, 1] - 1) + 1), axis=1)
