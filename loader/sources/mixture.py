"""A weighted mixture of map-style sources as one map-style dataset: position -> (source, index), computed.

Why computed: the loader's exactness at any world size comes from positions, so a mixture that is a pure function
of (seed, position) inherits it whole, and nothing (no sample list of 1e9 entries) is stored or replayed.

Positions fall into windows of M = sum(counts) positions; every window holds exactly counts[s] slots of source s
(counts: the weights apportioned to M by largest remainder, so |counts[s] - w_s * M| < 1, and exactly w_s * M when
the weights are multiples of 1/M, which the default window picks when it can). Inside window k the slots are
arranged by a keyed permutation of range(M) (loader.core.order.window_arrangements, keyed by (seed, k)). The m-th slot of
source s in window k, in position order, is that source's draw j = counts[s] * k + m; draw j is index
Order(len_s, seed_s).for_epoch(j // len_s)(j % len_s) (evaluated for many epochs in one pass with
loader.core.order.epoch_round_keys): a source that runs out continues with its next epoch in a new order, and taking a
source's draws in position order, each run [e * len_s, (e + 1) * len_s) is a permutation.
Numbering draws in position order (not in the permuted order) is what keeps a source epoch that ends inside a
window from lending one of its draws to the next epoch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch
import torch.utils.data

from loader.core.checks import check_num_samples, check_positive_int, is_int
from loader.core.order import ORDER_VERSION, epoch_round_keys, permute, window_arrangements
from loader.core.rows import Rows
from loader.sources.tokens import TokenSource

__all__ = ["MAX_WINDOW", "Mixture", "MixturePlan", "window_counts"]

MAX_WINDOW = 10_000  # the default window is the smallest M <= this that represents every weight exactly
LARGEST_WINDOW = 1 << 20  # a window's slot table is O(M) per process
BLOCK = 2048  # positions mapped per vectorised call when access is sequential (the usual shuffle=False case): a
# block costs ~50 numpy calls, and its temporaries stay within 1 MB
PLAN_KIND, PLAN_VERSION = "loader.MixturePlan", 1
_EXACT = 1e-6  # a weight times M within this of an integer counts as exact (weights written with 6 decimals)


def window_counts(weights: Sequence[float], window: int | None = None) -> tuple[int, ...]:
    """Slots of each source per window: the normalised weights times M, rounded by largest remainder (ties to the
    earlier source), so each count is within one of w * M and they sum to M. Without `window`, M is the smallest
    size up to MAX_WINDOW at which every w * M is a whole number, else MAX_WINDOW."""
    w = np.asarray(weights, dtype=float)
    if w.ndim != 1 or not len(w) or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"weights must be positive finite numbers, one per source, got {list(weights)!r}")
    w = w / w.sum()
    if window is None:
        sizes = np.arange(1, MAX_WINDOW + 1)[:, None] * w
        exact = np.nonzero((np.abs(sizes - np.round(sizes)) <= _EXACT).all(axis=1))[0]
        window = int(exact[0]) + 1 if len(exact) else MAX_WINDOW
    check_positive_int("window", window)
    if window > LARGEST_WINDOW:
        raise ValueError(f"window={window}: each process builds a window's slot table, O(window) memory; pass a "
                         f"window of at most {LARGEST_WINDOW}")
    ideal = w * window
    counts = np.floor(ideal).astype(np.int64)
    counts[np.argsort(counts - ideal, kind="stable")[: window - int(counts.sum())]] += 1
    return tuple(int(c) for c in counts)


def _source_seed(seed: int, name: str) -> int:
    """Each source's own order seed, from the mixture seed and the source's name (not its place in the list)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class MixturePlan:
    """The arithmetic of a mixture, without its data: which (source, index) sits at each position. Enough to
    audit a run by source (`python -m loader audit RUN_DIR --mixture PLAN.json`); `save`/`load` as JSON."""

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    num_samples: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        sources = len(self.names)
        if not sources or len(set(self.names)) != sources or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"names must be distinct non-empty strings, one per source, got {list(self.names)!r}")
        for field, values in (("lengths", self.lengths), ("counts", self.counts)):
            if len(values) != sources:
                raise ValueError(f"{field}: {len(values)} values for {sources} sources")
            for name, value in zip(self.names, values):
                if not is_int(value) or value <= 0:
                    what = "is empty" if field == "lengths" else "has no slot in a window: raise its weight or window="
                    raise ValueError(f"source {name!r} {what} ({field} {value!r})")
        check_num_samples("num_samples", self.num_samples, least=1)
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def window(self) -> int:
        return sum(self.counts)

    @functools.cached_property
    def _bounds(self) -> np.ndarray:
        """Slot values [bounds[s], bounds[s + 1]) of a window's permutation belong to source s."""
        return np.concatenate(([0], np.cumsum(self.counts))).astype(np.int64)

    @functools.cached_property
    def _source_seeds(self) -> np.ndarray:
        return np.array([_source_seed(self.seed, name) for name in self.names], dtype=np.uint64)

    def _slot_tables(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each window (rows) and slot (columns): its source, and its rank among that source's slots of the
        window in position order. O(M) per window, all windows in one vectorised pass."""
        m = self.window
        source = np.searchsorted(self._bounds, window_arrangements(self.seed, windows, m), side="right") - 1
        by_source = np.argsort(source, axis=1, kind="stable")  # each source's slots, in position order
        rank = np.empty_like(by_source)
        first_of = self._bounds[np.take_along_axis(source, by_source, axis=1)]  # where each source's group starts
        np.put_along_axis(rank, by_source, np.arange(m) - first_of, axis=1)
        return source, rank

    def _slots(self, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(window, source, rank among the source's slots of the window) at each position."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            bad = positions[(positions < 0) | (positions >= self.num_samples)][0]
            raise IndexError(f"mixture position {bad} out of range for {self.num_samples} positions")
        windows, slot = np.divmod(positions, self.window)
        distinct, row = np.unique(windows, return_inverse=True)
        sources, ranks = self._slot_tables(distinct)
        return windows, sources[row, slot], ranks[row, slot]

    def source_of(self, positions) -> np.ndarray:
        """The source number at each position."""
        return self._slots(positions)[1]

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(source number, index within that source) at each position: a pure function of (plan, position)."""
        windows, source, rank = self._slots(positions)
        draw = np.asarray(self.counts)[source] * windows + rank
        length = np.asarray(self.lengths)[source]
        epoch, at = np.divmod(draw, length)
        if not self.shuffle:
            return source, at
        n = len(self.names)  # a block draws from few (source, epoch) pairs: keys once per pair
        pairs, pair = np.unique(epoch * n + source, return_inverse=True)
        keys = epoch_round_keys(self._source_seeds[pairs % n], pairs // n)
        return source, permute(at, length, keys[:, pair]).astype(np.int64)

    def samples_per_source(self) -> tuple[int, ...]:
        """Positions of each source in [0, num_samples): the whole windows' counts plus the last window's part."""
        whole, rest = divmod(self.num_samples, self.window)
        tail = np.bincount(self._slot_tables(np.array([whole]))[0][0, :rest], minlength=len(self.names))
        return tuple(int(c) * whole + int(t) for c, t in zip(self.counts, tail))

    def to_dict(self) -> dict:
        return {"kind": PLAN_KIND, "version": PLAN_VERSION, "order_version": ORDER_VERSION,
                "names": list(self.names), "lengths": list(self.lengths), "counts": list(self.counts),
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle}

    @classmethod
    def from_dict(cls, data: dict, where: str = "mixture plan") -> MixturePlan:
        expected = (PLAN_KIND, PLAN_VERSION, ORDER_VERSION)
        found = tuple(data.get(k) for k in ("kind", "version", "order_version"))
        if found != expected:
            raise ValueError(f"{where}: (kind, version, order_version) is {found}, this loader reads {expected}: "
                             "save the plan again with this version (Mixture.plan.save)")
        try:
            return cls(tuple(data["names"]), tuple(data["lengths"]), tuple(data["counts"]), data["num_samples"],
                       data["seed"], data["shuffle"])
        except KeyError as err:
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


def _fetch(source, indices: list[int]) -> list:
    """A source's samples at these indices, in one call when it takes batches (TokenSource, HF datasets)."""
    getitems = getattr(source, "__getitems__", None)
    return getitems(indices) if getitems else [source[i] for i in indices]


def _token_span(sources: Sequence[Any]) -> int | None:
    """seq_len + 1 when every source is a TokenSource (its own __getitems__) of plain samples, all of one seq_len:
    a batch of the mixture is then one int64 array that each source fills in place (`TokenSource._fill`). Else
    None: the samples are whatever the sources return, fetched per source and put back in position order."""
    tokens = [s for s in sources if isinstance(s, TokenSource) and type(s).__getitems__ is TokenSource.__getitems__
              and s.plain]
    if len(tokens) == len(sources) and len({s.seq_len for s in tokens}) == 1:
        return tokens[0].seq_len + 1
    return None


def _source_fingerprint(source) -> str | None:
    """A source's own digest when it has one (`fingerprint()`; Hugging Face datasets keep `_fingerprint`)."""
    fingerprint = getattr(source, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else getattr(source, "_fingerprint", None)


class Mixture(torch.utils.data.Dataset):
    """`num_samples` positions drawn from `sources` in the proportions `weights`, exactly per window of
    `mix.window` positions, each position a pure function of (seed, position) -> (source, index). The mixture
    already interleaves: run it with shuffle=False (a loader shuffle permutes positions, the composition of every
    window then no longer shows in the batches).

    Args:
        sources: map-style datasets (TokenSource, WebDatasetSource, Hugging Face `datasets.Dataset`, ...).
        weights: relative weights, one per source (normalised; realised as `counts` / `window`).
        num_samples: positions in the mixture: the training budget in samples. A source whose epoch is used up
            continues with its next epoch in a new order.
        seed: keys the arrangement inside each window and every source's order.
        names: one per source, the identity the audit reports (default "source-0", "source-1", ...).
        window: M, the positions per window; default: the smallest M <= MAX_WINDOW that holds every weight exactly.
        shuffle: each source epoch in a keyed order (True) or in index order (False).
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        num_samples: int,
        seed: int = 0,
        *,
        names: Sequence[str] | None = None,
        window: int | None = None,
        shuffle: bool = True,
    ) -> None:
        self.sources = list(sources)
        if len(weights) != len(self.sources):
            raise ValueError(f"{len(weights)} weights for {len(self.sources)} sources: pass one weight per source")
        names = tuple(names) if names is not None else tuple(f"source-{s}" for s in range(len(self.sources)))
        self.plan = MixturePlan(names, tuple(len(s) for s in self.sources), window_counts(weights, window),
                                num_samples, seed, bool(shuffle))
        self._block = -(-BLOCK // self.plan.window) * self.plan.window  # whole windows
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
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

    def _block_table(self, block: int) -> np.ndarray:
        """Rows (source, index) of a whole block of positions, kept for the next batches (two blocks per process):
        one array, so that a batch is looked up by one fancy index."""
        if block not in self._cache:
            low = block * self._block
            self._cache[block] = np.stack(self.plan.locate(np.arange(low, min(low + self._block, len(self)))))
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return self._cache[block]

    def locate(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(source number, index within it) per position: `plan.locate`, through a per-process cache of the last
        blocks when positions come in order (shuffle=False at any world size), where a batch then costs a lookup."""
        if not len(positions):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        low, high = min(positions), max(positions)
        first, last = low // self._block, high // self._block
        if last - first > 1 or low < 0 or high >= self.plan.num_samples:
            return self.plan.locate(positions)
        table, origin = self._block_table(first), first * self._block
        if last != first:
            table = np.concatenate((table, self._block_table(last)), axis=1)
        # column c is position origin + c (not take(mode="wrap"): numpy wraps an index by repeated subtraction,
        # O(position / block) per position)
        source, index = table.take(np.subtract(positions, origin), axis=1)
        return source, index

    def _by_source(self, source: np.ndarray, index: np.ndarray):
        """Each source's share of a batch: (source number, its rows in the batch, its indices), in position order."""
        by_source = source.argsort(kind="stable")
        ends = accumulate(np.bincount(source, minlength=len(self.sources)).tolist())
        rows, indices = by_source.tolist(), index[by_source].tolist()
        low = 0
        for s, high in enumerate(ends):
            if low < high:
                yield s, rows[low:high], indices[low:high]
            low = high

    def __getitems__(self, positions: Sequence[int]) -> list:
        """A batch: each source asked once, for its share. TokenSources of plain samples and one seq_len fill
        their rows of one int64 array in place, returned as its `Rows` (which the loader's collate hands on as
        that array: no per-source allocation, no reordering, no stacking); other sources are asked in one call
        when they take batches, and their samples put back in position order."""
        source, index = self.locate(positions)
        if self._span is not None:
            out = np.empty((len(source), self._span), dtype=np.int64)
            for s, rows, indices in self._by_source(source, index):
                self.sources[s]._fill(out, rows, indices)
            return Rows(torch.from_numpy(out))
        seeds = len(positions) and hasattr(positions[0], "seed")  # the loader's sample_seeds
        out: list = [None] * len(source)
        for s, rows, indices in self._by_source(source, index):
            if seeds:  # a source index carries its position's seed
                indices = list(map(type(positions[0]), indices, (positions[r].seed for r in rows)))
            for row, sample in zip(rows, _fetch(self.sources[s], indices)):
                out[row] = sample
        return out

    def __getitem__(self, position: int):
        return self.__getitems__([position])[0]

    def sample_key(self, position: int) -> tuple[str, int]:
        """(source name, index within the source): the identity of the sample at `position`."""
        (source,), (index,) = self.locate([position])
        return self.names[source], int(index)

    def fingerprint(self) -> str:
        """Digest of the plan and of the sources' own fingerprints, for the checkpoint manifest."""
        layout = {"plan": self.plan.to_dict(), "sources": [_source_fingerprint(s) for s in self.sources]}
        return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": OrderedDict()}

    def __repr__(self) -> str:
        shares = ", ".join(f"{n}: {c}/{self.window}" for n, c in zip(self.names, self.counts))
        return f"Mixture({len(self)} positions; {shares} per window; fingerprint={self.fingerprint()})"
