"""Mutated stream states (one rank's, and merged multi-rank ones, plain and sharded) are loaded or refused with a
StateError, never another exception, and a refused state leaves the loader as it was."""

import copy
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, StateError, merge_states
from loader.sources.sharded import FileShards
from tests.streams import FORK, IteratorState

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")  # states carry random states (10 KB)


def read_lines(path):
    with open(path) as lines:
        yield from lines


def plain(rank=0, world=1, **kw):
    return ResumableDataLoader(IteratorState(20, random_draws=True), batch_size=2, collate_fn=list, rank=rank,
                               world_size=world, **kw)


def sharded(paths, rank=0, world=1, **kw):
    return ResumableDataLoader(FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank,
                               world_size=world, shuffle=True, **kw)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(real state, a fresh loader that accepts it) pairs: one rank at 0 and 2 workers, two ranks merged."""
    directory = tmp_path_factory.mktemp("shards")
    paths = []
    for s, n in enumerate([3, 0, 5, 2]):
        (directory / f"{s}.txt").write_text("".join(f"{s}:{r}\n" for r in range(n)))
        paths.append(str(directory / f"{s}.txt"))
    made = {}

    def run(loaders, steps):
        for dl, count in zip(loaders, steps):
            list(itertools.islice(dl, count))
        states = [dl.state_dict() for dl in loaders]
        return json.loads(json.dumps(states[0] if len(states) == 1 else merge_states(states)))

    made["plain, main process"] = (run([plain()], [3]), lambda: plain())
    made["plain, 2 workers"] = (run([plain(num_workers=2, **FORK)], [3]), lambda: plain(num_workers=2, **FORK))
    made["plain, 2 ranks"] = (run([plain(r, 2) for r in range(2)], [2, 1]), lambda: plain(1, 2))
    made["sharded, 2 ranks, 2 workers"] = (
        run([sharded(paths, r, 2, num_workers=2, **FORK) for r in range(2)], [2, 1]),
        lambda: sharded(paths, 0, 3),  # another world size: the shards are dealt again
    )
    return made


def paths_of(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths_of(item, prefix + (i,))


GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**62, 2**64, -(2**63)]), st.floats(),
    st.text(max_size=4), st.lists(st.integers(-1, 5), max_size=4), st.dictionaries(st.text(max_size=3), st.integers()),
    st.just("AAAA"),
)


@st.composite
def mutations(draw, state):
    state = copy.deepcopy(state)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(paths_of(state))[1:]))
        parent = state
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "duplicate"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[path[-1]] = draw(GARBAGE)
        if not isinstance(state, dict):
            break
    return state


@pytest.mark.parametrize("case", ["plain, main process", "plain, 2 workers", "plain, 2 ranks",
                                  "sharded, 2 ranks, 2 workers"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_stream_state_loads_or_is_refused_with_a_state_error(cases, case, data):
    state, fresh = cases[case]
    fresh().load_state_dict(state)  # the real state loads
    mutated = data.draw(mutations(state))
    dl = fresh()
    before = dl.state_dict()
    try:
        dl.load_state_dict(mutated)
    except StateError as err:
        assert len(str(err)) < 600, "a state error is a short message"
        assert dl.state_dict() == before, "a refused state leaves the loader unchanged"


def test_a_field_that_may_be_one_of_two_types_names_both_when_it_is_neither():
    dl = ResumableDataLoader(list(range(10)), batch_size=2)
    state = dl.state_dict()
    state["base"] = {**state["base"], "end_of_epoch": "yes"}
    with pytest.raises(StateError, match="end_of_epoch must be of type dict or NoneType, got 'yes'"):
        ResumableDataLoader(list(range(10)), batch_size=2).load_state_dict(state)
