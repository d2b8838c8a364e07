"""The order of an epoch: position -> dataset index, as a pure function of (seed, epoch, position).

Why a keyed bijection instead of a stored permutation: resuming at position 5e8 of a 1e9-sample epoch must
cost O(1) time and memory, and every rank must agree on the order without exchanging it. A Feistel network over
Z_a x Z_b (a close to sqrt(N), b = ceil(N / a), a chosen so that a*b - N is as small as it gets), with cycle
walking back into [0, N), gives exactly that: a permutation of range(N) evaluated independently at each position,
vectorised over numpy uint64 arrays. A power-of-two domain would be up to twice N (four times for equal halves),
and each extra cycle-walking pass is a full set of numpy calls; here almost no value walks at all.

The same keyed mixer derives per-sample seeds, so augmentations depend on (seed, epoch, index) only, never on
which rank or worker loads a sample.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from loader.core.checks import check_num_samples, check_positive_int
from loader.core.progress import contains

ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_SALT_ORDER = 0x6F72646572  # distinct key streams for the order, the blocks and the sample seeds
_SALT_BLOCKS = 0x626C6F636B73
_SALT_SAMPLE = 0x73616D706C65
_SALT_WINDOWS = 0x77696E646F7773
_SALT_WORKERS = 0x776F726B657273

SHUFFLE_MODES = ("none", "global", "blocks", "self")  # "self": the identity, the dataset orders itself
IDENTITY = ("none", "self")  # the orders that leave every position where it is
SCAN = 1 << 16  # positions mapped per step of `EpochOrder.last_index`: its memory stays bounded at any N
ORDER_VERSION = 2  # bumped whenever the same (seed, epoch, position) would give another index: saved positions
# mean the same samples only under the version that saved them (1: halves of ceil(sqrt N); 2: best-fitting halves)


def _mix_in_place(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser without its last xor-shift, on a uint64 array the caller owns. That last
    step leaves the top 32 bits as they are, so the Feistel rounds, which keep only those, skip it."""
    x ^= x >> np.uint64(33)
    x *= _MIX_1
    x ^= x >> np.uint64(33)
    x *= _MIX_2
    return x


def _fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: a cheap bijective mixer with full avalanche."""
    x = _mix_in_place(np.array(x, dtype=np.uint64))
    return x ^ (x >> np.uint64(33))


def _u64(values: ArrayLike) -> np.ndarray:
    """Python ints of any sign and size, reduced modulo 2**64, as a uint64 array."""
    return np.asarray(np.asarray(values, dtype=object) % (1 << 64), dtype=np.uint64)


def _stream_key(seed: int, epoch: int, salt: int) -> np.uint64:
    """One 64-bit key per (seed, epoch, purpose); distinct inputs give independent-looking keys."""
    with np.errstate(over="ignore"):
        key = _fmix64(_u64([seed]) ^ _u64([salt]))
        key = _fmix64(key ^ _fmix64(_u64([epoch]) + _GOLDEN))
    return key[0]


def _round_keys(stream_key: np.ndarray | np.uint64) -> np.ndarray:
    """Keys of shape (ROUNDS, *stream_key.shape): a splitmix64 sequence per stream key."""
    steps = np.arange(1, ROUNDS + 1, dtype=np.uint64).reshape((ROUNDS,) + (1,) * np.ndim(stream_key))
    with np.errstate(over="ignore"):
        return _fmix64(np.asarray(stream_key, dtype=np.uint64) + steps * _GOLDEN)


HALVES_SEARCH = 4096  # at most this many widths tried per domain size (once: the result is cached)


@functools.lru_cache(maxsize=4096)
def _halves(n: int) -> tuple[int, int]:
    """The Feistel halves' sizes (a, b) for a domain of size n: b = ceil(n / a) with a in [s, s + s/4] (s =
    ceil(sqrt(n))) chosen so that a*b - n, the values that must cycle-walk, is as small as it gets (often zero).
    Each walk is another full set of numpy calls, so an exact fit saves more than perfectly equal halves would
    give; the halves stay within a factor of about 1.6 of each other."""
    if n <= 1:
        return 1, 1
    smallest = math.isqrt(n - 1) + 1
    widths = np.arange(smallest, smallest + min(smallest // 4, HALVES_SEARCH) + 1, dtype=np.uint64)
    heights = (np.uint64(n) + widths - np.uint64(1)) // widths
    best = int(np.argmin(widths * heights))  # the first minimum: the most balanced of the best fits
    return int(widths[best]), int(heights[best])


def _split_domain(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_halves` as uint64: scalars for one n; per element for an array of sizes (looked up for the distinct sizes
    only: a few block sizes per batch)."""
    if np.ndim(n) == 0:
        a, b = _halves(int(n))
        return np.uint64(a), np.uint64(b)
    sizes, where = np.unique(n, return_inverse=True)
    a, b = np.array([_halves(size) for size in sizes.tolist()], dtype=np.uint64).reshape(-1, 2).T
    return a[where.reshape(np.shape(n))], b[where.reshape(np.shape(n))]


def _add_keyed_hash(
    value: np.ndarray, other: np.ndarray, key: np.uint64, modulus: np.ndarray | np.uint64, subtract: bool = False
) -> np.ndarray:
    """value := (value + a keyed hash of `other` in [0, modulus)) mod modulus, in place, for value < modulus < 2**32
    (`subtract`: value - the hash, the inverse, by adding modulus - hash).

    The hash's top 32 bits are scaled by the modulus (no division); the sum is then reduced by one subtraction,
    kept only where it did not wrap below zero (unsigned: the smaller of the two). Each step is one numpy pass
    over arrays this round owns."""
    hashed = _mix_in_place(other ^ key)
    hashed >>= np.uint64(32)
    hashed *= modulus
    hashed >>= np.uint64(32)
    if subtract:
        np.subtract(modulus, hashed, out=hashed)
    value += hashed
    np.minimum(value, value - modulus, out=value)
    return value


def _feistel(
    x: np.ndarray, a: np.ndarray | np.uint64, b: np.ndarray | np.uint64, keys: np.ndarray, inverse: bool = False
) -> np.ndarray:
    """One pass of an alternating Feistel network over Z_a x Z_b: a bijection of [0, a*b).

    Even rounds add a keyed hash of the right half to the left one (mod a), odd rounds the other way (mod b): each
    round is invertible whatever a and b are (`inverse`: the rounds in reverse, each subtracting)."""
    left = x // b
    right = x - left * b
    rounds = list(enumerate(keys))
    with np.errstate(over="ignore"):
        for round_number, key in reversed(rounds) if inverse else rounds:
            if round_number % 2 == 0:
                _add_keyed_hash(left, right, key, a, inverse)
            else:
                _add_keyed_hash(right, left, key, b, inverse)
    left *= b
    left += right
    return left


def permute(x: np.ndarray, n: ArrayLike, keys: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Keyed permutation of range(n) applied to the 1-D array x (all x < n); `inverse`: its inverse permutation.

    One permutation: keys of shape (ROUNDS,). One per element: keys of shape (ROUNDS, len(x)), with n an int (all
    domains alike) or an array (one size per element). Cycle walking maps values that land outside [0, n) again
    until they are inside; the walk ends because x itself lies on its own cycle (walked backwards, the inverse
    finds the value whose forward walk lands on x)."""
    x = np.asarray(x, dtype=np.uint64)
    n = np.asarray(n, dtype=np.uint64)
    a, b = _split_domain(n)
    out = _feistel(x, a, b, keys, inverse)
    outside = np.nonzero(out >= n)[0]
    while outside.size:
        a_o, b_o, n_o = (a[outside], b[outside], n[outside]) if n.ndim else (a, b, n)
        walked = _feistel(out[outside], a_o, b_o, keys[:, outside] if keys.ndim == 2 else keys, inverse)
        out[outside] = walked
        outside = outside[walked >= n_o]
    return out


@functools.lru_cache(maxsize=64)
def _windows_key(seed: int) -> np.uint64:
    return _stream_key(seed, 0, _SALT_WINDOWS)


def window_arrangements(seed: int, windows: np.ndarray, size: int) -> np.ndarray:
    """Row r: window windows[r]'s own keyed permutation of range(size), at every offset; shape (len(windows), size).

    Why: a mixture arranges the slots of each window of its positions in a keyed order; all the windows of a block
    in one vectorised pass cost ~100 ns a slot, where an EpochOrder per window would cost ~10 us each."""
    with np.errstate(over="ignore"):
        keys = _round_keys(_fmix64(np.asarray(windows).astype(np.uint64) ^ _windows_key(seed)))
    offsets = np.tile(np.arange(size, dtype=np.uint64), len(windows))
    return permute(offsets, size, np.repeat(keys, size, axis=1)).astype(np.int64).reshape(len(windows), size)


def epoch_round_keys(seeds: np.ndarray, epochs: np.ndarray) -> np.ndarray:
    """The round keys of `Order(n, seed, "global").for_epoch(epoch)` for 1-D arrays of (seed, epoch) pairs, shape
    (ROUNDS, len): with `permute` (keys per element) they evaluate many epochs' orders in one pass, as a batch of
    mixture positions needs. Seeds and epochs are non-negative."""
    with np.errstate(over="ignore"):
        key = _fmix64(np.asarray(seeds, dtype=np.uint64) ^ np.uint64(_SALT_ORDER))
        key = _fmix64(key ^ _fmix64(np.asarray(epochs, dtype=np.uint64) + _GOLDEN))
    return _round_keys(key)


def sample_seed(seed: int, epoch: int, index: ArrayLike) -> np.ndarray | int:
    """A 63-bit seed for one sample's randomness, from (seed, epoch, dataset index) only.

    Vectorised: pass an array of indices to get an array of seeds; an int gives an int."""
    key = _stream_key(seed, epoch, _SALT_SAMPLE)
    with np.errstate(over="ignore"):
        mixed = _fmix64(_u64(index) ^ key) >> np.uint64(1)
    return int(mixed) if np.ndim(index) == 0 else mixed.astype(np.int64)


def worker_seed(seed: int, epoch: int, rank: int, start: int) -> int:
    """A 63-bit base seed for the worker processes of a pass (torch seeds worker w with base + w), from (seed, epoch,
    data-parallel rank, the micro-batch the pass starts at) only: the peers of a data-parallel rank (tensor,
    pipeline parallel) seed their workers alike whatever their own generators hold, and every pass differently."""
    key = _stream_key(seed, epoch, _SALT_WORKERS)
    with np.errstate(over="ignore"):
        return int(_fmix64(_fmix64(_u64([rank]) ^ key) ^ _u64([start]))[0] >> np.uint64(1))


def block_sizes_for_window(num_samples: int, window: int) -> list[int]:
    """Blocks of `window` consecutive indices (the last one shorter) for block-local shuffling."""
    check_positive_int("shuffle_blocks (a window)", window)
    full, rest = divmod(num_samples, window)
    return [window] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Lanes:
    """Splits an order into `count` lanes read side by side, so that each rank reads from one lane only.

    Why: with block shuffling every global batch comes from one or two blocks (shards), dealt across all ranks, so
    every node reads every shard. Here lane l is the l-th of `count` near-equal contiguous parts of the order
    (of the shuffled blocks: about 1/count of the shards), and positions take `chunk` samples from each lane in
    turn: position p is sample (p // chunk // count) * chunk + p % chunk of lane (p // chunk) % count. With chunk =
    the micro-batch size B, rank r's micro-batch of micro-step s covers chunk s*W + r (`loader.core.partition`), of
    lane (s*W + r) mod count: when the world size W divides count, rank r reads lanes r, r + W, r + 2W, ... only,
    so each rank, and each node, reads its own count/W lanes' shards. Set count to the largest world size the job
    runs at (a multiple of every one it runs at); at other sizes every rank reads every lane, exactly once all the
    same. After the full rounds, the lanes' last partial chunks follow one another. A bijection of range(n)."""

    count: int
    chunk: int

    def __post_init__(self) -> None:
        check_positive_int("lanes", self.count)
        check_positive_int("lane_chunk", self.chunk)

    def inner(self, positions: np.ndarray, n: int) -> np.ndarray:
        """The positions of the order without lanes that `positions` (int64, all < n) stand for."""
        size, longer = divmod(n, self.count)
        rounds = size // self.chunk  # every lane has at least this many whole chunks
        in_rounds = rounds * self.count * self.chunk
        quotient, offset = np.divmod(positions, self.chunk)
        round_number, lane = np.divmod(quotient, self.count)
        inner = self._lane_start(lane, size, longer) + round_number * self.chunk + offset
        late = positions >= in_rounds
        if late.any():  # lane l's rest (size - rounds*chunk, one more for l < longer) follows lane l-1's
            rest = positions[late] - in_rounds
            each = size - rounds * self.chunk
            starts = self._lane_start(np.arange(self.count + 1), each, longer)
            lane = np.searchsorted(starts, rest, side="right") - 1
            inner[late] = self._lane_start(lane, size, longer) + rounds * self.chunk + rest - starts[lane]
        return inner

    def outer(self, inner: np.ndarray, n: int) -> np.ndarray:
        """The positions that stand for `inner` (int64 positions of the order without lanes, all < n): the inverse
        of `inner`."""
        size, longer = divmod(n, self.count)
        rounds = size // self.chunk
        lane = np.searchsorted(self._lane_start(np.arange(self.count + 1), size, longer), inner, side="right") - 1
        offset = inner - self._lane_start(lane, size, longer)
        round_number, within = np.divmod(offset, self.chunk)
        positions = (round_number * self.count + lane) * self.chunk + within
        late = round_number >= rounds
        if late.any():  # in lane l's rest, which follows lane l-1's after the full rounds
            each, rest = size - rounds * self.chunk, offset[late] - rounds * self.chunk
            positions[late] = rounds * self.count * self.chunk + self._lane_start(lane[late], each, longer) + rest
        return positions

    @staticmethod
    def _lane_start(lane: np.ndarray, size: int, longer: int) -> np.ndarray:
        """Where lane `lane` starts when lanes hold `size` samples and the first `longer` ones one more."""
        return lane * size + np.minimum(lane, longer)


@dataclass(frozen=True)
class Order:
    """Which dataset index sits at each position of an epoch.

    shuffle="none" is the identity; "self" too, for a dataset that orders itself (a Mixture under shuffle=True,
    whose every epoch is fresh: a distinct mode, so that a progress saved under a shuffled order is refused);
    "global" permutes all of range(N); "blocks" permutes the blocks (e.g. shards), then the positions inside each
    block, so a reader visits one block at a time and reads it sequentially-ish.
    `lanes` (optional) then interleaves contiguous parts of that order so that each rank reads one part.
    """

    num_samples: int
    seed: int = 0
    shuffle: str = "global"
    block_sizes: tuple[int, ...] | None = None
    lanes: Lanes | None = None
    _block_starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_num_samples("num_samples (the dataset's length)", self.num_samples)
        if self.shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, got {self.shuffle!r}")
        if (self.shuffle == "blocks") != (self.block_sizes is not None):
            raise ValueError('block_sizes are needed exactly when shuffle="blocks"')
        if self.block_sizes is not None:
            sizes = np.asarray(self.block_sizes, dtype=np.int64)
            if sizes.ndim != 1 or (sizes < 0).any() or int(sizes.sum()) != self.num_samples:
                raise ValueError(
                    f"shuffle_blocks: block sizes must be non-negative and sum to the dataset length "
                    f"{self.num_samples}, got {len(sizes)} blocks summing to {int(sizes.sum())}"
                )
            object.__setattr__(self, "_block_starts", np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64))

    def fingerprint(self) -> dict:
        """What must match between a saved progress and the current run for positions to mean the same ids."""
        blocks = None
        if self.block_sizes is not None:
            digest = hashlib.sha256(np.asarray(self.block_sizes, dtype="<i8").tobytes()).hexdigest()[:16]
            blocks = f"{len(self.block_sizes)}:{digest}"
        lanes = None if self.lanes is None else [self.lanes.count, self.lanes.chunk]
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "blocks": blocks,
            "order_version": ORDER_VERSION,
            "lanes": lanes,
        }

    def for_epoch(self, epoch: int) -> EpochOrder:
        return EpochOrder(self, epoch)


class EpochOrder:
    """An Order bound to one epoch, with that epoch's keys (and block layout) computed once: O(#blocks)."""

    def __init__(self, order: Order, epoch: int):
        self.order = order
        self.epoch = epoch
        if order.shuffle == "global":
            self._keys = _round_keys(_stream_key(order.seed, epoch, _SALT_ORDER))
        elif order.shuffle == "blocks":
            sizes = np.asarray(order.block_sizes, dtype=np.int64)
            block_key = _stream_key(order.seed, epoch, _SALT_BLOCKS)
            self._block_at = permute(np.arange(len(sizes)), len(sizes), _round_keys(block_key)).astype(np.int64)
            self._block_offsets = np.concatenate(([0], np.cumsum(sizes[self._block_at])))
            self._inner_key = _stream_key(order.seed, epoch, _SALT_ORDER)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) at the given positions of this epoch."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.order.lanes is not None:
            positions = self.order.lanes.inner(positions, self.order.num_samples)
        shuffle = self.order.shuffle
        if shuffle in IDENTITY:
            return positions
        if shuffle == "global":
            return permute(positions, self.order.num_samples, self._keys).astype(np.int64)
        slot = np.searchsorted(self._block_offsets, positions, side="right") - 1
        block = self._block_at[slot]
        sizes = np.asarray(self.order.block_sizes, dtype=np.int64)[block]
        with np.errstate(over="ignore"):
            keys = _round_keys(_fmix64(block.astype(np.uint64) ^ self._inner_key))
        inner = permute(positions - self._block_offsets[slot], sizes, keys).astype(np.int64)
        return self.order._block_starts[block] + inner

    def positions_of(self, indices: np.ndarray) -> np.ndarray:
        """Positions (int64) of the given dataset indices (all in [0, N)) in this epoch: the inverse of __call__,
        through the same permutations run backwards, O(len(indices)) (and O(#blocks) once for blocks)."""
        indices = np.asarray(indices, dtype=np.int64)
        order = self.order
        if order.shuffle in IDENTITY:
            positions = indices
        elif order.shuffle == "global":
            positions = permute(indices, order.num_samples, self._keys, inverse=True).astype(np.int64)
        else:
            block = np.searchsorted(order._block_starts, indices, side="right") - 1  # the non-empty one holding it
            slot = np.empty_like(self._block_at)
            slot[self._block_at] = np.arange(len(self._block_at))
            with np.errstate(over="ignore"):
                keys = _round_keys(_fmix64(block.astype(np.uint64) ^ self._inner_key))
            inner = permute(
                indices - order._block_starts[block],
                np.asarray(order.block_sizes, dtype=np.int64)[block],
                keys,
                inverse=True,
            ).astype(np.int64)
            positions = self._block_offsets[slot[block]] + inner
        return positions if order.lanes is None else order.lanes.outer(positions, order.num_samples)

    def last_index(self, spans: np.ndarray, at: int = 0) -> int | None:
        """The largest dataset index >= `at` at the positions `spans` (normalized intervals) hold; None: none.

        Why not O(#intervals): a shuffled order spreads an interval of positions over the whole dataset, and only
        mapping them bounds its largest index. Two scans take turns, SCAN evaluations of the order a turn (bounded
        memory): the positions forward (done: their largest index), and the indices from N - 1 down, backwards
        (the first one found at a position inside `spans` is the answer; none down to `at`: None). So at most
        2 min(positions in spans, N - at) evaluations, and when the answer is not None, ~N / (positions in spans)
        under a keyed shuffle. O(1) for the identity order."""
        n = self.order.num_samples
        if not len(spans):
            return None
        if self.order.shuffle in IDENTITY and self.order.lanes is None:
            return int(spans[-1, 1]) - 1 if spans[-1, 1] > at else None
        forward = ((low, min(low + SCAN, high)) for start, high in spans.tolist() for low in range(start, high, SCAN))
        backward = ((max(at, top - SCAN), top) for top in range(n, at, -SCAN))
        last = -1
        while True:
            step = next(forward, None)
            if step is None:
                return last if last >= at else None
            last = max(last, int(self(np.arange(*step)).max()))
            step = next(backward, None)
            if step is None:
                return None
            inside = np.nonzero(contains(spans, self.positions_of(np.arange(*step))))[0]
            if len(inside):
                return step[0] + int(inside[-1])
