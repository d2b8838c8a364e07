"""Corrupted states: thousands of mutations of real states are accepted or refused with a short StateError.

Every leaf of a real state is replaced by ints of every size, bools, floats, strings, None, lists or dicts, or
nudged by a few units; keys and entries are deleted, duplicated, swapped and reordered. Whatever comes out,
`load_state_dict` and `merge_states` accept it or raise a StateError of a few lines: never another exception. A
refused state leaves the loader as it was. An accepted one leaves a loader whose own state loads again and that
serves exactly the uncommitted rest of the state's epoch, never a position the state lists as committed; merged
rank states commit their base's positions plus what the ranks delivered, as the partition counts it.
"""

import copy
import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import EpochPlan, Layout, Order, ResumableDataLoader, StateError, merge_states
from loader.core.state import progress_of
from tests.conftest import IndexDataset

N, SEED = 53, 1
CHECKER = dict(batch_size=5, shuffle=True, seed=SEED)  # the loader every mutated state is loaded into


def _loaders(world, **kw):
    return [
        ResumableDataLoader(IndexDataset(N), shuffle=True, seed=SEED, rank=r, world_size=world, **kw)
        for r in range(world)
    ]


def _deliver(dl, count):
    for _ in zip(range(count), dl):
        pass
    return dl


def one_rank_mid_epoch():
    return _deliver(ResumableDataLoader(IndexDataset(N), **CHECKER), 3).state_dict()


def merged_with_holes():
    """Four ranks that stopped after unequal numbers of batches: holes in the committed intervals."""
    ranks = [_deliver(dl, count) for dl, count in zip(_loaders(4, batch_size=2), (5, 3, 4, 1))]
    return merge_states([dl.state_dict() for dl in ranks], uneven=True)


def merged_accumulating_past_a_finished_epoch():
    """grad_accum 2 and drop_last: epoch 0 finished with dropped positions, epoch 1 reached unevenly."""
    ranks = _loaders(4, batch_size=2, grad_accum=2, drop_last=True)
    for dl, count in zip(ranks, (4, 2, 6, 0)):
        _deliver(dl, len(dl) + 1)  # and the StopIteration
        _deliver(dl, count)
    return merge_states([dl.state_dict() for dl in ranks], uneven=True)


def rank_states_sharing_a_base_with_holes():
    """The list of all ranks' states of a lockstep run resumed from progress with holes."""
    ranks = _loaders(4, batch_size=3)
    for dl in ranks:
        dl.load_state_dict(merged_with_holes())
        _deliver(dl, 2)
    return [dl.state_dict() for dl in ranks]


def one_rank_at_the_end_of_a_pass():
    dl = ResumableDataLoader(IndexDataset(N), **CHECKER)
    list(dl)
    return dl.state_dict()


def rank_states_past_a_base_with_holes_in_two_epochs():
    """Lockstep ranks resumed from progress in two epochs (its rank 0 had moved on to epoch 1) and past both."""
    first = _loaders(4, batch_size=2)
    _deliver(first[0], len(first[0]) + 1)  # and the StopIteration
    for dl, count in zip(first, (2, 3, 1, 2)):
        _deliver(dl, count)
    base = merge_states([dl.state_dict() for dl in first], uneven=True)
    assert [epoch for epoch, _ in base["committed"]] == [0, 1]
    ranks = _loaders(4, batch_size=3)
    for dl in ranks:
        dl.load_state_dict(base)
        list(dl)  # the rest of epoch 0
        _deliver(dl, 1)
    return [dl.state_dict() for dl in ranks]


def merged_at_the_end_of_an_epoch():
    return merge_states([one_rank_at_the_end_of_a_pass()])


SOURCES = {
    "one rank mid-epoch": one_rank_mid_epoch,
    "merged, 4 ranks with holes": merged_with_holes,
    "merged, grad_accum 2, a finished epoch with drops": merged_accumulating_past_a_finished_epoch,
    "list of 4 rank states": rank_states_sharing_a_base_with_holes,
    "list of 4 rank states past a base with progress in two epochs": rank_states_past_a_base_with_holes_in_two_epochs,
    "one rank at the end of a pass": one_rank_at_the_end_of_a_pass,
    "merged, end of an epoch": merged_at_the_end_of_an_epoch,
}


@functools.cache
def real_state(name):
    return SOURCES[name]()


# -- mutations --------------------------------------------------------------------------------------------------------

JUNK = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, N, N + 1, 2**31, 2**53 + 1, 2**62 - 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63)]),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.none(),
    st.lists(st.integers(-3, N + 3), max_size=6),
    st.dictionaries(st.sampled_from(["epoch", "ended", "digest", "x"]), st.integers(-2, 3), max_size=2),
)


def _nodes(root) -> list[tuple[tuple, object]]:
    """Every (path, node) of a state, the root included."""
    found, stack = [], [((), root)]
    while stack:
        path, node = stack.pop()
        found.append((path, node))
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((path + (key,), child) for key, child in children)
    return found


def _at(root, path):
    for key in path:
        root = root[key]
    return root


def _set(root, path, value):
    if not path:
        return value
    _at(root, path[:-1])[path[-1]] = value
    return root


HEADER = ("format", "version", "kind")  # refused by a plain comparison: mutated rarely, to reach the rest


def mutate(data, state):
    """One mutation of `state` (changed in place where it can be; the result is returned)."""
    nodes = _nodes(state)
    fields = [(path, value) for path, value in nodes if not path or path[-1] not in HEADER]
    operation = data.draw(
        st.sampled_from(["nudge"] * 3 + ["replace"] * 2 + ["delete", "duplicate", "swap", "reverse", "header"])
    )
    if operation == "header":
        fields = [(path, value) for path, value in nodes if path and path[-1] in HEADER] or fields
        operation = "replace"
    if operation == "nudge":
        ints = [(path, value) for path, value in fields if isinstance(value, int)]
        if ints:
            path, value = data.draw(st.sampled_from(ints))
            return _set(state, path, value + data.draw(st.sampled_from([-5, -2, -1, 1, 2, 3, 8, N])))
        operation = "replace"
    if operation == "replace":
        path, _ = data.draw(st.sampled_from(fields))
        return _set(state, path, data.draw(JUNK))
    containers = [(path, value) for path, value in nodes if isinstance(value, (dict, list)) and value]
    if not containers:
        return state
    path, container = data.draw(st.sampled_from(containers))
    keys = list(container) if isinstance(container, dict) else list(range(len(container)))
    if operation == "delete":
        del container[data.draw(st.sampled_from(keys))]
    elif operation == "duplicate" and isinstance(container, list):
        item = container[data.draw(st.sampled_from(keys))]
        container.insert(data.draw(st.integers(0, len(container))), copy.deepcopy(item))
    elif operation == "reverse" and isinstance(container, list):
        container.reverse()
    elif len(keys) > 1:  # swap two entries (of a dict: two fields' values)
        a = data.draw(st.sampled_from(keys))
        b = data.draw(st.sampled_from([key for key in keys if key != a]))
        container[a], container[b] = container[b], container[a]
    return state


def mutated(data, name):
    """A mutated copy of a real state. The ranks' states of a list have a base dict each, or share one, as a
    process's states do, so that one corrupted base reaches them all."""
    state = json.loads(json.dumps(real_state(name)))
    if isinstance(state, list) and data.draw(st.booleans()):
        for other in state[1:]:
            other["base"] = state[0]["base"]
    for _ in range(data.draw(st.integers(1, 3))):
        state = mutate(data, state)
    return state


# -- properties -------------------------------------------------------------------------------------------------------


def assert_short(err: StateError):
    message = str(err)
    assert len(message) <= 400 and message.count("\n") <= 2, f"a long message ({len(message)} chars): {message[:200]}"


def positions(flat) -> np.ndarray:
    spans = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    return np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])


def listed_committed(state) -> dict[int, np.ndarray]:
    """Positions per epoch that the state itself lists as committed (a rank state's: those of its base)."""
    listed = {}
    for one in state if isinstance(state, list) else [state]:
        progress = one["base"] if one.get("kind") == "rank" else one
        for epoch, flat in progress["committed"]:
            listed[epoch] = np.union1d(listed.get(epoch, []), positions(flat)).astype(np.int64)
    return listed


def count(flat) -> int:
    spans = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    return int((spans[:, 1] - spans[:, 0]).sum())


def committed_counts(progress) -> dict[int, int]:
    """Committed positions per epoch of a global state: its committed intervals, or all but the dropped ones."""
    n = progress["fingerprint"]["num_samples"]
    counts = {record["epoch"]: n - count(record["dropped"]) for record in progress["finished"]}
    counts.update((epoch, count(flat)) for epoch, flat in progress["committed"])
    return counts


def check_merged_counts(states, merged):
    """Per epoch the ranks walked, the merge commits the base's positions plus what each rank delivered, counted
    from the partition alone (EpochPlan), not from the merge's intervals."""
    ranks = states if isinstance(states, list) else [states]
    first = {}
    for r in ranks:  # a rank's state given twice (replicas under a mesh, or a duplicated entry) counts once
        first.setdefault(r["rank"], r)
    ranks = [first[rank] for rank in sorted(first)]
    base, layout = ranks[0]["base"], Layout(**ranks[0]["layout"])
    before, after = committed_counts(base), committed_counts(merged)
    for epoch in range(base["epoch"], max(r["epoch"] for r in ranks) + 1):
        plan = EpochPlan(base["fingerprint"]["num_samples"] - before.get(epoch, 0), layout)
        done = [
            plan.batches_per_rank if r["epoch"] > epoch else r["completed"] if r["epoch"] == epoch else 0 for r in ranks
        ]
        if len(ranks) == 1:  # one rank's state stands for every rank
            done *= layout.world_size
        numbers = range(layout.world_size) if len(ranks) == 1 else [r["rank"] for r in ranks]
        delivered = sum(plan.samples_from(rank, 0) - plan.samples_from(rank, d) for rank, d in zip(numbers, done))
        assert after.get(epoch, 0) == before.get(epoch, 0) + delivered, f"epoch {epoch} merged wrong"


def check_load(state):
    dl = ResumableDataLoader(IndexDataset(N), **CHECKER)
    dl.load_state_dict(real_state("one rank mid-epoch"))  # a loader that has delivered batches
    before, length = dl.state_dict(), len(dl)
    try:
        dl.load_state_dict(state)
    except StateError as err:
        assert_short(err)
        assert dl.state_dict() == before and len(dl) == length, "a refused state changed the loader"
        return
    again = ResumableDataLoader(IndexDataset(N), **CHECKER)
    again.load_state_dict(dl.state_dict())  # what an accepted state leaves is itself a valid state
    progress = progress_of(state)
    if isinstance(state, list) or state["kind"] == "rank":
        check_merged_counts(state, progress.to_dict())
    if progress.end_of_epoch is False:  # the pass at the end of the epoch before had not ended: it ends empty
        assert [batch for batch in dl] == [] and dl.epoch == progress.epoch - 1
    served = [i for batch in dl for i in batch.tolist()]
    assert dl.epoch == progress.epoch, "a pass served another epoch than the state's"
    ids = Order(N, SEED, "global").for_epoch(progress.epoch)
    listed = listed_committed(state).get(progress.epoch, np.zeros(0, np.int64))
    assert not set(served) & set(ids(listed).tolist()), "a position the state lists as committed was served"
    committed = ids(positions(progress.committed_in(progress.epoch).reshape(-1).tolist())).tolist()
    assert sorted(served + committed) == list(range(N)), "one rank must serve the uncommitted rest exactly once"


def check_merge(states, uneven):
    try:
        merged = merge_states(states, uneven=uneven)
    except StateError as err:
        assert_short(err)
        return
    check_merged_counts(states, merged)
    check_load(merged)


@pytest.mark.parametrize("name", list(SOURCES))
@settings(max_examples=350, deadline=None)  # 2450 examples: seconds in CI
@given(data=st.data())
def test_a_mutated_state_is_accepted_whole_or_refused_with_a_short_state_error(name, data):
    state = mutated(data, name)
    if isinstance(state, list) and data.draw(st.booleans()):
        check_merge(state, uneven=data.draw(st.booleans()))
    else:
        check_load(state)


def test_the_real_states_themselves_are_accepted():
    for name in SOURCES:
        check_load(copy.deepcopy(real_state(name)))
    assert len(listed_committed(real_state("merged, 4 ranks with holes"))[0]) > 0
    assert any(len(flat) > 2 for _, flat in real_state("merged, 4 ranks with holes")["committed"])
    finished = real_state("merged, grad_accum 2, a finished epoch with drops")["finished"]
    assert finished[0]["epoch"] == 0 and len(positions(finished[0]["dropped"])) > 0
    assert real_state("one rank at the end of a pass")["ended"]
    assert real_state("merged, end of an epoch")["end_of_epoch"] == {"epoch": 0, "ended": True}
    assert len({id(s["base"]) for s in real_state("list of 4 rank states")}) == 4


# -- what the fuzzer and the size checks found, one plain test each ------------------------------------------------


def edited(state, path, value):
    state = json.loads(json.dumps(state))
    return _set(state, path, value)


def refused(state, message, *, load=True, uneven=False):
    """`state` (or the list of states) is refused with a short StateError matching `message`."""
    with pytest.raises(StateError, match=message) as caught:
        if load:
            ResumableDataLoader(IndexDataset(N), **CHECKER).load_state_dict(state)
        else:
            merge_states(state, uneven=uneven)
    assert_short(caught.value)


def test_a_field_of_the_wrong_type_among_several_allowed_is_named():
    refused(edited(one_rank_mid_epoch(), ("base", "end_of_epoch"), 0), "end_of_epoch must be of type dict or NoneType")


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("layout", "world_size"), list(range(10**5)), "layout.world_size must be a non-negative int, got \\[0, 1,"),
        (("layout", "x" * 10**5), 1, "layout must have exactly the fields"),
        (("format",), "x" * 10**6, "format is 'xxx"),
        (("kind",), "x" * 10**6, "kind is 'xxx"),
        (("base", "committed"), functools.reduce(lambda inner, _: [inner], range(10**5), []), "committed entries"),
    ],
)
def test_a_huge_or_deeply_nested_value_gives_a_short_message(path, value, message):
    refused(edited(one_rank_mid_epoch(), path, value), message)


@pytest.mark.parametrize("states", [iter([one_rank_mid_epoch()]), one_rank_mid_epoch(), []])
def test_merge_states_takes_a_list(states):
    refused(states, "merge_states takes a non-empty list of per-rank state dicts", load=False)


def test_a_layout_whose_global_batch_overflows_is_refused():
    state = edited(one_rank_mid_epoch(), ("layout", "batch_size"), 2**61)
    refused(edited(state, ("layout", "grad_accum"), 2**61), f"global batch of {2**122}")


def rank_states(world=4, **kw):
    """One fresh state per rank of a `world`-rank run, sharing one base dict (as a process's states do)."""
    states = [dl.state_dict() for dl in _loaders(world, batch_size=2, **kw)]
    return [{**s, "base": states[0]["base"]} for s in states]


def test_ranks_far_apart_are_refused_before_their_holes_are_enumerated():
    states = rank_states()
    states[0] = {**states[0], "base": edited(states[0]["base"], ("fingerprint", "num_samples"), 2**61)}
    for s in states[1:]:
        s["base"] = states[0]["base"]
    states[0]["completed"] = 2**40  # 8 TiB of batch numbers, were they enumerated
    refused(states, "differ by 1099511627776 or more .* beyond the 65536", load=False, uneven=True)
    states[0]["completed"] = 2**16  # as far apart as allowed: a merged state of about a megabyte
    merged = merge_states(states, uneven=True)
    assert len(merged["committed"][0][1]) == 2 * 2**16


def test_an_epoch_is_finished_only_after_every_earlier_one():
    """An epoch ahead with fewer samples left than ranks is done by every rank at once (none is dealt any), while
    the epoch before it is not finished: the merge once called both finished and made a state it refuses."""
    base = edited(merged_with_holes(), ("committed",), [[0, [0, 20]], [1, [0, N - 2]]])
    states = rank_states()
    for s in states:
        s["base"] = base
    states[0]["epoch"] = 1  # rank 0 finished its share of epoch 0; the others have not started theirs
    merged = merge_states(states, uneven=True)
    assert merged["epoch"] == 0 and [e for e, _ in merged["committed"]] == [0, 1]
    check_load(merged)


def test_each_epoch_with_progress_in_the_base_is_merged_from_its_own():
    """The merge computes the epochs its base committed nothing in once for all of them; an epoch with progress in
    the base from that progress (a cache keyed wrongly would hand it another epoch's positions)."""
    states = real_state("list of 4 rank states past a base with progress in two epochs")
    merged = merge_states(copy.deepcopy(states))
    assert merged["epoch"] == 1 and merged["finished"][0]["epoch"] == 0
    check_merged_counts(states, merged)  # epoch 1: the base's 4 positions and one micro-batch of 3 per rank
    assert committed_counts(merged)[1] == 4 + 4 * 3


@pytest.mark.parametrize(
    "finished, message",
    [
        ([{"epoch": 0, "dropped": [48, 53]}] * 2, "finished must list epochs before 1 in increasing order"),
        ([{"epoch": 1, "dropped": [48, 53]}], "finished must list epochs before 1 in increasing order"),
        ([{"epoch": e, "dropped": []} for e in range(10**5)], "finished has 100000 entries, more than the 10001"),
    ],
)
def test_finished_records_are_checked(finished, message):
    refused(edited(merged_accumulating_past_a_finished_epoch(), ("finished",), finished), message)


@pytest.mark.parametrize(
    "field, value", [("done_in_epoch", 11), ("samples_done_in_epoch", 27), ("samples_done_in_epoch", 4)]
)
def test_counts_done_in_the_epoch_beyond_its_committed_positions_are_refused(field, value):
    """Merged from ranks that committed 26 positions of epoch 0, 5 micro-batches (10 samples) at most per rank:
    more samples than positions, or fewer samples than micro-batches, is corruption."""
    message = "micro-batches and .* samples done in its epoch, which has 26 committed"
    refused(edited(merged_with_holes(), (field,), value), message)


def test_a_fingerprint_field_of_another_type_is_refused_though_equal():
    refused(edited(merged_with_holes(), ("fingerprint", "seed"), True), "seed is True in the saved state but 1")
    refused(edited(merged_with_holes(), ("fingerprint", "seed"), 1.0), "seed is 1.0 in the saved state but 1")


def test_large_states_are_accepted_or_refused_whole():
    """The sizes a state under a megabyte or so can reach: 1e5 holes, 1e4 epochs, a rank 1e4 epochs ahead."""
    holes = edited(merged_with_holes(), ("fingerprint", "num_samples"), 10**6)
    holes["committed"] = [[0, [v for i in range(10**5) for v in (3 * i, 3 * i + 1)]]]
    holes["done_in_epoch"] = holes["samples_done_in_epoch"] = 0
    assert len(progress_of(holes).committed[0]) == 10**5
    epochs = edited(holes, ("committed",), [[e, [0, 1]] for e in range(10_001)])
    assert len(progress_of(epochs).committed) == 10_001
    refused(edited(epochs, ("committed",), [[e, [0, 1]] for e in range(10_002)]), "committed has 10002 entries")
    refused(edited(epochs, ("committed",), [[10_001, [0, 1]]]), "committed entries must be \\[epoch in \\[0, 10000\\]")
    ahead = edited(one_rank_mid_epoch(), ("epoch",), 10_000)
    merged = merge_states([ahead])
    assert merged["epoch"] == 10_000 and len(merged["finished"]) == 10_000
    check_load(merged)
    refused(edited(ahead, ("epoch",), 10_001), "more than 10000 epochs after its base")
