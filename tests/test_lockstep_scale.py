"""The lockstep check beyond 195 ranks: ranks take turns, so one store serves O(1) requests per step at any W.

Many ranks are simulated in one process, each a `LockstepWatch` over a client of one real TCPStore on loopback,
called in the order a lockstep step allows (every rank delivers update u, then takes its state after the step);
a real gloo group of 4 processes then runs loaders that are 4 of 200 ranks, as a larger job's would.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.scale import CountingStore
from loader import ResumableDataLoader
from loader.checkpoint.lockstep import EXACT, SAMPLE, LockstepWarning, LockstepWatch, due, due_ranks, period
from tests.conftest import IndexDataset
from tests.distributed import run_group

PROGRESS = (1, "digest")  # the progress every simulated rank counts its updates from


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 5000), start=st.integers(0, 10**6))
def test_every_rank_takes_one_turn_per_period_and_at_most_sample_ranks_share_an_update(world, start):
    turns = [list(due_ranks(u, world)) for u in range(start, start + period(world))]
    assert period(world) == 1 or all(len(ranks) <= SAMPLE for ranks in turns)  # beyond the exact check
    assert sorted(r for ranks in turns for r in ranks) == list(range(1, world))  # each rank once
    assert all(due(r, u, world) for u, ranks in zip(range(start, start + period(world)), turns) for r in ranks)
    assert (period(world) == 1) == (world <= EXACT)  # the exact check up to 195 ranks


def test_at_65536_ranks_a_turn_comes_every_1024_updates():
    assert period(65_536) == 1024 and max(len(due_ranks(u, 65_536)) for u in range(1024)) == SAMPLE


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield CountingStore(dist.TCPStore("127.0.0.1", server.port, is_master=False))


def simulate(store, world: int, updates: int, counts: dict[int, int] | None = None) -> tuple[list, list, list]:
    """`updates` lockstep steps of `world` simulated ranks (`counts`: ranks whose loop does fewer, to that many):
    rank 0's mark after each step, the requests the store served in each step, and the ranks' watches."""
    counts = counts or {}
    watches = [LockstepWatch("sim", store=store) for _ in range(world)]
    marks, requests = [], []
    for u in range(1, updates + 1):
        before = store.requests
        for rank, watch in enumerate(watches):
            if u <= counts.get(rank, updates):
                watch.completed_update(rank, PROGRESS, world)
        requests.append(store.requests - before)
        marks.append(watches[0].check(0, world, PROGRESS))
    return marks, requests, watches


def test_at_1024_ranks_an_update_costs_the_store_o_of_1_requests_and_lockstep_is_never_marked(store):
    marks, requests, watches = simulate(store, 1024, 3 * period(1024))
    assert marks == [None] * len(marks)
    assert requests[0] <= 1024 + EXACT  # the first update since the progress was set: every rank publishes
    assert max(requests[1:]) <= EXACT < 1024  # then publish (compare_set), check and multi_get of rank
    # 0 and of the ranks whose turn it is, where every rank used to publish at every update
    assert all(watch.check(rank, 1024, PROGRESS) is None for rank, watch in enumerate(watches))


@pytest.mark.parametrize("laggard", [1, 617, 1023])
def test_a_rank_that_leaves_its_loop_early_is_caught_within_a_period_and_marks_every_later_state(store, laggard):
    stop, world = 5, 1024
    marks, _, _ = simulate(store, world, stop + 2 * period(world), {laggard: stop})
    assert marks[:stop] == [None] * stop  # in lockstep until then
    caught = next(i for i, mark in enumerate(marks) if mark is not None) + 1
    assert stop < caught <= stop + period(world) + 1  # its turn after the stop, seen at rank 0's next update
    assert all(mark is not None and mark["rank"] == laggard and mark["updates"] <= stop for mark in marks[caught - 1 :])


def test_rank_zero_behind_the_others_is_caught_by_a_rank_at_its_turn(store):
    stop, world = 4, 300
    marks, _, watches = simulate(store, world, stop + period(world) + 1, {0: stop})
    mark = watches[0].check(0, world, PROGRESS)
    assert marks[:stop] == [None] * stop
    assert mark is not None and mark["own_updates"] == stop and mark["updates"] > stop + 1
    assert watches[0].check(0, world, (2, "digest")) is None  # a progress set anew: nothing found since


# -- loaders of a 200-rank job, 4 of its ranks in a real gloo group ---------------------------------------------------

WORLD, N, KW = 200, 200 * 2 * 12, dict(batch_size=2, shuffle=True, seed=5)  # 12 updates an epoch


def _job(rank, world_size, stopping):
    """Ranks 0-3 of 200 in lockstep (an all_reduce per update) for 6 updates; then rank `stopping` leaves its
    loop while the others go on for 6 more. Rank 0 takes its state after every step, after them rank 0 and the
    others alike; every state is returned with the warnings it raised."""
    dl = ResumableDataLoader(IndexDataset(N), rank=rank, world_size=WORLD, **KW)
    on = [r for r in range(world_size) if r != stopping]
    group = dist.new_group(on)
    it, states = iter(dl), []
    for update in range(1, 13):
        if rank == stopping and update > 6:
            break
        next(it)
        dist.all_reduce(torch.zeros(1), group=group if update > 6 else None)
        if rank == 0:
            states.append(_state(dl))
    dist.barrier()
    return states, _state(dl)


def _state(dl):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = dl.state_dict()
    assert all(w.category is LockstepWarning for w in caught) and len(caught) == ("lockstep" in state)
    return state.get("lockstep")


@pytest.mark.slow
def test_beyond_195_ranks_a_rank_that_leaves_its_loop_marks_rank_zeros_states_within_a_period():
    results = run_group(_job, 4, 2)
    marks = results[0][0]
    assert len(marks) == 12 and marks[:6] == [None] * 6
    assert all(mark is not None and mark["rank"] == 2 for mark in marks[6 + period(WORLD) :])
    assert [final for _, final in results] == [marks[-1], None, {"rank": 0, "updates": 12, "own_updates": 6}, None]


@pytest.mark.slow
def test_beyond_195_ranks_rank_zero_leaving_its_loop_is_found_by_the_others():
    results = run_group(_job, 4, 0)
    marks, final = results[0]
    assert marks == [None] * 6 and final is not None and final["own_updates"] == 6 and final["updates"] > 7
    assert [f for _, f in results[1:]] == [{"rank": 0, "updates": 6, "own_updates": 12}] * 3
