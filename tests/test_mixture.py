"""Mixture: exact proportions per window, each source's epochs as permutations, a pure function of the position."""

import copy
import json
import pickle
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, SampleIndex, merge_states
from loader.core.checks import MAX_SAMPLES
from loader.core.rows import Rows, collate
from loader.sources import Mixture, MixturePlan, TokenFileError, TokenSource
from loader.sources.mixture import BLOCK, MAX_WINDOW, window_counts
from loader.sources.tokens import GATHER_ROWS
from tests.conftest import assert_batches_match_torch


class Tagged:
    """A source whose sample i is (tag, i): a batch shows which source and index each position drew."""

    def __init__(self, n: int, tag: str):
        self.n, self.tag = n, tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if not 0 <= index < self.n:
            raise IndexError(index)
        return self.tag, int(index)


def mixture(lengths, weights, num_samples, seed=0, **kw):
    return Mixture([Tagged(n, f"s{i}") for i, n in enumerate(lengths)], weights, num_samples, seed, **kw)


@pytest.mark.parametrize(
    "weights, window, counts",
    [
        ([0.7, 0.3], None, (7, 3)),
        ([7, 3], None, (7, 3)),
        ([1, 1, 1], None, (1, 1, 1)),
        ([1 / 3, 2 / 3], None, (1, 2)),
        ([0.5, 0.3, 0.2], None, (5, 3, 2)),
        ([0.125, 0.875], None, (1, 7)),
        ([0.7, 0.3], 7, (5, 2)),
        ([0.7, 0.3], 100, (70, 30)),
        ([1, 1, 1], 4, (2, 1, 1)),  # three equal remainders: the spare slot goes to the first source
    ],
)
def test_window_counts(weights, window, counts):
    assert window_counts(weights, window) == counts


def test_weights_no_window_holds_exactly_are_rounded_within_one_at_the_largest_window():
    weights = [np.pi, np.e, 1.0]
    counts = window_counts(weights)
    assert sum(counts) == MAX_WINDOW
    assert np.all(np.abs(np.array(counts) - np.array(weights) / sum(weights) * MAX_WINDOW) < 1)


@settings(max_examples=150, deadline=None)
@given(window=st.one_of(st.none(), st.integers(4, 60)), data=st.data())
def test_every_aligned_window_holds_each_share_to_within_one_sample(window, data):
    """Any weights with a given window; with the default window, weights it holds exactly (integers: a window of
    their sum or less; arbitrary floats would take the 10,000 positions of MAX_WINDOW per window)."""
    values = st.integers(1, 12) if window is None else st.floats(0.05, 10.0)
    weights = data.draw(st.lists(values, min_size=1, max_size=4), label="weights")
    counts = window_counts(weights, window)
    m = sum(counts)
    if min(counts) == 0:
        return  # refused by the plan: see test_a_source_without_a_slot_is_refused
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=len(weights), max_size=len(weights)), label="lengths")
    windows = data.draw(st.integers(1, 6), label="windows")
    mix = mixture(
        lengths,
        weights,
        m * windows + data.draw(st.integers(0, m - 1), label="tail"),
        seed=data.draw(st.integers(0, 2**40), label="seed"),
        window=window,
    )
    source, _ = mix.locate(list(range(len(mix))))
    shares = np.asarray(weights) / sum(weights) * m
    for k in range(windows):
        held = np.bincount(source[k * m : (k + 1) * m], minlength=len(weights))
        assert held.tolist() == list(counts)
        assert np.all(np.abs(held - shares) < 1)
    assert list(mix.plan.samples_per_source()) == np.bincount(source, minlength=len(weights)).tolist()


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    seed=st.integers(0, 2**63 - 1),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_each_source_epoch_is_a_permutation_of_that_source_in_position_order(lengths, seed, shuffle, data):
    """A source that runs out continues with its next epoch: its draws, taken in position order and cut into runs
    of its length, are permutations (nothing repeats before the source's epoch is used up)."""
    weights = data.draw(st.lists(st.integers(1, 9), min_size=len(lengths), max_size=len(lengths)), label="weights")
    mix = mixture(lengths, weights, data.draw(st.integers(1, 400), label="num_samples"), seed, shuffle=shuffle)
    source, index = mix.locate(list(range(len(mix))))
    for s, n in enumerate(lengths):
        drawn = index[source == s]
        for run in range(0, len(drawn), n):
            chunk = drawn[run : run + n].tolist()
            assert len(set(chunk)) == len(chunk) and all(0 <= i < n for i in chunk)
            if not shuffle:
                assert chunk == list(range(len(chunk)))


def test_the_arrangement_is_shuffled_inside_windows_and_keyed_by_the_seed():
    mix = mixture([1000, 1000], [0.7, 0.3], 10_000, seed=1)
    source, index = mix.locate(list(range(10_000)))
    patterns = {tuple(source[k * 10 : (k + 1) * 10]) for k in range(1000)}
    assert len(patterns) > 50  # 120 arrangements of 7 + 3 slots exist; the windows use many of them
    other_source, other_index = mixture([1000, 1000], [0.7, 0.3], 10_000, seed=2).locate(list(range(10_000)))
    assert (other_source != source).any() and (other_index != index).any()
    assert np.array_equal(mixture([1000, 1000], [0.7, 0.3], 10_000, seed=1).locate(list(range(10_000)))[1], index)


@pytest.mark.parametrize("num_samples", [997, 50_000])
def test_positions_are_a_pure_function_in_any_order_and_through_the_cache(num_samples):
    mix = mixture([37, 500, 3], [0.6, 0.3, 0.1], num_samples, seed=11)
    everything = mix.plan.locate(np.arange(num_samples))
    rng = np.random.default_rng(0)
    for positions in (
        rng.permutation(num_samples)[:300],
        np.arange(num_samples)[::-1][:300],
        np.arange(BLOCK - 5, BLOCK + 5) % num_samples,
        np.array([num_samples - 1, 0]),
    ):
        for locate in (mix.locate, mix.plan.locate, mixture([37, 500, 3], [0.6, 0.3, 0.1], num_samples, 11).locate):
            source, index = locate(positions.tolist())
            assert np.array_equal(source, everything[0][positions]) and np.array_equal(index, everything[1][positions])
    for start in range(0, num_samples, 64):  # sequential batches, as the loader asks with shuffle=False
        batch = list(range(start, min(start + 64, num_samples)))
        assert [mix.sample_key(p) for p in batch[:2]] == [
            (f"source-{everything[0][p]}", int(everything[1][p])) for p in batch[:2]
        ]
        assert np.array_equal(mix.locate(batch)[1], everything[1][batch])
        assert len(mix._cache) <= 2


def test_samples_come_from_the_located_source_and_index():
    mix = mixture([5, 8], [1, 3], 64, names=["small", "large"])
    source, index = mix.locate(list(range(64)))
    expected = [(f"s{s}", i) for s, i in zip(source.tolist(), index.tolist())]
    assert mix.__getitems__(list(range(64))) == expected
    assert [mix[p] for p in range(64)] == expected
    assert mix.sample_key(3) == (["small", "large"][source[3]], index[3])
    with pytest.raises(IndexError, match="mixture position 64 out of range for 64 positions"):
        mix[64]


def test_source_of_gives_numbers_by_default_and_the_names_given_on_request():
    """plan.source_of names each position's source as the Mixture was told (names=True), the tag its sample
    carries; by default the source numbers, as before."""
    mix = mixture([5, 8, 3], [1, 3, 2], 48, names=["small", "large", "tiny"])
    numbers = mix.plan.source_of(np.arange(48))
    assert numbers.dtype.kind == "i" and [f"s{n}" for n in numbers] == [tag for tag, _ in mix.__getitems__(range(48))]
    named = mix.plan.source_of(np.arange(48), names=True)
    assert named.tolist() == [["small", "large", "tiny"][n] for n in numbers]
    assert set(named) == {"small", "large", "tiny"}


def token_mixture(tmp_path, num_samples):
    """Two TokenSources (the second over two files, so samples cross a file boundary) and a source without
    __getitems__, mixed."""
    rng = np.random.default_rng(3)
    for name, size in (("a-0", 400), ("b-0", 150), ("b-1", 97)):
        rng.integers(0, 60000, size).astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    sources = [TokenSource(str(tmp_path / f"{prefix}-*.bin"), seq_len=8, dtype="uint16") for prefix in "ab"]
    return Mixture(sources + [Tagged(7, "t")], [0.5, 0.3, 0.2], num_samples, seed=4, names=["a", "b", "t"])


def as_lists(samples):
    return [s.tolist() if torch.is_tensor(s) else s for s in samples]


def test_a_batch_equals_its_positions_one_by_one(tmp_path):
    """__getitems__ groups a batch by source, asks each once, and puts the samples back in position order: the
    same samples as one __getitem__ per position, in or out of order, within a cached block or across blocks."""
    mix = token_mixture(tmp_path, 3 * BLOCK)
    rng = np.random.default_rng(0)
    batches = [
        list(range(8)),
        list(range(BLOCK - 5, BLOCK + 27)),
        rng.permutation(3 * BLOCK)[:64].tolist(),
        [5, 5, 3],
        [3 * BLOCK - 1, 0],
        [17],
    ] + [rng.integers(0, 3 * BLOCK, 8).tolist() for _ in range(20)]
    for batch in batches:
        assert as_lists(mix.__getitems__(batch)) == as_lists([mix[p] for p in batch])
    assert mix.__getitems__([]) == []
    source, index = mix.plan.locate(np.arange(64))
    for p, sample in enumerate(mix.__getitems__(list(range(64)))):
        expected = mix.sources[source[p]][int(index[p])]
        assert as_lists([sample]) == as_lists([expected])


def test_a_loader_over_a_mixture_delivers_every_position_once_across_a_resume(tmp_path):
    """Through torch's fetcher (which calls __getitems__): each batch holds its positions' samples, and two ranks
    stopped unevenly then resumed on three deliver every position once."""
    mix = token_mixture(tmp_path, 203)
    seen = []

    def deliver(loader, batches=None):
        for _, batch in zip(range(batches or len(mix)), loader):
            positions = loader.last_indices().tolist()
            assert as_lists(batch) == as_lists([mix[p] for p in positions])
            seen.extend(positions)

    loaders = [ResumableDataLoader(mix, batch_size=5, rank=r, world_size=2, collate_fn=list) for r in range(2)]
    for loader in loaders:
        deliver(loader, 4 + loader.rank)  # uneven stops
    state = merge_states([loader.state_dict() for loader in loaders], uneven=True)
    for r in range(3):
        loader = ResumableDataLoader(mix, batch_size=5, rank=r, world_size=3, collate_fn=list)
        loader.load_state_dict(state)
        deliver(loader)
    assert sorted(seen) == list(range(len(mix)))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="2 weights for 3 sources"):
        mixture([1, 2, 3], [1, 1], 10)
    with pytest.raises(ValueError, match="weights must be positive finite numbers"):
        mixture([1, 2], [1, 0], 10)
    with pytest.raises(ValueError, match="names must be distinct non-empty strings"):
        mixture([1, 2], [1, 1], 10, names=["a", "a"])
    with pytest.raises(ValueError, match="source 'source-1' is empty"):
        mixture([1, 0], [1, 1], 10)
    with pytest.raises(ValueError, match="num_samples"):
        mixture([1, 2], [1, 1], 0)
    with pytest.raises(ValueError, match="window"):
        mixture([1, 2], [1, 1], 10, window=0)


def test_the_largest_mixture_trains_and_resumes_and_one_more_position_is_refused_at_construction():
    """The loader's limit, checked when the mixture is made: len() of a larger one would raise OverflowError (from
    2**63) or its every resume would be refused (from 2**62)."""
    mix = mixture([10, 7], [0.5, 0.5], MAX_SAMPLES, seed=2)
    assert len(mix) == MAX_SAMPLES
    live = ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1, collate_fn=list)
    it = iter(live)
    batch = next(it)
    assert batch == [mix[p] for p in live.last_indices().tolist()]
    restored = ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1, collate_fn=list)
    restored.load_state_dict(live.state_dict())
    assert next(iter(restored)) == next(it)  # resumed after the first batch, exactly
    for n in (MAX_SAMPLES + 1, 2**63, 2**64):
        with pytest.raises(ValueError, match=rf"num_samples must be an int in \[1, {MAX_SAMPLES}\]"):
            mixture([10, 7], [0.5, 0.5], n)
        with pytest.raises(ValueError, match=str(MAX_SAMPLES)):
            MixturePlan.from_dict({**mix.plan.to_dict(), "num_samples": n})


def test_a_source_without_a_slot_is_refused():
    with pytest.raises(ValueError, match="source 'rare' has no slot in a window: raise its weight or window="):
        mixture([10, 10], [1, 1e-5], 100, names=["common", "rare"])
    assert mixture([10, 10], [1, 1e-5], 100, window=10**5).counts == (99_999, 1)  # a big enough window works
    with pytest.raises(ValueError, match="window=1048577: each process builds a window's slot table"):
        mixture([10, 10], [1, 1e-9], 100, window=2**20 + 1)


def test_a_billion_positions_cost_a_few_windows_of_memory():
    mix = mixture([10**9, 3 * 10**8, 10**6], [0.5, 0.3, 0.2], 10**9, seed=5)
    mix.locate(list(range(10**9 - 64, 10**9)))  # warm: first-call allocations are not the mixture's
    tracemalloc.start()
    for start in (5 * 10**8, 10**9 - 200, 123_456_789):
        mix.locate(list(range(start, start + 64)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000


def test_the_plan_saves_loads_and_fingerprints(tmp_path):
    mix = mixture([5, 8], [1, 3], 64, seed=3, names=["a", "b"])
    mix.plan.save(tmp_path / "plan.json")
    plan = MixturePlan.load(tmp_path / "plan.json")
    assert plan == mix.plan and plan.fingerprint() == mix.plan.fingerprint()
    assert np.array_equal(plan.locate(np.arange(64))[1], mix.locate(list(range(64)))[1])
    fingerprints = {
        mixture([5, 8], *args).fingerprint()
        for args in ([[1, 3], 64, 3], [[1, 2], 64, 3], [[1, 3], 65, 3], [[1, 3], 64, 4])
    }
    assert len(fingerprints) == 4
    data = json.loads((tmp_path / "plan.json").read_text())
    (tmp_path / "old.json").write_text(json.dumps({**data, "version": 0}))
    with pytest.raises(ValueError, match=r"old.json: \(kind, version, order_version\) is"):
        MixturePlan.load(tmp_path / "old.json")
    del data["counts"]
    (tmp_path / "cut.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="cut.json: no field 'counts'"):
        MixturePlan.load(tmp_path / "cut.json")


class Seeded(Tagged):
    """Also returns the seed its index carries (None for a plain int)."""

    def __getitem__(self, index):
        return (*super().__getitem__(index), getattr(index, "seed", None))


def test_sample_seeds_reach_the_sources_as_their_positions_seeds():
    from loader import SampleIndex, sample_seed

    mix = Mixture([Seeded(7, "a"), Seeded(5, "b")], [2, 1], 30, seed=3)
    dl = ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=11, sample_seeds=True, collate_fn=list)
    for epoch in range(2):
        dl.set_epoch(epoch)
        got = [(sample, position) for batch in dl for sample, position in zip(batch, dl.last_indices())]
        assert sorted(p for _, p in got) == list(range(30))  # every position once
        for (tag, index, seed), position in got:
            assert (tag, index) == mix[SampleIndex(int(position), epoch=epoch)][:2]  # epoch e: its own positions
            assert seed == sample_seed(11, epoch, int(position))  # the position's seed, per epoch
    plain = ResumableDataLoader(mix, batch_size=4, collate_fn=list)
    assert all(seed is None for batch in plain for _, _, seed in batch)


def write_tokens(directory, sizes, seed=3):
    rng = np.random.default_rng(seed)
    for name, size in sizes.items():
        rng.integers(0, 60000, size).astype(np.uint16).tofile(directory / f"{name}.bin")


def fused_mixture(directory, num_samples, seq_len=8, **kw):
    """Three TokenSources of plain samples and one seq_len (one over one file, two over several, so samples cross
    file boundaries): the mixture fills one batch array."""
    write_tokens(directory, {"a-0": 400, "b-0": 150, "b-1": 97, "c-0": 61, "c-1": 8, "c-2": 140})
    sources = [TokenSource(str(directory / f"{prefix}-*.bin"), seq_len=seq_len, dtype="uint16") for prefix in "abc"]
    mix = Mixture(sources, [0.5, 0.3, 0.2], num_samples, seed=4, names=["a", "b", "c"], **kw)
    assert mix._span == seq_len + 1  # the fused path
    return mix


def general(mix):
    """The same mixture on the per-source path (samples fetched per source, put back in position order)."""
    twin = copy.copy(mix)
    twin._span = None
    return twin


def by_position(mix, positions):
    """The samples of these positions, one source sample at a time."""
    source, index = mix.locate(positions)
    return [mix.sources[s][i] for s, i in zip(source.tolist(), index.tolist())]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return fused_mixture(tmp_path_factory.mktemp("fused"), 3 * BLOCK + 17)


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_the_fused_batch_equals_the_general_path_and_the_samples_one_by_one(fused, data):
    """In order (a cached block, across blocks), scattered, repeated, with sample_seeds positions (SampleIndex,
    whose seeds TokenSource ignores): one int64 array filled in place, the same rows as the per-source path."""
    n = len(fused)
    start = data.draw(st.integers(0, n - 1), label="start")
    batch = data.draw(
        st.one_of(
            st.integers(0, 70).map(lambda size: list(range(start, min(start + size, n)))),
            st.lists(st.integers(0, n - 1), max_size=40),
        ),
        label="positions",
    )
    if data.draw(st.booleans(), label="sample_seeds"):
        batch = [SampleIndex(p, 1000 + p) for p in batch]
    got = fused.__getitems__(batch)
    assert type(got) is Rows and got.intact() and got.batch.shape == (len(batch), 9)
    assert got.batch.dtype == torch.int64
    expected = by_position(fused, batch)
    assert as_lists(got) == as_lists(expected) == as_lists(general(fused).__getitems__(batch))
    assert as_lists(got) == as_lists([fused[p] for p in batch])


def test_the_fused_batch_covers_gathers_and_file_boundaries(fused):
    """Batches where one source's share lies in one file and takes the gather, and ones whose samples cross the
    files of a multi-file source: the same rows as the per-source path."""
    source, index = fused.locate(list(range(len(fused))))
    b = fused.sources[1]
    crossing = [
        i
        for i in range(len(b))
        if b.sample_key(i)[1] + b.seq_len + 1 > b._files[0].count and b.sample_key(i)[0] == b.files[0]
    ]
    assert crossing
    at_crossing = [p for p in range(len(fused)) if source[p] == 1 and index[p] in crossing][:6]
    batches = [list(range(64)), list(range(BLOCK - 40, BLOCK + 40)), at_crossing, at_crossing + list(range(30))]
    gathered = 0
    for batch in batches:
        shares = np.bincount(source[batch], minlength=3)
        gathered += shares[0] >= GATHER_ROWS  # source a is one file: its share is gathered at once
        assert as_lists(fused.__getitems__(batch)) == as_lists(by_position(fused, batch))
        assert as_lists(fused.__getitems__(batch)) == as_lists(general(fused).__getitems__(batch))
    assert gathered


def test_only_plain_token_sources_of_one_seq_len_are_fused(tmp_path):
    write_tokens(tmp_path, {"a": 300, "b": 200})
    a, b = (str(tmp_path / f"{name}.bin") for name in "ab")

    class Own(TokenSource):
        def __getitems__(self, indices):
            return [sample + 1 for sample in super().__getitems__(indices)]

    def span(*sources):
        return Mixture(list(sources), [1] * len(sources), 50)._span

    assert span(TokenSource(a, 8, "uint16"), TokenSource(b, 8, "uint16")) == 9
    assert span(TokenSource(a, 8, "uint16"), TokenSource(b, 9, "uint16")) is None
    assert span(TokenSource(a, 8, "uint16"), TokenSource(b, 8, "uint16", eos_id=3)) is None
    assert span(TokenSource(a, 8, "uint16"), Tagged(5, "t")) is None
    own = Mixture([TokenSource(a, 8, "uint16"), Own(b, 8, "uint16")], [1, 1], 50)
    assert own._span is None  # a subclass's own __getitems__ is what it serves
    source, index = own.locate(list(range(50)))
    assert as_lists(own.__getitems__(list(range(50)))) == as_lists(by_position(own, list(range(50))))
    assert any(s == 1 for s in source.tolist())
    documents = Mixture([TokenSource(a, 8, "uint16", eos_id=3), TokenSource(b, 8, "uint16", eos_id=3)], [1, 1], 50)
    samples = documents.__getitems__(list(range(10)))
    assert all(isinstance(s, dict) for s in samples)  # dict samples keep the per-source path


def test_the_fused_choice_and_batches_survive_pickling(fused):
    worker = pickle.loads(pickle.dumps(fused))
    assert worker._span == fused._span == 9 and not worker._cache
    batch = list(range(100, 140))
    assert torch.equal(collate(worker.__getitems__(batch)), collate(fused.__getitems__(batch)))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sample_seeds", [False, True])
def test_loader_batches_over_a_fused_mixture_equal_torchs_and_the_stacked_samples(tmp_path, workers, sample_seeds):
    mix = fused_mixture(tmp_path, 203)
    ids = assert_batches_match_torch(mix, workers, batch_size=5, sample_seeds=sample_seeds)
    assert sorted(p for batch in ids for p in batch) == list(range(len(mix)))


def test_a_loader_over_a_fused_mixture_delivers_every_position_once_across_a_resume(tmp_path):
    """Default collate (one tensor per batch): two ranks stopped unevenly mid-epoch, resumed at world size 3 from
    their state_dict()s; every position of the epoch delivered exactly once, each row the sample of its position."""
    mix = fused_mixture(tmp_path, 203)
    seen = []

    def deliver(loader, batches=None):
        for _, batch in zip(range(batches or len(mix)), loader):
            positions = loader.last_indices().tolist()
            assert batch.dtype == torch.int64 and torch.equal(batch, torch.stack([mix[p] for p in positions]))
            assert torch.equal(batch, torch.stack(by_position(mix, positions)))
            seen.extend(positions)

    loaders = [ResumableDataLoader(mix, batch_size=5, rank=r, world_size=2) for r in range(2)]
    for loader in loaders:
        deliver(loader, 4 + loader.rank)  # uneven stops
    assert 0 < len(seen) < len(mix)
    state = merge_states([loader.state_dict() for loader in loaders], uneven=True)
    for r in range(3):
        loader = ResumableDataLoader(mix, batch_size=5, rank=r, world_size=3)
        loader.load_state_dict(state)
        deliver(loader)
    assert sorted(seen) == list(range(len(mix)))


def test_a_changed_token_file_is_refused_through_the_fused_path(tmp_path):
    mix = fused_mixture(tmp_path, 60)
    source, index = mix.locate(list(range(60)))
    b = mix.sources[1]
    in_b1 = [p for p in range(60) if source[p] == 1 and b.sample_key(int(index[p]))[0].endswith("b-1.bin")]
    not_b = [p for p in range(60) if source[p] != 1]
    assert in_b1 and not_b
    before = mix.__getitems__(not_b)
    mix.__getitems__(in_b1)  # b-1.bin is mapped in this process: only the check after each read can notice
    with open(tmp_path / "b-1.bin", "ab") as f:  # b's second file grows after the source measured it
        f.write(b"\x00\x00")
    with pytest.raises(TokenFileError, match="b-1.bin changed after the TokenSource was built"):
        mix.__getitems__(not_b[:3] + in_b1[:1])
    assert as_lists(mix.__getitems__(not_b)) == as_lists(before)  # batches that do not read it still load
    with pytest.raises(TokenFileError, match="b-1.bin changed"):
        next(iter(ResumableDataLoader(mix, batch_size=60)))
