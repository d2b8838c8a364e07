"""Mutated stream states (one rank's and merged multi-rank ones; streams without state, with an iterator state,
sharded) are refused with a short StateError, never another exception, leaving the loader as it was; or accepted,
and then the resumed pass serves exactly the records the state does not claim as delivered, each once.

What a state claims: per worker of a plain stream, the records up to where its snapshot stands (all of them when
it says its stream ended; else what its iterator's state or, without one, its batch count covers); for a sharded
stream, the shards and records its ranks' merged progress lists. Nothing, when the state's pass had ended: the next
pass serves the next epoch whole. The dataset's and iterator's own states are theirs to check (the loader hands
them back unchanged to their load_state_dict, as StatefulDataLoader does): mutations go everywhere else, and
replace a whole one with junk only where the stream keeps no such state.
"""

import copy
import itertools
import json
from dataclasses import dataclass
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, StateError, merge_states
from loader.sources.sharded import FileShards
from loader.streams.state import rank_streams, regathered
from tests.streams import FORK, IteratorState, Plain, ids

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")  # states carry random states (10 KB)
N, BATCH, SHARD_SIZES = 20, 2, [3, 0, 5, 2]


def read_lines(path):
    with open(path) as lines:
        yield from lines


def plain(kind, rank=0, world=1, **kw):
    return ResumableDataLoader(kind(N, random_draws=True), batch_size=BATCH, collate_fn=list, rank=rank,
                               world_size=world, **kw)


def sharded(paths, rank=0, world=1, **kw):
    return ResumableDataLoader(FileShards(paths, read_lines), batch_size=BATCH, collate_fn=list, rank=rank,
                               world_size=world, shuffle=True, **kw)


@dataclass
class Case:
    state: dict
    fresh: Callable  # rank -> a loader that accepts the state
    ranks: list  # the ranks that resume it (all of them: the records of every rank are counted)
    keeps_iterator: bool  # the stream's iterator has a state (whose contents are its own to check)

    def claimed(self, state) -> list:
        """The records `state` says were delivered, in the epoch its resumed pass serves."""
        ranks = rank_streams(state)
        if ranks[0].shards is not None:
            progress, serves, over = regathered(ranks)
            if serves < progress.epoch:  # every record of the epoch it serves was read: a pass with nothing left
                return [] if over else self.records()
            epoch = progress.of(serves)
            reads = {**{s: SHARD_SIZES[s] for s in epoch.done}, **epoch.offsets}  # an offset may pass the end
            return [f"{s}:{r}\n" for s, count in reads.items() for r in range(min(count, SHARD_SIZES[s]))]
        mine = ranks[self.ranks[0]]
        if mine.ended:
            return []
        claimed = []
        for w, snapshot in enumerate(mine.workers):
            share = list(range(w, N, len(mine.workers)))
            if snapshot is None:
                continue
            covered = (len(share) if snapshot["ended"] else snapshot["iterator"]["i"]
                       if snapshot["iterator"] is not None else snapshot["batches"] * BATCH)
            claimed += share[:covered]
        return claimed

    def records(self) -> list:
        if self.ranks == [0, 1, 2]:
            return sorted(f"{s}:{r}\n" for s, count in enumerate(SHARD_SIZES) for r in range(count))
        return list(range(N))

    def served(self, loaders) -> list:
        delivered = [record for dl in loaders for batch in dl for record in batch]
        return delivered if self.ranks == [0, 1, 2] else ids([delivered])


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    directory = tmp_path_factory.mktemp("shards")
    paths = []
    for s, n in enumerate(SHARD_SIZES):
        (directory / f"{s}.txt").write_text("".join(f"{s}:{r}\n" for r in range(n)))
        paths.append(str(directory / f"{s}.txt"))

    def run(loaders, steps, passes_before=0):
        for dl, count in zip(loaders, steps):
            for _ in range(passes_before):
                list(dl)
            list(itertools.islice(dl, count))
        states = [dl.state_dict() for dl in loaders]
        return json.loads(json.dumps(states[0] if len(states) == 1 else merge_states(states)))

    def case(kind, loaders, steps, fresh, ranks=(0,), passes_before=0):
        return Case(run(loaders, steps, passes_before), fresh, list(ranks), kind is IteratorState)

    def resized():
        """A state whose base lists finished shards: saved at 2 ranks after a resume of 3 ranks' state."""
        state = run([sharded(paths, r, 3) for r in range(3)], [2, 1, 0])  # rank 0 reads past its first shard
        again = [sharded(paths, r, 2) for r in range(2)]
        for dl in again:
            dl.load_state_dict(state)
        return run(again, [1, 1])

    workers = dict(num_workers=2, **FORK)
    return {
        "no state, main process, second epoch": case(Plain, [plain(Plain)], [3], lambda r: plain(Plain),
                                                     passes_before=1),
        "no state, 2 workers": case(Plain, [plain(Plain, **workers)], [3], lambda r: plain(Plain, **workers)),
        "iterator state, main process": case(IteratorState, [plain(IteratorState)], [3],
                                             lambda r: plain(IteratorState)),
        "iterator state, 2 workers": case(IteratorState, [plain(IteratorState, **workers)], [3],
                                          lambda r: plain(IteratorState, **workers)),
        "iterator state, 2 ranks": case(IteratorState, [plain(IteratorState, r, 2) for r in range(2)], [2, 1],
                                        lambda r: plain(IteratorState, r, 2), ranks=[1]),
        "sharded, 2 ranks, 2 workers": case(
            None, [sharded(paths, r, 2, **workers) for r in range(2)], [2, 1],
            lambda r: sharded(paths, r, 3), ranks=[0, 1, 2],  # another world size: the shards are dealt again
        ),
        "sharded, resized once": Case(resized(), lambda r: sharded(paths, r, 3), [0, 1, 2], False),  # and again
    }


def paths_of(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths_of(item, prefix + (i,))


PAYLOADS = ("dataset", "iterator")  # a snapshot's fields that hold the stream's own states
GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**62, 2**64, -(2**63)]), st.floats(),
    st.text(max_size=4), st.lists(st.integers(-1, 5), max_size=4), st.dictionaries(st.text(max_size=3), st.integers()),
    st.just("AAAA"),
)


HEADER = ("format", "version", "kind")  # refused by a plain comparison: mutated rarely, to reach the rest


@st.composite
def mutations(draw, case):
    """1-3 of: an int nudged or a bool flipped, a field replaced by garbage, an entry deleted or duplicated; the
    header rarely. Never inside the stream's own states (see the module docstring)."""
    state = copy.deepcopy(case.state)
    pick = draw(st.randoms(use_true_random=False)).choice  # uniform over the fields: no bias to the first ones
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in list(paths_of(state))[1:] if not any(key in PAYLOADS for key in p[:-1])]
        action = draw(st.sampled_from(["nudge"] * 3 + ["replace"] * 2 + ["delete", "duplicate", "header"]))
        if action == "header":
            paths, action = [p for p in paths if p[-1] in HEADER] or paths, "replace"
        else:
            paths = [p for p in paths if p[-1] not in HEADER]
        if not paths:
            break
        path = pick(paths)
        parent = state
        for key in path[:-1]:
            parent = parent[key]
        value = parent[path[-1]]
        if action == "nudge" and isinstance(value, bool):
            parent[path[-1]] = not value
        elif action == "nudge" and isinstance(value, int):
            parent[path[-1]] = value + draw(st.sampled_from([-3, -2, -1, 1, 2, 3, N]))
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "duplicate" and isinstance(parent, list):
            parent.insert(draw(st.integers(0, len(parent))), copy.deepcopy(value))
        elif path[-1] == "iterator" and case.keeps_iterator:
            parent[path[-1]] = None  # the worker then reads its share again up to its batch count
        else:
            parent[path[-1]] = draw(GARBAGE)
    return state


@pytest.mark.parametrize("name", ["no state, main process, second epoch", "no state, 2 workers",
                                  "iterator state, main process", "iterator state, 2 workers",
                                  "iterator state, 2 ranks", "sharded, 2 ranks, 2 workers",
                                  "sharded, resized once"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_stream_state_is_refused_or_resumes_exactly(cases, name, data):
    case = cases[name]
    mutated = data.draw(mutations(case))
    dl = case.fresh(case.ranks[0])
    before = dl.state_dict()
    try:
        dl.load_state_dict(mutated)
    except StateError as err:
        assert len(str(err)) < 600, "a state error is a short message"
        assert dl.state_dict() == before, "a refused state leaves the loader unchanged"
        return
    loaders = [dl] + [case.fresh(rank) for rank in case.ranks[1:]]
    for other in loaders[1:]:
        other.load_state_dict(mutated)
    served, claimed = case.served(loaders), case.claimed(mutated)
    assert sorted(served + claimed) == case.records(), "the resumed pass skipped or repeated a record"


def test_the_real_states_resume_exactly(cases):
    for name, case in cases.items():
        loaders = [case.fresh(rank) for rank in case.ranks]
        for dl in loaders:
            dl.load_state_dict(case.state)
        served, claimed = case.served(loaders), case.claimed(case.state)
        assert claimed and served and sorted(served + claimed) == case.records(), name


def test_a_field_that_may_be_one_of_two_types_names_both_when_it_is_neither():
    dl = ResumableDataLoader(list(range(10)), batch_size=2)
    state = dl.state_dict()
    state["base"] = {**state["base"], "end_of_epoch": "yes"}
    with pytest.raises(StateError, match="end_of_epoch must be of type dict or NoneType, got 'yes'"):
        ResumableDataLoader(list(range(10)), batch_size=2).load_state_dict(state)


# -- what the fuzzer found, one plain test each -------------------------------------------------------------------------


def saved(kind=Plain, **kw):
    dl = plain(kind, **kw)
    list(itertools.islice(dl, 2))
    return json.loads(json.dumps(dl.state_dict()))


def refused_unchanged(dl, state, message):
    before = dl.state_dict()
    with pytest.raises(StateError, match=message):
        dl.load_state_dict(state)
    assert dl.state_dict() == before


@pytest.mark.parametrize("field", ["workers", "origins"])
def test_an_iterator_state_for_a_stream_without_state_is_refused_on_load(field):
    state = saved(num_workers=2, **FORK)
    state[field][1] = {**state["workers"][1], "iterator": 3}  # once accepted: an AttributeError in the worker
    refused_unchanged(plain(Plain, num_workers=2, **FORK), state,
                      rf"rank 0: {field}\[1\] holds an iterator state, but Plain.__iter__ is a generator, which "
                      rf"keeps none")


class Listed(Plain):
    """Its __iter__ is no generator function, but returns an iterator without state."""

    def __iter__(self):
        return iter(list(super().__iter__()))


def test_an_iterator_state_the_iterator_cannot_load_is_refused_when_the_stream_is_read():
    state = saved(Listed)
    state["workers"][0]["iterator"] = {"i": 1}
    dl = plain(Listed)
    dl.load_state_dict(state)  # whether Listed's iterator keeps a state shows only when it is made
    with pytest.raises(StateError, match=r"iterator state for worker 0, but the iterator Listed.__iter__ returns "
                                         r"\(list_iterator\) has no load_state_dict"):
        iter(dl)


class Sized(Plain):
    def __len__(self):
        return self.n


class Versioned(Plain):
    version = "a"

    def fingerprint(self):
        return f"records v{self.version}"


class Numbered(Plain):
    def fingerprint(self):
        return 7


def test_a_state_of_another_stream_of_the_same_layout_is_refused_naming_what_differs():
    refused_unchanged(plain(IteratorState), saved(Plain),
                      "the state of rank 0: stream.class is 'tests.streams.Plain' in the saved state but "
                      "'tests.streams.IteratorState' in this loader: construct the loader with the stream class")
    state = saved(Sized)
    grown = ResumableDataLoader(Sized(N + 1), batch_size=BATCH, collate_fn=list)
    refused_unchanged(grown, state, f"stream.length is {N} in the saved state but {N + 1} in this loader")
    state = saved(Versioned)
    Versioned.version = "b"
    try:
        refused_unchanged(plain(Versioned), state, "stream.fingerprint is 'records va' in the saved state but "
                                                   "'records vb'")
    finally:
        Versioned.version = "a"
    with pytest.raises(TypeError, match=r"Numbered.fingerprint\(\) must return a str, got 7"):
        saved(Numbered)
    older = {key: value for key, value in saved(Plain).items() if key != "stream"}  # saved before it was recorded
    dl = plain(Plain)
    dl.load_state_dict(older)
    assert ids(list(dl)) == list(range(2 * BATCH, N))


def test_a_merged_state_must_agree_with_its_ranks_and_have_no_unknown_fields():
    states = [saved(Plain, rank=r, world=2) for r in range(2)]
    merged = merge_states(states)
    refused_unchanged(plain(Plain, 1, 2), {**merged, "world_size": 3},
                      "state.world_size is 3, but it holds the states of 2 ranks")
    refused_unchanged(plain(Plain, 1, 2), {**merged, "extra": 1}, "state must have exactly the fields")
    refused_unchanged(plain(Plain), {**states[0], "world_size": 1, "rank": 0, "extra": 1},
                      r"states\[0\] has unknown fields \['extra'\]")
