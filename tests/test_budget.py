"""Token-budget batches: every sample of an epoch in exactly one batch (delivered, or dropped by the loader's
policy and recorded) across a 4 -> 3 -> 2 resume with unequal consumption, every batch within the budget, batches
as pure functions of (seed, epoch, k), options at their extremes, bad input."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, merge_states
from loader.core.batch_policy import BatchPolicy
from loader.sources.budget import TokenBudgetBatches


def lognormal_lengths(n=300, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(3, 1, n).astype(np.int64)
    lengths[:5] = [0, 1, 0, 1, 1]  # lengths of 0 and 1 too
    return lengths


def assert_partition_within_budget(batches, lengths, epoch=None):
    """Every sample in exactly one batch of the epoch; every batch's count x longest (a length 0 counting 1)
    within max_tokens and max_samples, or a single sample longer than max_tokens alone."""
    seen = []
    for k in range(len(batches)):
        members = batches.members(k, epoch)
        seen += members.tolist()
        assert len(members) >= 1
        cost = len(members) * max(1, int(lengths[members].max()))
        assert cost <= batches.max_tokens or (len(members) == 1 and lengths[members[0]] > batches.max_tokens)
        assert batches.max_samples is None or len(members) <= batches.max_samples
    assert sorted(seen) == list(range(len(lengths)))


@pytest.mark.parametrize(
    "max_tokens, options",
    [
        (256, {}),  # the usual case: buckets of ratio 1.1
        (40, {}),  # smaller than the longest samples: those alone
        (1, {}),  # every sample alone
        (10**9, {"buckets": None}),  # the whole epoch fits one batch
        (10**9, {}),  # one batch per bucket
        (256, {"buckets": [4, 16, 64], "max_samples": 7}),  # given bounds and a cap on samples
        (256, {"buckets": None, "multiple_of": 12}),  # one bucket split into a multiple of 12 batches
    ],
)
def test_every_sample_in_exactly_one_batch_within_the_budget(max_tokens, options):
    lengths = lognormal_lengths()
    batches = TokenBudgetBatches(lengths, max_tokens, seed=3, **options)
    for epoch in (0, 1):
        assert_partition_within_budget(batches, lengths, epoch)
    stats = batches.stats()
    assert stats["oversize"] == int((lengths > max_tokens).sum())
    assert stats["tokens"] == int(lengths.sum()) and stats["batches"] == len(batches)
    assert len(batches) % options.get("multiple_of", 1) == 0
    if max_tokens == 10**9 and options.get("buckets", 1) is None:
        assert len(batches) == 1


def test_fewer_samples_than_a_multiple_are_refused_and_oversize_refused_by_name():
    lengths = lognormal_lengths()
    with pytest.raises(ValueError, match="multiple_of=301"):
        TokenBudgetBatches(lengths, 256, multiple_of=301)
    at = int(np.argmax(lengths > 40))
    with pytest.raises(ValueError, match=f"sample {at} has {lengths[at]} tokens, more than max_tokens=40"):
        TokenBudgetBatches(lengths, 40, oversize="refuse")
    for bad, match in (
        ([1, -2], "sample 1 has length -2"),
        ([1.5], "must be integers"),
        ([], "non-empty"),
        ([[1]], "1-D"),
    ):
        with pytest.raises(ValueError, match=match):
            TokenBudgetBatches(np.asarray(bad), 8)
    for options, match in (
        ({"buckets": 1.0}, "ratio"),
        ({"buckets": [0, 3]}, "positive int"),
        ({"buckets": True}, "got True"),  # was a raw TypeError from list(True)
        ({"buckets": {4, 16}}, "got \\{"),  # a set: no bounds in a known order
        ({"oversize": "cut"}, "oversize"),
        ({"max_samples": 0}, "max_samples"),
    ):
        with pytest.raises(ValueError, match=match):
            TokenBudgetBatches([1, 2], 8, **options)
    with pytest.raises(IndexError, match="out of range"):
        TokenBudgetBatches([1, 2], 8)[2]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 60), min_size=1, max_size=80),
    max_tokens=st.integers(1, 200),
    buckets=st.sampled_from([1.1, 2.0, None, [3, 9]]),
    multiple_of=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 5),
    data=st.data(),
)
def test_a_batch_is_a_pure_function_of_seed_epoch_and_k(lengths, max_tokens, buckets, multiple_of, seed, epoch, data):
    """A list and an array of the same lengths, asked in different orders and epochs, give the same batches;
    each epoch partitions the samples within the budget."""
    least = len(TokenBudgetBatches(lengths, max_tokens, buckets=buckets))
    if -(-least // multiple_of) * multiple_of > len(lengths):  # more batches than samples: refused
        with pytest.raises(ValueError, match=f"multiple_of={multiple_of}"):
            TokenBudgetBatches(lengths, max_tokens, buckets=buckets, multiple_of=multiple_of)
        return
    first = TokenBudgetBatches(lengths, max_tokens, buckets=buckets, multiple_of=multiple_of, seed=seed)
    second = TokenBudgetBatches(
        np.asarray(lengths, np.uint16), max_tokens, buckets=buckets, multiple_of=multiple_of, seed=seed, epoch=epoch
    )
    assert len(first) == len(second) and first.fingerprint() == second.fingerprint()
    ks = data.draw(st.permutations(range(len(first))))
    by_k = {k: first.members(k, epoch).tolist() for k in ks}
    assert by_k == {k: second[k].tolist() for k in range(len(second))}
    assert_partition_within_budget(second, np.asarray(lengths))


def test_another_epoch_or_seed_deals_other_batches_and_the_lengths_are_fingerprinted(tmp_path):
    lengths = lognormal_lengths()
    np.save(tmp_path / "lengths.npy", lengths)
    batches = TokenBudgetBatches(str(tmp_path / "lengths.npy"), 256, seed=3)  # memory-mapped
    assert isinstance(batches.lengths, np.memmap)
    epoch0 = [batches.members(k, 0).tolist() for k in range(len(batches))]
    assert epoch0 == [batches.members(k).tolist() for k in range(len(batches))]
    assert epoch0 != [batches.members(k, 1).tolist() for k in range(len(batches))]
    other = TokenBudgetBatches(lengths, 256, seed=4)
    assert epoch0 != [other.members(k, 0).tolist() for k in range(len(other))]
    edited = lengths.copy()
    edited[7] += 1
    changed = TokenBudgetBatches(edited, 256, seed=3)
    assert changed.fingerprint() != batches.fingerprint()
    assert "lengths" in changed.explain_fingerprint(batches.fingerprint())
    assert other.fingerprint() != batches.fingerprint()
    assert "seed" in other.explain_fingerprint(batches.fingerprint())


def dropped_members(batches, loader, state):
    """The samples of the batches the merged state records as dropped by policy in epoch 0."""
    flat = [v for record in state["finished"] if record["epoch"] == 0 for v in record["dropped"]]
    positions = np.concatenate([np.arange(low, high) for low, high in zip(flat[::2], flat[1::2])] + [[]])
    order = loader.resumable_sampler.order.for_epoch(0)
    return [i for k in order(positions.astype(np.int64)).tolist() for i in batches.members(k, 0).tolist()]


def train_4_3_2(batches, stops, workers=0, policy=None):
    """4 ranks stop at `stops[0]` micro-batches each, 3 resume from the merged state and stop at `stops[1]`, 2
    finish the epoch. Returns the samples trained (each delivered batch checked against `members`) and those of
    the batches dropped by policy, and the micro-batches per rank of each step."""
    trained, state, per_step = [], None, []
    for world, stop in zip((4, 3, 2), stops):
        accum = 1 if policy is None else policy.grad_accum(world)
        loaders = [
            ResumableDataLoader(
                batches,
                batch_size=None,
                shuffle=True,
                seed=7,
                rank=r,
                world_size=world,
                grad_accum=accum,
                num_workers=workers,
                multiprocessing_context="fork" if workers else None,
            )
            for r in range(world)
        ]
        for rank, loader in enumerate(loaders):
            if state is not None:
                loader.load_state_dict(state)
            count = 0
            for count, members in enumerate(loader, start=1):
                (k,) = loader.last_indices().tolist()
                assert members.tolist() == batches.members(k, 0).tolist()  # the same batch at any world size
                trained += members.tolist()
                if stop is not None and count == stop[rank]:
                    break
            per_step.append(count)
        state = merge_states([loader.state_dict() for loader in loaders], uneven=True)
    return trained, dropped_members(batches, loaders[0], state), per_step


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_every_sample_once_across_a_4_3_2_resume_with_unequal_consumption(workers):
    """Counted by sample: each one of the epoch is trained exactly once or sits in a batch the merged state
    records as dropped by policy (fewer than world_size batches left at the end), never both, never twice."""
    lengths = lognormal_lengths(400)
    batches = TokenBudgetBatches(lengths, 128, seed=5)
    stops = ((5, 3, 4, 7), (2, 4, 3), None)
    assert (len(batches) - 28) % 2 == 1, "the test needs an odd number of batches left at 2 ranks"
    trained, dropped, _ = train_4_3_2(batches, stops, workers)
    counts = Counter(trained + dropped)
    assert max(counts.values()) == 1, "a sample trained twice"
    assert sorted(counts) == list(range(len(lengths)))
    assert 0 < len(dropped) < len(lengths) // 10  # the last batch left at 2 ranks: dropped, recorded


def test_a_multiple_of_the_global_batch_drops_nothing_in_lockstep_across_resizes():
    """multiple_of = the global batch in batches (BatchPolicy: world_size x grad_accum = 12 at 4, 3 and 2 ranks):
    every rank runs grad_accum micro-batches per step and the epoch ends on a whole step, nothing dropped."""
    lengths = lognormal_lengths(500, seed=1)
    policy = BatchPolicy(global_batch=12, micro_batch=1)
    batches = TokenBudgetBatches(lengths, 128, seed=5, multiple_of=12)
    steps = len(batches) // 12
    assert steps >= 3
    trained, dropped, per_rank = train_4_3_2(batches, ((3,) * 4, (4,) * 3, None), policy=policy)
    assert dropped == [] and sorted(trained) == list(range(len(lengths)))
    assert per_rank[:4] == [3] * 4 and per_rank[4:7] == [4] * 3  # one step each, grad_accum micro-batches
    assert per_rank[7] == per_rank[8] == (steps - 2) * 6
    unpadded = TokenBudgetBatches(lengths, 128, seed=5)
    assert len(unpadded) % 12, "the test needs a batch count that is no multiple of 12 without multiple_of"


def test_items_are_the_datasets_samples_when_a_dataset_is_given():
    lengths = lognormal_lengths(50)
    samples = [torch.arange(n) for n in lengths.tolist()]
    batches = TokenBudgetBatches(lengths, 64, dataset=samples)
    for k in range(len(batches)):
        assert [len(s) for s in batches[k]] == lengths[batches.members(k)].tolist()
    assert str(batches.members(0).tolist()) in batches.describe(0)


def test_no_bucket_straddles_a_length_where_a_batch_holds_one_more():
    """Samples of 5461 tokens (16384 // 3) batch in threes, though 5500-token ones, within the ratio of them, pair."""
    lengths = np.array([5461] * 6 + [5500] * 2)
    batches = TokenBudgetBatches(lengths, 16384)
    assert sorted(len(batches.members(k)) for k in range(len(batches))) == [2, 3, 3]


def test_each_epoch_deals_its_own_batches_through_the_loader():
    """The epoch rides on the index: each pass delivers that epoch's batches, each epoch every sample once."""
    lengths = lognormal_lengths(200)
    batches = TokenBudgetBatches(lengths, 128, seed=2)
    loader = ResumableDataLoader(batches, batch_size=None, shuffle=True, seed=1)
    by_epoch = []
    for epoch in range(2):
        delivered = {}
        for members in loader:
            (k,) = loader.last_indices().tolist()
            delivered[k] = members.tolist()
            assert delivered[k] == batches.members(k, epoch).tolist()
        assert sorted(i for m in delivered.values() for i in m) == list(range(len(lengths)))
        by_epoch.append(delivered)
    assert by_epoch[0] != by_epoch[1]


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=12), max_tokens=st.integers(1, 60))
def test_the_benchmarks_best_fit_makes_the_fewest_batches(lengths, max_tokens):
    """The reference the padding is measured against: its greedy cut of sorted lengths makes as few batches as the
    best partition of them into runs (found by dynamic programming), and ours never fewer."""
    from benchmarks.budget import greedy_cut

    ordered = np.sort(np.asarray(lengths))
    cost = np.maximum(ordered, 1)
    fewest = [0] + [len(lengths) + 1] * len(lengths)
    for stop in range(1, len(lengths) + 1):
        for start in range(stop):
            if (stop - start) * cost[stop - 1] <= max_tokens or stop - start == 1:
                fewest[stop] = min(fewest[stop], fewest[start] + 1)
    sizes = greedy_cut(ordered, max_tokens)
    assert sum(sizes) == len(lengths) and len(sizes) == fewest[-1]
    assert len(TokenBudgetBatches(lengths, max_tokens)) >= len(sizes)


def test_a_checkpoint_resumes_the_batches_and_refuses_other_lengths_naming_them(tmp_path):
    from loader.checkpoint.publish import CheckpointError
    from loader.checkpoint.save import resume, save_checkpoint

    lengths = lognormal_lengths(200)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = ResumableDataLoader(TokenBudgetBatches(lengths, 128), batch_size=None, shuffle=True)
    batches = iter(first)
    trained = [i for _ in range(5) for i in next(batches).tolist()]
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, loader=first)
    edited = lengths.copy()
    edited[3] += 1
    other = TokenBudgetBatches(edited, 128)
    assert len(other) == len(first.dataset)  # the same batch count: only the fingerprint tells
    with pytest.raises(CheckpointError, match="the lengths of the TokenBudgetBatches changed"):
        resume(
            tmp_path, model=model, optimizer=optimizer, loader=ResumableDataLoader(other, batch_size=None, shuffle=True)
        )
    again = ResumableDataLoader(TokenBudgetBatches(lengths, 128), batch_size=None, shuffle=True)
    assert resume(tmp_path, model=model, optimizer=optimizer, loader=again) == 5
    trained += [i for members in again for i in members.tolist()]
    assert sorted(trained) == list(range(len(lengths)))


def every_batch(batches, epochs=(0, 1)):
    return [batches.members(k, epoch).tolist() for epoch in epochs for k in range(len(batches))]


def test_the_cached_index_gives_the_same_batches_bit_for_bit_and_a_restart_maps_it(tmp_path):
    """Without a cache, building it and loading it deal the same batches in every epoch, with the same
    fingerprint; the load maps the index (nothing sorted again) and a spawned worker maps it too (pickled as its
    file, not its content)."""
    import pickle

    lengths = lognormal_lengths(1500)
    np.save(tmp_path / "lengths.npy", lengths)
    plain = TokenBudgetBatches(lengths, 256, seed=3)
    built = TokenBudgetBatches(str(tmp_path / "lengths.npy"), 256, seed=3, cache=True)
    loaded = TokenBudgetBatches(tmp_path / "lengths.npy", 256, seed=3, cache=tmp_path)
    assert built.built and not loaded.built and isinstance(loaded.index, np.memmap)
    assert every_batch(plain) == every_batch(built) == every_batch(loaded)
    assert plain.fingerprint() == built.fingerprint() == loaded.fingerprint()
    assert np.array_equal(plain.index, loaded.index) and plain.index.dtype == loaded.index.dtype
    shipped = pickle.dumps(loaded)
    saved = len(pickle.dumps(plain)) - len(shipped)  # the lengths and the index travel as their files' names
    assert saved > lengths.nbytes + plain.index.nbytes - 1000
    assert every_batch(pickle.loads(shipped)) == every_batch(plain)
    reseeded = TokenBudgetBatches(lengths, 256, seed=4, cache=tmp_path)  # the seed only deals: the same index
    assert not reseeded.built and every_batch(reseeded) == every_batch(TokenBudgetBatches(lengths, 256, seed=4))


@pytest.mark.parametrize(
    "change",
    ["a length", "max_tokens", "buckets", "max_samples", "multiple_of", "oversize"],
)
def test_a_cache_of_other_lengths_or_parameters_is_never_reused(tmp_path, change):
    lengths = lognormal_lengths(400)
    TokenBudgetBatches(lengths, 256, max_samples=9, cache=tmp_path)
    edited = lengths.copy()
    edited[17] += 1  # the same bucket: the index would be the same, the fingerprint is not
    options = {
        "a length": {},
        "max_tokens": {"max_tokens": 255},
        "buckets": {"buckets": 1.2},
        "max_samples": {"max_samples": 8},
        "multiple_of": {"multiple_of": 2},
        "oversize": {"oversize": "refuse", "max_tokens": 10**6},
    }[change]
    arguments = {"max_tokens": 256, "max_samples": 9, **options}
    other = TokenBudgetBatches(edited if change == "a length" else lengths, cache=tmp_path, **arguments)
    assert other.built
    fresh = TokenBudgetBatches(edited if change == "a length" else lengths, **arguments)
    assert every_batch(other) == every_batch(fresh) and other.fingerprint() == fresh.fingerprint()


@pytest.mark.parametrize("damage", ["truncated", "a flipped byte", "the buckets edited", "pickled", "header"])
def test_a_damaged_or_crafted_cache_is_named_and_rebuilt(tmp_path, damage):
    from loader.sources.array_cache import CacheWarning

    lengths = lognormal_lengths(3000)
    expected = every_batch(TokenBudgetBatches(lengths, 256, cache=tmp_path))
    (index,) = tmp_path.glob("budget-index-*.index.npy")
    (table,) = tmp_path.glob("budget-index-*.buckets.npy")
    (header,) = tmp_path.glob("budget-index-*.json")
    data = index.read_bytes()
    if damage == "truncated":
        index.write_bytes(data[: len(data) - 40])
    elif damage == "a flipped byte":
        index.write_bytes(data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
    elif damage == "the buckets edited":  # two buckets' batch counts swapped: sums unchanged
        edited = np.load(table)
        rows = [int(np.argmin(edited[:, 3])), int(np.argmax(edited[:, 3]))]
        edited[rows, 3] = edited[rows[::-1], 3]
        np.save(table, edited)
    elif damage == "pickled":
        np.save(index, np.array([object()] * 3, dtype=object), allow_pickle=True)
    else:
        header.write_text(header.read_text().replace('"max_tokens": 256', '"max_tokens": 257'))
    with pytest.warns(CacheWarning, match="not usable, rebuilding it: .*budget-index-"):
        rebuilt = TokenBudgetBatches(lengths, 256, cache=tmp_path)
    assert rebuilt.built and every_batch(rebuilt) == expected
    assert not TokenBudgetBatches(lengths, 256, cache=tmp_path).built  # the rebuilt entry verifies


def test_an_unwritable_cache_warns_and_keeps_the_index_in_memory(tmp_path):
    from loader.sources.array_cache import CacheWarning

    (tmp_path / "file").write_text("")
    lengths = lognormal_lengths(50)
    with pytest.warns(CacheWarning, match="could not cache the budget-index"):
        batches = TokenBudgetBatches(lengths, 64, cache=tmp_path / "file")
    assert every_batch(batches) == every_batch(TokenBudgetBatches(lengths, 64))
    with pytest.raises(ValueError, match="cache=True keeps the index next to the lengths' .npy"):
        TokenBudgetBatches(lengths, 64, cache=True)


def test_every_sample_once_across_a_4_3_2_resume_through_the_cached_index(tmp_path):
    """The resume above with every stage's batches loaded from the cache the first one built."""
    lengths = lognormal_lengths(400)
    TokenBudgetBatches(lengths, 128, seed=5, cache=tmp_path)
    batches = TokenBudgetBatches(lengths, 128, seed=5, cache=tmp_path)
    assert not batches.built
    trained, dropped, _ = train_4_3_2(batches, ((5, 3, 4, 7), (2, 4, 3), None))
    counts = Counter(trained + dropped)
    assert max(counts.values()) == 1, "a sample trained twice"
    assert sorted(counts) == list(range(len(lengths)))
    assert 0 < len(dropped) < len(lengths) // 10


def test_a_cache_crafted_with_matching_digests_that_does_not_fit_is_refused(tmp_path):
    from tests.test_packed_keep import crafted

    lengths = lognormal_lengths(300)
    TokenBudgetBatches(lengths, 256, cache=tmp_path)
    (path,) = tmp_path.glob("budget-index-*.buckets.npy")
    table = np.load(path)
    table[0, 1] += 1  # a bucket one member more than the samples hold
    crafted(path, table)
    with pytest.raises(ValueError, match="does not describe 300 samples .*delete its budget-index-\\* files"):
        TokenBudgetBatches(lengths, 256, cache=tmp_path)
