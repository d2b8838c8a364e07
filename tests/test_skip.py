"""Deterministic skips (loss-spike recovery): skipped samples are committed, never served, recorded in the state
and reported by the audit in a column of their own; every other sample stays exactly once at any world size."""

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, merge_states
from loader.checkpoint.audit import main as audit_main
from loader.checkpoint.ledger import Ledger
from loader.core.order import Lanes, Order
from loader.core.progress import spans_of
from loader.core.state import StateError
from tests.conftest import IndexDataset
from tests.distributed import run_group

N, B, G = 200, 2, 24  # the global batch G = W * K * B stays 24 at 4, 3 and 2 ranks


def ranks_of(world, state=None, n=N, **kw):
    ranks = [
        ResumableDataLoader(
            IndexDataset(n),
            batch_size=B,
            shuffle=True,
            seed=3,
            rank=r,
            world_size=world,
            grad_accum=G // (world * B),
            collate_fn=list,
            **kw,
        )
        for r in range(world)
    ]
    if state is not None:
        for dl in ranks:
            dl.load_state_dict(copy.deepcopy(state))
    return ranks


def train(ranks, updates=None):
    """Lockstep ranks: `updates` optimizer updates (None: to the end of the pass); the samples they trained."""
    return [i for update in served_updates(ranks, updates) for i in update]


def served_updates(ranks, updates=None):
    """Each update's samples (sorted), micro-step by micro-step on every rank, `updates` of them or to the end."""
    out, current, iterators = [], [], [iter(dl) for dl in ranks]
    while updates is None or len(out) < updates:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            return out
        assert all(b is not None for b in batches)  # every rank yields the same number of micro-batches
        current += [i for batch in batches for i in batch]
        if ranks[0].update_complete:
            out.append(sorted(current))
            current = []
    return out


def indices(ranks, epoch, spans):
    """The dataset indices at these position intervals of the epoch."""
    positions = np.concatenate([np.arange(a, b) for a, b in np.asarray(spans).reshape(-1, 2)])
    return ranks[0].resumable_sampler.order.for_epoch(epoch)(positions).tolist()


def skip_all(ranks, **kw):
    spans = [dl.skip(**kw) for dl in ranks]
    assert all(np.array_equal(s, spans[0]) for s in spans)
    return spans[0]


def assert_exactly_once(trained, skipped, n=N):
    """Every index of the epoch: trained exactly once, or skipped on request exactly once, never both."""
    assert len(trained) == len(set(trained)) and len(skipped) == len(set(skipped))
    assert not set(trained) & set(skipped)
    assert sorted(trained + skipped) == list(range(n))


def test_skipped_samples_are_never_served_and_the_rest_once_across_4_3_2_ranks():
    four = ranks_of(4)
    trained = train(four, 2)
    skipped = indices(four, 0, skip_all(four, updates=range(1, 3)))  # the update after next, and the one after
    assert len(skipped) == 2 * G
    trained += train(four, 2)
    state = json.loads(json.dumps(merge_states([dl.state_dict() for dl in four])))  # plain data
    assert state["skipped"] == [[0, [3 * G, 5 * G]]]

    three = ranks_of(3, state)
    ahead = range(150, 160)  # positions no update has reached yet
    skipped += indices(three, 0, skip_all(three, positions=ahead))
    trained += train(three, 1)
    state = merge_states([dl.state_dict() for dl in three])
    assert state["skipped"] == [[0, [3 * G, 5 * G, 150, 160]]]

    two = ranks_of(2, state)
    trained += train(two)
    final = merge_states([dl.state_dict() for dl in two])
    assert final["finished"] == [{"epoch": 0, "dropped": []}] and final["skipped"] == state["skipped"]
    assert_exactly_once(trained, skipped)


def test_skips_inside_the_holes_of_uneven_ranks_and_after_them_keep_every_sample_once():
    """Ranks that consumed unequal amounts (DDP Join) leave holes; a skip of positions in a hole and of the next
    update, at another world size, still deals every other position exactly once."""
    three = ranks_of(3)
    iterators, trained = [iter(dl) for dl in three], []
    for r, micro_batches in enumerate((8, 4, 12)):  # whole updates of grad_accum 4 each
        trained += [i for _ in range(micro_batches) for i in next(iterators[r])]
    state = merge_states([dl.state_dict() for dl in three], uneven=True)
    holes = [(a, b) for a, b in zip(state["committed"][0][1][1::2], state["committed"][0][1][2::2])]
    assert holes  # the committed positions have gaps
    two = ranks_of(2, state)
    hole = range(*holes[0])
    skipped = indices(two, 0, skip_all(two, positions=hole))
    skipped += indices(two, 0, skip_all(two, updates=1))
    trained += train(two)
    assert_exactly_once(trained, skipped)


def test_a_skip_before_iter_and_during_a_pass_drop_exactly_the_updates_they_name():
    """With the global batch kept, skipping k updates moves the later ones up whole: the run equals an
    uninterrupted one without those updates (as metaseq's skip of update numbers does)."""
    plain = served_updates(ranks_of(2))
    fresh = ranks_of(2)
    skip_all(fresh, updates=2)  # before iter(): the first two updates
    assert served_updates(fresh) == plain[2:]
    during = ranks_of(2)
    first = served_updates(during, 3)
    skip_all(during, updates=range(0, 2))  # during the pass: the new iterator goes on after the skipped ones
    assert first + served_updates(during) == plain[:3] + plain[5:]


def test_a_skip_called_differently_on_the_ranks_is_refused_at_the_merge_naming_them():
    two = ranks_of(2)
    train(two, 1)
    two[0].skip(updates=1)
    two[1].skip(updates=2)
    with pytest.raises(
        StateError,
        match=r"states\[1\] \(rank 1\) has another base .* loader.skip\(\) was not called "
        r"alike on ranks 0 and 1",
    ):
        merge_states([dl.state_dict() for dl in two])


def test_bad_skips_are_refused_and_change_nothing():
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=False, grad_accum=2, collate_fn=list)
    it = iter(dl)
    next(it)
    with pytest.raises(ValueError, match=r"skip\(\) in the middle of an optimizer update"):
        dl.skip(updates=1)
    next(it)  # the update is complete: positions [0, 8) are committed
    dl.skip(positions=[20, 21])
    before = dl.state_dict()
    for kw, message in [
        ({"positions": [-1]}, r"positions must be in epoch 0's \[0, 40\)"),
        ({"positions": [30.5]}, r"positions must be one or more ints"),
        ({"positions": []}, r"positions must be one or more ints"),
        ({"positions": range(39, 41)}, r"positions must be in epoch 0's \[0, 40\)"),
        ({"positions": [5, 30]}, r"positions \[5, 6\) of epoch 0 are already committed \(trained"),
        ({"positions": [21]}, r"positions \[21, 22\) of epoch 0 are already committed \(trained, or skipped before"),
        ({"updates": 5}, r"epoch 0 has 30 positions left, 4 updates of 8 at most"),
        ({"updates": range(2, 1)}, r"pass a positive int or a non-empty range"),
        ({"updates": -1}, r"pass a positive int or a non-empty range"),
        ({}, r"takes updates= .*, positions= .* or indices= .*, one of them"),
        ({"updates": 1, "positions": [30]}, r"one of them"),
        ({"indices": [30], "positions": [30]}, r"one of them"),
        ({"indices": [40]}, r"dataset indices must be in \[0, 40\) \(epoch 0's dataset\)"),
        ({"indices": [-1, 30]}, r"dataset indices must be in \[0, 40\)"),
        ({"indices": [30.0]}, r"dataset indices must be one or more ints"),
        ({"indices": []}, r"dataset indices must be one or more ints"),
        (
            {"indices": [30, 5, 21, 6]},
            r"dataset indices \[5, 6, 21\] of epoch 0 are already committed \(trained, or "
            r"skipped before\)",
        ),
        ({"updates": 1, "epoch": -1}, r"epochs before 0 are finished"),
    ]:
        with pytest.raises(ValueError, match=message):
            dl.skip(**kw)
    assert dl.state_dict() == before
    assert [i for batch in dl for i in batch] == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19] + list(range(22, 40))


OUT_OF_THE_EPOCH = {  # numbers that int64 or uint64 arithmetic would wrap into the epoch [0, 40), or past its checks
    "int64 max": [2**63 - 1],
    "int64 max, int64": np.array([2**63 - 1]),
    "2**63, uint64": np.array([2**63], np.uint64),
    "uint64 max": np.array([2**64 - 1], np.uint64),
    "uint64 max in a list": [5, 2**64 - 1],
    "2**64": [2**64],
    "2**70 alone": 2**70,
    "a range past int64": range(39, 2**64),
    "a range below 0": range(-1, 2),
    "-1, int8": np.array([-1], np.int8),
    "-2**63": [-(2**63)],
    "the epoch's end": [40],
    "40, uint16": np.array([40], np.uint16),
    "41, a torch tensor": torch.tensor([41]),
}
NOT_INTS = {
    "a bool": [True],
    "bools and ints": [True, 30],
    "a bool array": np.array([True, False]),
    "a float": [30.0],
    "a float array": np.array([30.0]),
    "nan": [float("nan")],
    "a string": ["30"],
    "nothing": [],
    "an empty range": range(30, 30),
    "an empty array": np.array([], np.int64),
}


def test_positions_and_indices_outside_the_epoch_are_refused_whatever_their_type_and_legal_ones_of_any_dtype_skip():
    """Each refused naming the bound (ints out of [0, n): int64 or uint64 would wrap them into it) or the type
    (bools, floats), nothing changed; then skips of several int dtypes and the next updates, and the epoch: each
    index trained once or recorded as skipped once."""
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=0, grad_accum=2, collate_fn=list)
    it = iter(dl)
    trained = next(it) + next(it)  # one update: 8 positions committed
    before = dl.state_dict()
    for keyword, name in (
        ("positions", r"positions must be in epoch 0's \[0, 40\)"),
        ("indices", r"dataset indices must be in \[0, 40\) \(epoch 0's dataset\)"),
    ):
        for value in OUT_OF_THE_EPOCH.values():
            with pytest.raises(ValueError, match=rf"skip\({keyword}=\.\.\.\): {name}, got .* \(from -?\d+ to -?\d+\)"):
                dl.skip(**{keyword: value})
        for value in NOT_INTS.values():
            with pytest.raises(ValueError, match=rf"skip\({keyword}=\.\.\.\): .* must be one or more ints"):
                dl.skip(**{keyword: value})
    for updates in (2**63, np.uint64(2**64 - 1), np.int64(-1), range(2**63, 2**64), True, 1.0):
        with pytest.raises(ValueError, match=r"skip\(updates=.*\): (epoch 0 has 32 positions left|pass a positive)"):
            dl.skip(updates=updates)
    assert dl.state_dict() == before

    skipped = indices([dl], 0, dl.skip(positions=np.array([39, 38], np.uint64)))
    for legal in (np.array([[30, 31]], np.int8), torch.tensor([20]), [np.int16(12)]):
        skipped += indices([dl], 0, dl.skip(positions=legal))
    by_index = [i for i in range(40) if i not in trained + skipped][:2]
    dl.skip(indices=np.array(by_index, np.uint32))
    skipped += by_index + indices([dl], 0, dl.skip(updates=np.int32(1)))
    recorded = merge_states([dl.state_dict()])["skipped"][0][1]
    assert sum(b - a for a, b in zip(recorded[::2], recorded[1::2])) == len(skipped) == 6 + 2 + 8
    trained += [i for batch in dl for i in batch]
    assert_exactly_once(trained, skipped, n=40)


def test_a_spiked_steps_indices_are_skipped_by_index_every_other_sample_once_at_another_world_size():
    """The audit and the ledger list dataset indices. A user rewinds to the checkpoint before the spike and skips
    the spiked step's indices, and a few others far ahead, by index (shuffle=True): exactly those are skipped on
    request, every other index of the epoch is trained once, at another world size."""
    _, spike = served_updates(ranks_of(4), 2)  # step 2 spiked: its indices, as the ledger records them
    four = ranks_of(4)
    trained = train(four, 1)
    state = merge_states([dl.state_dict() for dl in four])  # the checkpoint of step 1
    three = ranks_of(3, state)  # rewound to step 1, at 3 ranks
    ahead = indices(three, 0, [[150, 153]])
    spans = skip_all(three, indices=spike + ahead)
    assert spans.tolist() == [[G, 2 * G], [150, 153]]  # step 2's positions and those ahead, found by index
    trained += train(three)
    assert_exactly_once(trained, spike + ahead)
    final = merge_states([dl.state_dict() for dl in three])
    assert final["skipped"] == [[0, [G, 2 * G, 150, 153]]]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), max_size=8),
    seed=st.integers(0, 2**63),
    epoch=st.integers(0, 10**6),
    mode=st.sampled_from(["none", "global", "blocks"]),
    lanes=st.none() | st.tuples(st.integers(1, 7), st.integers(1, 9)),
)
def test_the_position_of_an_index_inverts_the_epoch_order(sizes, seed, epoch, mode, lanes):
    """skip(indices=) finds positions through the order's inverse: every position of the epoch back from its index,
    for each shuffle mode (blocks with empty ones too), with lanes or without."""
    n = sum(sizes)
    order = Order(n, seed, mode, tuple(sizes) if mode == "blocks" else None, lanes and Lanes(*lanes))
    at = order.for_epoch(epoch)
    positions = np.arange(n, dtype=np.int64)
    assert np.array_equal(at.positions_of(at(positions)), positions)


def test_the_inverse_costs_what_the_indices_cost_at_1e12():
    rng = np.random.default_rng(0)
    for order in (Order(10**12, 5), Order(10**12, 5, "blocks", (4 * 10**11, 6 * 10**11), Lanes(8, 1000))):
        at = order.for_epoch(3)
        positions = rng.integers(0, 10**12, 1000)
        assert np.array_equal(at.positions_of(at(positions)), positions)


def test_the_skipped_set_survives_a_resume_and_a_corrupted_one_is_refused():
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=False, collate_fn=list)
    dl.skip(positions=range(4, 12), epoch=1)  # an epoch ahead: skipped when it comes
    state = dl.state_dict()
    restored = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=False, collate_fn=list)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert [i for batch in restored for i in batch] == list(range(40))
    assert [i for batch in restored for i in batch] == list(range(4)) + list(range(12, 40))
    merged = merge_states([state])
    for bad, message in [
        ({**merged, "skipped": [[0, [50, 60]]]}, r"skipped\[epoch 0\] must be sorted"),
        ({**merged, "skipped": [[1, [0, 30]]]}, r"skipped\[epoch 1\] holds positions its committed"),
        ({**merged, "skipped": [[7]]}, r"skipped entries must be \[epoch, intervals\]"),
    ]:
        with pytest.raises(StateError, match=message):
            ResumableDataLoader(IndexDataset(40), batch_size=4).load_state_dict(bad)


def test_the_audit_reports_skips_on_request_in_their_own_column(tmp_path, capsys):
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=1, collate_fn=list)
    dl.ledger = Ledger.open(tmp_path, 0, 40)
    it = iter(dl)
    for _ in range(3):
        next(it)
    spans = dl.skip(updates=2)
    skipped = indices([dl], 0, spans)
    for _ in dl:
        pass
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    assert audit_main(str(tmp_path), describe=str) == 0
    out = capsys.readouterr().out
    assert "skipped on request" in out.splitlines()[0]
    row = out.splitlines()[1].split()
    assert row[:4] == ["0", "finished", "40", "32"] and row[-2:] == ["8", "0"]  # skipped on request, filtered
    assert f"skipped on request (never served, not trained): {', '.join(map(str, sorted(skipped)))}" in out


def _skip_job(rank, world_size, prebuilt):
    """Two updates, a skip alike on every rank and the checkpoint's gather of the progress; then a skip that
    differs on rank 1, and the gather again. First, a skip on a loader built before the group (so as rank 0 of 1):
    the updates it names are those of the group's world size."""
    from loader.checkpoint.save import global_progress

    first = prebuilt.skip(updates=1).tolist()
    dl = ranks_of(world_size)[rank]
    it = iter(dl)
    trained = [i for _ in range(2 * dl.grad_accum) for i in next(it)]
    spans = dl.skip(updates=2).tolist()
    progress = global_progress(dl)
    dl.skip(updates=1 + rank)
    try:
        global_progress(dl)
    except StateError as err:
        return trained, spans, progress, str(err), first
    return trained, spans, progress, None, first


@pytest.mark.slow
def test_over_a_gloo_group_a_skip_is_gathered_alike_and_a_divergent_one_names_the_rank():
    prebuilt = ResumableDataLoader(IndexDataset(N), batch_size=B, shuffle=True, seed=3, grad_accum=6)  # no group yet
    results = run_group(_skip_job, 2, prebuilt)
    assert all(r[4] == [[0, G]] for r in results)  # an update of the 2 ranks (G), not of 1 rank (G / 2)
    progress = results[0][2]
    assert results[1][2] == progress and progress["skipped"] == [[0, [2 * G, 4 * G]]]
    three = ranks_of(3, progress)
    trained = results[0][0] + results[1][0] + train(three)
    assert_exactly_once(trained, indices(three, 0, results[0][1]))
    for rank, (_, _, _, error, _) in enumerate(results):
        assert f"(rank {1 - rank}) started from another progress than this rank" in error
        assert "call loader.skip() alike" in error


@settings(max_examples=80, deadline=None)
@given(n=st.integers(13, 120), seed=st.integers(0, 2**32), data=st.data())
def test_any_skips_at_any_world_sizes_keep_every_index_exactly_once(n, seed, data):
    """Phases at world sizes 1-4 (the global batch 12 kept), each training some updates and skipping some updates,
    or uncommitted positions of the epoch by position or by dataset index: every index trained once, skipped on
    request once, or dropped by the tail rule once."""
    state, trained, skipped = None, [], []
    for _ in range(data.draw(st.integers(1, 4), label="phases")):
        ranks = ranks_of_world(data.draw(st.sampled_from([1, 2, 3, 4]), label="world"), n, seed, state)
        trained += train(ranks, data.draw(st.integers(0, 3), label="updates"))
        state = merge_states([dl.state_dict() for dl in ranks])
        if state["epoch"] > 0:
            break
        flat = state["committed"][0][1] if state["committed"] else []
        left = [p for p in range(n) if not any(a <= p < b for a, b in zip(flat[::2], flat[1::2]))]
        if data.draw(st.booleans(), label="skip"):
            by = data.draw(st.sampled_from(["updates", "positions", "indices"]), label="by")
            if by == "updates":
                last = (len(left) - 1) // 12
                spans = skip_all(ranks, updates=range(data.draw(st.integers(0, last), label="from"), last + 1))
            else:
                chosen = data.draw(st.lists(st.sampled_from(left), min_size=1), label="p")
                spans = skip_all(ranks, **{by: chosen if by == "positions" else indices(ranks, 0, spans_of(chosen))})
                assert np.array_equal(spans, spans_of(chosen))  # by index: at the positions the order puts them
            skipped += indices(ranks, 0, spans)
            state = merge_states([dl.state_dict() for dl in ranks])
    event(f"skipped some: {bool(skipped)}; the epoch left to finish: {state['epoch'] == 0}")
    if state["epoch"] == 0:
        ranks = ranks_of_world(1, n, seed, state)
        trained += train(ranks)
        state = merge_states([dl.state_dict() for dl in ranks])
    dropped = state["finished"][0]["dropped"]
    assert_exactly_once(trained + (indices(ranks, 0, dropped) if dropped else []), skipped, n)


def ranks_of_world(world, n, seed, state):
    """Ranks of batch size 1 and the global batch 12 over n indices, from `state` if given."""
    ranks = [
        ResumableDataLoader(
            IndexDataset(n),
            batch_size=1,
            shuffle=True,
            seed=seed,
            rank=r,
            world_size=world,
            grad_accum=12 // world,
            collate_fn=list,
        )
        for r in range(world)
    ]
    for dl in ranks:
        if state is not None:
            dl.load_state_dict(copy.deepcopy(state))
    return ranks
