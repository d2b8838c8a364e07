"""The partition and the interval arithmetic, checked against brute-force models."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.core.partition import EpochPlan, Layout
from loader.core.progress import Remaining, complement, normalize, union
from loader.core.state import StateError, intervals_from_json, intervals_to_json

layouts = st.builds(
    Layout,
    world_size=st.integers(1, 6),
    grad_accum=st.integers(1, 4),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
)


def rank_batches(plan, rank):
    starts, stops = plan.batch_bounds(rank, np.arange(plan.batches_per_rank))
    return [list(range(a, b)) for a, b in zip(starts.tolist(), stops.tolist())]


def updates(plan, batches):
    """The samples of each optimizer update: micro-batches [g*K, (g+1)*K) of every rank."""
    K = plan.layout.grad_accum
    return [
        sorted(i for per_rank in batches for batch in per_rank[g * K : (g + 1) * K] for i in batch)
        for g in range(-(-plan.batches_per_rank // K))
    ]


@settings(max_examples=400, deadline=None)
@given(remaining=st.integers(0, 400), layout=layouts)
def test_the_tail_rule(remaining, layout):
    """Disjoint micro-batches covering [0, served); without drop_last nothing is dropped unless R < W; every rank
    yields as many non-empty micro-batches; every update but the last covers [g*G, (g+1)*G), the last the rest."""
    plan = EpochPlan(remaining, layout)
    W, B, G = layout.world_size, layout.batch_size, layout.global_batch
    batches = [rank_batches(plan, r) for r in range(W)]
    served = sorted(i for per_rank in batches for batch in per_rank for i in batch)
    assert served == list(range(plan.served))
    if layout.drop_last:
        assert plan.served == remaining - remaining % G
    else:
        assert plan.served == (remaining if remaining >= W else 0)
    assert all(len(per_rank) == plan.batches_per_rank for per_rank in batches)
    by_update = updates(plan, batches)
    assert by_update[:-1] == [list(range(g * G, (g + 1) * G)) for g in range(len(by_update) - 1)]
    assert not by_update or by_update[-1] == list(range((len(by_update) - 1) * G, plan.served))
    K = layout.grad_accum
    last = (len(by_update) - 1) * K
    assert all(len(batch) == B for per_rank in batches for batch in per_rank[:last])
    last_sizes = [len(batch) for per_rank in batches for batch in per_rank[last:]]
    assert not last_sizes or 1 <= min(last_sizes) <= max(last_sizes) <= min(min(last_sizes) + 1, B + 1)
    if layout.drop_last:
        assert set(last_sizes) <= {B}


@pytest.mark.parametrize(
    "remaining, layout, per_rank, samples",
    [
        (10_000, Layout(3, 1, 8, False), 417, [3334, 3333, 3333]),  # the job: nothing dropped
        (50, Layout(3, 2, 4, False), 4, [17, 17, 16]),  # 2 left after 2 updates ride on the second's last micro-step
        (51, Layout(3, 2, 4, False), 5, [17, 17, 17]),  # 3 left: a short update, one sample per rank
        (2, Layout(3, 2, 4, False), 0, [0, 0, 0]),  # fewer samples than ranks: dropped by policy
        (50, Layout(3, 2, 4, True), 4, [16, 16, 16]),  # drop_last: 2 dropped by policy
    ],
)
def test_tail_examples(remaining, layout, per_rank, samples):
    plan = EpochPlan(remaining, layout)
    assert plan.batches_per_rank == per_rank
    assert [plan.samples_from(r, 0) for r in range(layout.world_size)] == samples
    assert plan.served == sum(samples)


@settings(max_examples=300, deadline=None)
@given(remaining=st.integers(0, 400), layout=layouts)
def test_samples_from_a_batch_on_equals_the_sum_of_those_batches(remaining, layout):
    plan = EpochPlan(remaining, layout)
    for rank in range(layout.world_size):
        sizes = [len(batch) for batch in rank_batches(plan, rank)]
        firsts = range(plan.batches_per_rank + 2)
        assert [plan.samples_from(rank, b) for b in firsts] == [sum(sizes[b:]) for b in firsts]


@settings(max_examples=200, deadline=None)
@given(remaining=st.integers(0, 600), micro_batch=st.sampled_from([1, 2]), worlds=st.permutations([1, 2, 3, 4, 6]))
def test_update_composition_does_not_depend_on_the_world_size(remaining, micro_batch, worlds):
    """With the same global batch, update g is the same set of samples at every world size."""
    global_batch = 24

    def at(world):
        plan = EpochPlan(remaining, Layout(world, global_batch // (world * micro_batch), micro_batch, drop_last=True))
        return updates(plan, [rank_batches(plan, r) for r in range(world)])

    reference = at(worlds[0])
    assert all(at(w) == reference for w in worlds[1:])
    assert reference == [list(range(g * global_batch, (g + 1) * global_batch)) for g in range(len(reference))]


def test_completed_counts_whole_updates_only():
    plan = EpochPlan(50, Layout(2, 3, 4, drop_last=False))  # G = 24: 2 full updates, tail 2 -> 1 per rank
    assert plan.batches_per_rank == 7
    assert [plan.completed(d) for d in range(8)] == [0, 0, 0, 3, 3, 3, 6, 7]


def test_layout_validation():
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        Layout(1, 1, 0, False)
    with pytest.raises(ValueError, match="grad_accum must be a positive int, got -1"):
        Layout(1, -1, 1, False)


intervals = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 120)), max_size=8)


def as_set(spans):
    return {i for a, b in np.asarray(spans).reshape(-1, 2).tolist() for i in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(a=intervals, b=intervals)
def test_interval_set_algebra(a, b):
    merged = union(normalize(a), normalize(b))
    assert as_set(merged) == as_set(a) | as_set(b)
    assert (merged[1:, 0] > merged[:-1, 1]).all()  # sorted, disjoint, not touching
    assert as_set(complement(merged, 130)) == set(range(130)) - as_set(merged)
    (parsed,) = intervals_from_json([intervals_to_json(merged)], 130, str)
    assert np.array_equal(parsed, merged)


@settings(max_examples=200, deadline=None)
@given(committed=intervals, data=st.data())
def test_remaining_index_maps_to_uncommitted_positions_in_order(committed, data):
    committed = normalize(committed)
    remaining = Remaining(committed, 130)
    expected = sorted(set(range(130)) - as_set(committed))
    assert remaining.count == len(expected)
    assert remaining.positions(np.arange(remaining.count)).tolist() == expected
    if remaining.count:
        a = data.draw(st.integers(0, remaining.count - 1))
        b = data.draw(st.integers(a + 1, remaining.count))
        image = as_set(union(committed, remaining.covering_spans(np.array([[a, b]]))))
        assert image == as_set(committed) | set(expected[a:b])


def test_corrupted_intervals_are_rejected_with_the_field_name():
    def name(i):
        return f"committed[{i}]"

    with pytest.raises(StateError, match="committed\\[0\\].*sorted, disjoint"):
        intervals_from_json([[5, 3]], 10, name)
    with pytest.raises(StateError, match="committed\\[0\\].*inside \\[0, 10\\)"):
        intervals_from_json([[0, 11]], 10, name)
    with pytest.raises(StateError, match="committed\\[0\\] must be a flat list of int pairs"):
        intervals_from_json([[0, 1, 2]], 10, name)
    with pytest.raises(StateError, match="committed\\[2\\].*sorted, disjoint"):  # the list it is in is named
        intervals_from_json([[0, 2], [], [1, 3, 2, 6]], 10, name)
    parsed = intervals_from_json([[0, 2], [], [1, 3, 5, 6]], 10, name)  # each list is checked on its own
    assert [p.tolist() for p in parsed] == [[[0, 2]], [], [[1, 3], [5, 6]]]
