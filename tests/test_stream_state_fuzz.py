"""Mutated stream states (one rank's and merged multi-rank ones; streams without state, with an iterator state,
sharded) are refused with a short StateError, never another exception, leaving the loader as it was; or accepted,
and then the resumed pass serves exactly the records the state does not claim as delivered, each once.

What a state claims: per worker of a plain stream, the records up to where its snapshot stands (all of them when
it says its stream ended; else what its iterator's state or, without one, its batch count covers); for a sharded
stream, the shards and records its ranks' merged progress lists. Nothing, when the state's pass had ended: the next
pass serves the next epoch whole. The progress the loader records (a worker's `ended` flag, batch count and shard
position, a rank's epoch and shard progress) is no claim a state can change on its own: nothing else in it says
whether a worker's stream ended, or that a sharded rank read its share of an epoch, so a state whose progress
differs from the saved one must be refused (it would drop or repeat records). The iterator's own state is its to
check: the loader asks it on load (its load_state_dict, on a copy), so junk there, or a field of it changed, is
refused on load or resumes as it says.
"""

import copy
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.streams as tests_streams
from loader import ResumableDataLoader, StateError, merge_states
from loader.sources.sharded import FileShards
from loader.streams.rng import rng_state
from loader.streams.state import checksum, rank_streams, regathered, snapshot_dict, snapshot_of
from tests.streams import FORK, IteratorState, Plain, ids

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")  # states carry random states (10 KB)
N, BATCH, SHARD_SIZES = 20, 2, [3, 0, 5, 2]


def read_lines(path):
    with open(path) as lines:
        yield from lines


def plain(kind, rank=0, world=1, **kw):
    return ResumableDataLoader(
        kind(N, random_draws=True), batch_size=BATCH, collate_fn=list, rank=rank, world_size=world, **kw
    )


def shard_files(directory) -> list:
    """SHARD_SIZES text files, one record ("shard:record") a line."""
    for s, n in enumerate(SHARD_SIZES):
        (directory / f"{s}.txt").write_text("".join(f"{s}:{r}\n" for r in range(n)))
    return [str(directory / f"{s}.txt") for s in range(len(SHARD_SIZES))]


def sharded(paths, rank=0, world=1, **kw):
    return ResumableDataLoader(
        FileShards(paths, read_lines),
        batch_size=BATCH,
        collate_fn=list,
        rank=rank,
        world_size=world,
        shuffle=True,
        **kw,
    )


@dataclass
class Case:
    state: dict
    fresh: Callable  # rank -> a loader that accepts the state
    ranks: list  # the ranks that resume it (all of them: the records of every rank are counted)

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
            covered = (
                len(share)
                if snapshot["ended"]
                else snapshot["iterator"]["i"]
                if snapshot["iterator"] is not None
                else snapshot["batches"] * BATCH
            )
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
    paths = shard_files(tmp_path_factory.mktemp("shards"))

    def run(loaders, steps, passes_before=0):
        for dl, count in zip(loaders, steps):
            for _ in range(passes_before):
                list(dl)
            list(itertools.islice(dl, count))
        states = [dl.state_dict() for dl in loaders]
        return json.loads(json.dumps(states[0] if len(states) == 1 else merge_states(states)))

    def case(loaders, steps, fresh, ranks=(0,), passes_before=0):
        return Case(run(loaders, steps, passes_before), fresh, list(ranks))

    def resized():
        """A state whose base lists finished shards: saved at 2 ranks after a resume of 3 ranks' state."""
        state = run([sharded(paths, r, 3) for r in range(3)], [2, 1, 0])  # rank 0 reads past its first shard
        again = [sharded(paths, r, 2) for r in range(2)]
        for dl in again:
            dl.load_state_dict(state)
        return run(again, [1, 1])

    workers = dict(num_workers=2, **FORK)
    return {
        "no state, main process, second epoch": case([plain(Plain)], [3], lambda r: plain(Plain), passes_before=1),
        "no state, 2 workers": case([plain(Plain, **workers)], [3], lambda r: plain(Plain, **workers)),
        "iterator state, main process": case([plain(IteratorState)], [3], lambda r: plain(IteratorState)),
        "iterator state, 2 workers": case(
            [plain(IteratorState, **workers)], [3], lambda r: plain(IteratorState, **workers)
        ),
        "iterator state, 2 ranks": case(
            [plain(IteratorState, r, 2) for r in range(2)], [2, 1], lambda r: plain(IteratorState, r, 2), ranks=[1]
        ),
        "sharded, 2 ranks, 2 workers": case(
            [sharded(paths, r, 2, **workers) for r in range(2)],
            [2, 1],
            lambda r: sharded(paths, r, 3),
            ranks=[0, 1, 2],  # another world size: the shards are dealt again
        ),
        "sharded, resized once": Case(resized(), lambda r: sharded(paths, r, 3), [0, 1, 2]),  # and again
    }


def paths_of(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths_of(item, prefix + (i,))


PAYLOADS = ("dataset",)  # a snapshot's field that holds a state of the stream's own these streams never have
GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([2**62, 2**64, -(2**63)]),
    st.floats(),
    st.text(max_size=4),
    st.lists(st.integers(-1, 5), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers()),
    st.just("AAAA"),
)


HEADER = ("format", "version", "kind")  # refused by a plain comparison: mutated rarely, to reach the rest


@st.composite
def mutations(draw, case):
    """1-3 of: an int nudged or a bool flipped, a field replaced by garbage, an entry deleted or duplicated; the
    header rarely. Inside the iterator's own state too (see the module docstring)."""
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
        else:
            parent[path[-1]] = draw(GARBAGE)
    return state


@pytest.mark.parametrize(
    "name",
    [
        "no state, main process, second epoch",
        "no state, 2 workers",
        "iterator state, main process",
        "iterator state, 2 workers",
        "iterator state, 2 ranks",
        "sharded, 2 ranks, 2 workers",
        "sharded, resized once",
    ],
)
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
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
    assert progress(mutated) == progress(case.state), "a change of the progress the state claims was accepted"
    loaders = [dl] + [case.fresh(rank) for rank in case.ranks[1:]]
    for other in loaders[1:]:
        other.load_state_dict(mutated)
    served, claimed = case.served(loaders), case.claimed(mutated)
    assert sorted(served + claimed) == case.records(), "the resumed pass skipped or repeated a record"


def progress(state) -> list:
    """What a state claims was read, as the loader records it: per rank its epoch (a sharded rank past an epoch read
    all of its share), batch count, flags and shard progress, and per worker its batch count, whether its stream
    ended and its shard position."""
    return [
        (
            r.epoch,
            r.batches,
            r.exhausted,
            r.ended,
            r.shards,
            [None if s is None else (s["batches"], s["ended"], s["shard"]) for s in r.workers],
        )
        for r in rank_streams(state)
    ]


def test_the_real_states_resume_exactly(cases):
    for name, case in cases.items():
        loaders = [case.fresh(rank) for rank in case.ranks]
        for dl in loaders:
            dl.load_state_dict(case.state)
        served, claimed = case.served(loaders), case.claimed(case.state)
        assert claimed and served and sorted(served + claimed) == case.records(), name


def test_the_checks_of_the_real_states_are_crcs_of_the_reprs_of_their_progress(cases):
    """The checks are formatted straight into bytes when a state is taken: they must stay what 0.1.0 wrote (and what
    the docs say), a CRC-32 of the repr of the progress tuple, or the states it saved would be refused."""
    for name, case in cases.items():
        for r in rank_streams(case.state):
            shards = None if r.shards is None else checksum(r.shards.serialised)
            state = r.to_dict()
            assert state["check"] == checksum(r.epoch, r.batches, r.exhausted, r.ended, r.next_worker, shards), name
            for snapshot in state["workers"] + state["origins"]:
                if snapshot is not None:
                    progress = (snapshot["batches"], snapshot["ended"], snapshot["shard"])
                    again = snapshot_dict(snapshot_of(snapshot))["check"]  # as a state is taken
                    assert snapshot["check"] == checksum(*progress) == again, name


def test_a_field_that_may_be_one_of_two_types_names_both_when_it_is_neither():
    dl = ResumableDataLoader(list(range(10)), batch_size=2)
    state = dl.state_dict()
    state["base"] = {**state["base"], "end_of_epoch": "yes"}
    with pytest.raises(StateError, match="end_of_epoch must be of type dict or NoneType, got 'yes'"):
        ResumableDataLoader(list(range(10)), batch_size=2).load_state_dict(state)


# -- what the fuzzer found, one plain test each ------------------------------------------------------------------------


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
    refused_unchanged(
        plain(Plain, num_workers=2, **FORK),
        state,
        rf"rank 0: {field}\[1\] holds an iterator state, but Plain.__iter__ is a generator, which "
        rf"keeps none",
    )


class Listed(Plain):
    """Its __iter__ is no generator function, but returns an iterator without state."""

    def __iter__(self):
        return iter(list(super().__iter__()))


def test_an_iterator_state_the_iterator_cannot_load_is_refused_on_load():
    state = saved(Listed)
    state["workers"][0]["iterator"] = {"i": 1}  # once refused only when the stream was read
    refused_unchanged(
        plain(Listed),
        state,
        r"rank 0: workers\[0\].iterator: the state holds an iterator state for "
        r"worker 0, but the iterator Listed.__iter__ returns \(list_iterator\) "
        r"has no load_state_dict",
    )


@pytest.mark.parametrize("junk", ["AAAA", 3, {"i": -1}, {}])
def test_an_iterator_state_its_iterator_refuses_is_refused_on_load_naming_the_worker(junk):
    state = saved(IteratorState, num_workers=2, **FORK)
    state["workers"][1]["iterator"] = junk  # once accepted, and raised in the worker when the stream was read
    refused_unchanged(
        plain(IteratorState, num_workers=2, **FORK),
        state,
        r"rank 0: workers\[1\].iterator is a state IteratorState cannot load \((TypeError|ValueError|"
        r"KeyError): ",
    )


@pytest.mark.parametrize("setup", [{}, dict(num_workers=2, **FORK)])
def test_a_changed_ended_flag_is_refused_on_load_naming_the_worker(setup):
    state = saved(Plain, **setup)
    state["workers"][-1]["ended"] = True  # once accepted: that worker's rest was never delivered
    refused_unchanged(
        plain(Plain, **setup),
        state,
        rf"rank 0: states\[0\].workers\[{len(state['workers']) - 1}\].ended was changed \(it would "
        rf"drop that worker's rest\) after the state was saved",
    )
    state["workers"][-1]["ended"], state["workers"][-1]["batches"] = False, 7
    refused_unchanged(plain(Plain, **setup), state, r"workers\[\d\].batches, .shard or .check was changed")


def test_a_sharded_ranks_changed_epoch_is_refused_on_load_naming_the_rank(cases):
    case = cases["sharded, 2 ranks, 2 workers"]
    state = copy.deepcopy(case.state)
    state["ranks"][1]["epoch"] += 1  # once accepted: rank 1's share of epoch 0 counted as read, never delivered
    refused_unchanged(
        case.fresh(0),
        state,
        r"the state of rank 1: states\[1\].epoch, .batches, .next_worker, "
        r".shards or .check was changed after the state was saved",
    )


def test_a_sharded_worker_may_end_only_in_its_last_shard_even_with_a_recomputed_check(tmp_path):
    paths = shard_files(tmp_path)
    dl = sharded(paths)
    list(itertools.islice(dl, 1))
    state = json.loads(json.dumps(dl.state_dict()))
    worker = state["workers"][0]
    worker["ended"] = True
    worker["check"] = checksum(worker["batches"], True, worker["shard"])  # edited with care
    refused_unchanged(
        sharded(paths),
        state,
        r"rank 0: states\[0\].workers\[0\].ended is true, but its shard "
        r"position \[0, 2\] is in task 0 of the 4 it reads in epoch 0",
    )


def test_a_snapshot_of_the_earlier_release_without_its_check_is_refused():
    state = saved(Plain)
    del state["workers"][0]["check"]
    refused_unchanged(
        plain(Plain),
        state,
        r"workers\[0\] was saved by an earlier release, which did not record its "
        r"check",
    )


class Drawing(IteratorState):
    """Draws a random number on __iter__ and on load_state_dict."""

    def __iter__(self):
        torch.rand(())
        return _DrawingCursor(self.records())

    def records(self):
        worker, workers = tests_streams.share()
        return list(range(worker, self.n, workers))


class _DrawingCursor(tests_streams._Cursor):
    def __init__(self, records):
        super().__init__(records, random_draws=False)

    def load_state_dict(self, state):
        torch.rand(())
        super().load_state_dict(state)


class NeedsItsWorker(Drawing):
    """Reads only the records its worker_init_fn gave it."""

    def records(self):
        return list(range(self.given[0], self.n, self.given[1]))


def give_records(worker):
    info = torch.utils.data.get_worker_info()
    info.dataset.given = (worker, info.num_workers)


@pytest.mark.parametrize("kind", [Drawing, NeedsItsWorker])
def test_the_load_time_check_leaves_the_process_as_it_was_and_passes_a_stream_it_cannot_try(kind):
    """The check loads the states into a copy of the dataset in the main process: the process's random states stay
    as they were, and a dataset whose __iter__ needs its worker (its worker_init_fn) is left to its worker."""
    workers = dict(num_workers=2, worker_init_fn=give_records, **FORK)
    first = ResumableDataLoader(kind(N), batch_size=BATCH, collate_fn=list, **workers)
    seen = list(itertools.islice(first, 3))
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ResumableDataLoader(kind(N), batch_size=BATCH, collate_fn=list, **workers)
    before = rng_state()
    resumed.load_state_dict(state)
    assert rng_state() == before
    assert sorted(ids(seen + list(resumed))) == list(range(N))
