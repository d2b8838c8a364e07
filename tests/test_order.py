"""The order: a keyed bijection of range(N) per (seed, epoch), O(1) per position, statistically sound."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader
from loader.core import order as order_module
from loader.core.checks import MAX_SAMPLES
from loader.core.order import (
    SHUFFLE_MODES,
    Lanes,
    Order,
    _halves,
    block_sizes_for_window,
    epoch_round_keys,
    permute,
    sample_seed,
    window_arrangements,
)
from loader.core.progress import spans_of
from tests.conftest import IndexDataset


def full_order(n, **kw):
    return Order(n, **kw).for_epoch(kw.pop("epoch", 0))(np.arange(n))


def assert_permutation(ids, n):
    assert ids.dtype == np.int64 and len(ids) == n
    assert np.array_equal(np.sort(ids), np.arange(n))


def test_bijection_for_every_small_n():
    for n in range(1, 3001):
        assert_permutation(full_order(n, seed=n), n)


@pytest.mark.parametrize("k", range(1, 21))
def test_bijection_around_powers_of_two(k):
    """The width bug of a peer shows exactly at 2**k + 1: one record repeated, another never seen."""
    for n in (2**k - 1, 2**k, 2**k + 1):
        if n >= 1:
            assert_permutation(full_order(n, seed=k), n)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3001, 400_000), seed=st.integers(0, 2**63 - 1))
def test_bijection_for_sampled_larger_n(n, seed):
    """Beyond the exhaustive range: halves of any shape the best-fit search picks still give a permutation."""
    assert_permutation(full_order(n, seed=seed), n)


def test_random_access_equals_full_order():
    n = 1_000_003
    order = Order(n, seed=7).for_epoch(3)
    positions = np.array([0, 1, 999, 500_000, n - 1])
    assert np.array_equal(order(positions), order(np.arange(n))[positions])


@pytest.mark.parametrize("n", [2, 3, 7, 10, 16, 1000, 200_000, 10**9, 10**9 + 7, 2**31 - 1, 10**12, 2**63 - 1])
def test_feistel_halves_fit_the_domain_tightly(n):
    """Values in [n, a*b) cycle-walk, each walk a full extra set of numpy calls: the fit is the one that keeps
    them rare, with halves of similar size (the rounds mix best) that stay below 2**32 (the hash's 32-bit scaling)."""
    a, b = _halves(n)
    assert a * b >= n and a < 2**32 and b < 2**32
    excess, root = a * b - n, math.isqrt(n - 1) + 1
    assert excess <= root * -(-n // root) - n  # never worse than equal halves of ceil(sqrt(n))
    if n >= 16:
        assert max(a, b) / min(a, b) <= 1.7
    if n in (1000, 200_000, 10**9, 10**12):  # composites with a divisor near sqrt(n): an exact fit, nothing walks
        assert excess == 0


def test_huge_n_is_evaluated_without_materialising():
    n = 10**12
    ids = Order(n, seed=1).for_epoch(0)(np.arange(n - 1000, n))
    assert ((ids >= 0) & (ids < n)).all() and len(np.unique(ids)) == 1000


def test_pure_function_of_seed_epoch_position():
    a = Order(10_000, seed=5).for_epoch(2)(np.arange(10_000))
    assert np.array_equal(a, Order(10_000, seed=5).for_epoch(2)(np.arange(10_000)))
    assert not np.array_equal(a, Order(10_000, seed=5).for_epoch(3)(np.arange(10_000)))
    assert not np.array_equal(a, Order(10_000, seed=6).for_epoch(2)(np.arange(10_000)))


def test_no_shuffle_is_identity():
    assert np.array_equal(full_order(1234, shuffle="none"), np.arange(1234))


def test_first_position_is_unbiased():
    """Chi-square of the index at position 0 over 20,000 seeds, 16 cells: p ~ 1e-4 bound."""
    n, seeds = 16, 20_000
    firsts = np.array([Order(n, seed=s).for_epoch(0)(np.array([0]))[0] for s in range(seeds)])
    expected = seeds / n
    chi2 = (((np.bincount(firsts, minlength=n) - expected) ** 2) / expected).sum()
    assert chi2 < 45.0  # 15 degrees of freedom: P(chi2 > 45) ~ 7e-5


def test_neighbouring_outputs_are_uncorrelated():
    n = 1 << 20
    ids = Order(n, seed=11).for_epoch(0)(np.arange(200_000)).astype(float)
    r = np.corrcoef(ids[:-1], ids[1:])[0, 1]
    assert abs(r) < 0.01
    # and positions do not predict ids
    assert abs(np.corrcoef(np.arange(200_000), ids)[0, 1]) < 0.01


def test_block_order_is_a_permutation_that_keeps_blocks_together():
    sizes = [5, 0, 17, 1, 64, 3, 0, 9]
    n = sum(sizes)
    ids = Order(n, seed=3, shuffle="blocks", block_sizes=tuple(sizes)).for_epoch(1)(np.arange(n))
    assert_permutation(ids, n)
    starts = np.cumsum([0] + sizes)
    block_of = np.searchsorted(starts, ids, side="right") - 1
    runs = block_of[np.concatenate(([True], block_of[1:] != block_of[:-1]))]
    assert len(runs) == len(set(runs)) == sum(1 for s in sizes if s)  # each block visited in one run
    assert not np.array_equal(ids, np.arange(n))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12), seed=st.integers(0, 2**70), epoch=st.integers(0, 9))
def test_block_order_bijection_property(sizes, seed, epoch):
    n = sum(sizes)
    ids = Order(n, seed=seed, shuffle="blocks", block_sizes=tuple(sizes)).for_epoch(epoch)(np.arange(n))
    assert_permutation(ids, n)


def test_the_largest_dataset_trains_and_resumes_and_one_more_sample_is_refused_at_construction():
    """One limit for the order and the state: a dataset the loader accepts has a state it loads back (in O(1):
    nothing proportional to N is allocated), and a larger one is refused before training, not at every resume."""
    assert MAX_SAMPLES == 2**62 - 1
    live = ResumableDataLoader(IndexDataset(MAX_SAMPLES), batch_size=4, shuffle=True, seed=3)
    it = iter(live)
    first = next(it).tolist()
    assert len(set(first)) == 4 and all(0 <= i < MAX_SAMPLES for i in first)
    restored = ResumableDataLoader(IndexDataset(MAX_SAMPLES), batch_size=4, shuffle=True, seed=3)
    restored.load_state_dict(live.state_dict())
    assert next(iter(restored)).tolist() == next(it).tolist()  # resumed after the first batch, exactly
    for n in (MAX_SAMPLES + 1, 2**63 - 1):
        with pytest.raises(ValueError, match=rf"num_samples \(the dataset's length\) must be .*{MAX_SAMPLES}"):
            ResumableDataLoader(IndexDataset(n), batch_size=4, shuffle=True)
        with pytest.raises(ValueError, match=str(MAX_SAMPLES)):
            Order(n)


def test_window_blocks():
    assert block_sizes_for_window(10, 4) == [4, 4, 2]
    with pytest.raises(ValueError, match="window"):
        block_sizes_for_window(10, 0)


def test_bad_order_arguments():
    with pytest.raises(ValueError, match="sum to the dataset length 10"):
        Order(10, shuffle="blocks", block_sizes=(3, 3))
    with pytest.raises(ValueError, match="shuffle must be one of"):
        Order(10, shuffle="random")


def test_sample_seed_depends_on_seed_epoch_index_only():
    seeds = sample_seed(0, 0, np.arange(10_000))
    assert len(np.unique(seeds)) == 10_000 and (seeds >= 0).all()
    assert sample_seed(0, 0, 77) == seeds[77]
    assert sample_seed(0, 1, 77) != seeds[77] and sample_seed(1, 0, 77) != seeds[77]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_many_epochs_in_one_pass_are_each_epochs_order(sizes, seed, data):
    """epoch_round_keys + permute (keys per element) evaluate Order(n, seed_i).for_epoch(e_i) for many pairs at once,
    as a mixture's batch needs: the same ids as an EpochOrder per pair."""
    epochs = data.draw(st.lists(st.integers(0, 2**40), min_size=len(sizes), max_size=len(sizes)), label="epochs")
    seeds = [seed + i for i in range(len(sizes))]
    pair = np.repeat(np.arange(len(sizes)), 20)
    positions = np.array([data.draw(st.integers(0, sizes[p] - 1)) for p in pair])
    keys = epoch_round_keys(np.array(seeds, dtype=np.uint64), np.array(epochs))[:, pair]
    together = permute(positions, np.array(sizes)[pair], keys).astype(np.int64)
    one_by_one = [Order(sizes[p], seeds[p]).for_epoch(epochs[p])(positions[pair == p]) for p in range(len(sizes))]
    assert np.array_equal(together, np.concatenate(one_by_one))


@pytest.mark.parametrize("size", [1, 2, 3, 10, 17, 1000])
def test_every_window_arrangement_is_a_permutation_keyed_by_seed_and_window(size):
    windows = np.array([0, 1, 5, 10**12])
    rows = window_arrangements(7, windows, size)
    assert rows.shape == (4, size)
    for row in rows:
        assert_permutation(row, size)
    if size >= 10:
        assert len({tuple(r) for r in rows}) == 4  # each window its own order
        assert not np.array_equal(window_arrangements(8, windows, size), rows)
    assert np.array_equal(window_arrangements(7, windows[2:3], size)[0], rows[2])  # a pure function of (seed, k)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), count=st.integers(1, 9), chunk=st.integers(1, 9), seed=st.integers(0, 2**32))
def test_lanes_keep_the_order_a_bijection(n, count, chunk, seed):
    lanes = Lanes(count, chunk)
    order = Order(n, seed, "blocks", tuple(block_sizes_for_window(n, 17)), lanes) if n else Order(n, seed, lanes=lanes)
    ids = order.for_epoch(3)(np.arange(n))
    assert sorted(ids.tolist()) == list(range(n))
    without = Order(n, seed, order.shuffle, order.block_sizes).for_epoch(3)(np.arange(n))
    lane_of = np.repeat(np.arange(count), [n // count + (lane < n % count) for lane in range(count)])
    lane_of_id = np.empty(n, dtype=np.int64)
    lane_of_id[without] = lane_of  # the lane each id belongs to: its contiguous part of the order without lanes
    rounds = (n // count) // chunk * count * chunk
    chunks = np.arange(rounds) // chunk % count
    assert (lane_of_id[ids[:rounds]] == chunks).all()  # chunk k of the full rounds comes from lane k mod count


def test_lanes_give_each_rank_and_node_its_own_shards():
    """24 shards of 50 samples, 4 ranks (2 nodes of 2), lanes=8: each rank reads a quarter of the shards, each
    node half of them."""
    from loader import ResumableDataLoader
    from tests.conftest import IndexDataset

    shards = [50] * 24
    read = []
    for rank in range(4):
        dl = ResumableDataLoader(
            IndexDataset(1200),
            batch_size=5,
            shuffle=True,
            shuffle_blocks=shards,
            seed=1,
            rank=rank,
            world_size=4,
            lanes=8,
        )
        read.append({int(i) // 50 for batch in dl for i in batch})
    assert [len(r) for r in read] == [6] * 4 and len(set().union(*read)) == 24  # lanes of 3 whole shards
    assert not (read[0] | read[1]) & (read[2] | read[3])  # the nodes share no shard
    everywhere = [
        ResumableDataLoader(
            IndexDataset(1200), batch_size=5, shuffle=True, shuffle_blocks=shards, seed=1, rank=0, world_size=4
        )
    ]
    assert len({int(i) // 50 for batch in everywhere[0] for i in batch}) == 24  # without lanes: every shard


def test_a_state_saved_with_lanes_needs_the_same_lanes():
    from loader import ResumableDataLoader, StateError
    from tests.conftest import IndexDataset

    kw = dict(batch_size=2, shuffle=True, shuffle_blocks=10, world_size=2, rank=0)
    dl = ResumableDataLoader(IndexDataset(40), lanes=4, **kw)
    next(iter(dl))
    state = dl.state_dict()
    for other in (dict(), dict(lanes=2), dict(lanes=4, lane_chunk=3)):
        with pytest.raises(StateError, match=r"fingerprint.lanes is \[4, 2\].*lanes= and lane_chunk="):
            ResumableDataLoader(IndexDataset(40), **other, **kw).load_state_dict(state)
    ResumableDataLoader(IndexDataset(40), lanes=4, **kw).load_state_dict(state)
    with pytest.raises(ValueError, match="lane_chunk needs lanes="):
        ResumableDataLoader(IndexDataset(40), lane_chunk=2, **kw)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    shuffle=st.sampled_from(SHUFFLE_MODES),
    lanes=st.none() | st.integers(1, 4),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 3),
    scan=st.integers(1, 50),
    data=st.data(),
)
def test_last_index_of_positions_is_the_largest_index_they_hold_from_at(n, shuffle, lanes, seed, epoch, scan, data):
    """Both ways of finding it (the positions forward when they are fewer, the indices from the end backwards
    otherwise), over several SCAN steps, against the largest index of the positions mapped one by one."""
    blocks = block_sizes_for_window(n, data.draw(st.integers(1, n), label="block")) if shuffle == "blocks" else None
    order = Order(n, seed, shuffle, blocks, None if lanes is None else Lanes(lanes, 2)).for_epoch(epoch)
    positions = data.draw(st.lists(st.integers(0, n - 1), max_size=n), label="positions")
    at = data.draw(st.integers(0, n - 1), label="at")
    spans = spans_of(positions)
    held = [int(order(np.array([p]))[0]) for p in positions]
    expected = max((i for i in held if i >= at), default=None)
    original = order_module.SCAN
    order_module.SCAN = scan
    try:
        assert order.last_index(spans, at) == expected
    finally:
        order_module.SCAN = original
