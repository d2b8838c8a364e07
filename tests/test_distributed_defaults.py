"""Rank and world size come from torch.distributed when it is initialised: real gloo groups, no mocks."""

import pytest
import torch
import torch.distributed as dist

from loader import ResumableDataLoader, merge_states
from tests.conftest import IndexDataset
from tests.distributed import run_group
from tests.test_stream_edges import Shards


def _rank_job(rank, world_size):
    dl = ResumableDataLoader(IndexDataset(50), batch_size=3, shuffle=True, seed=4)
    delivered = [b.tolist() for b in dl]
    dist.barrier()  # as a training step's collective would: no rank takes its state before the others' last update
    gathered = [None] * world_size
    dist.all_gather_object(gathered, dl.state_dict())  # the merge a checkpoint does: one small collective
    counts = torch.tensor([len(delivered)])
    dist.all_reduce(counts, op=dist.ReduceOp.MIN)
    return dl.rank, dl.world_size, delivered, merge_states(gathered), int(counts)


def test_rank_and_world_size_default_to_the_process_group():
    results = run_group(_rank_job, 3)
    assert [(r[0], r[1]) for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert len({len(r[2]) for r in results}) == 1 == len({r[4] for r in results})  # equal batch counts
    ids = sorted(i for r in results for batch in r[2] for i in batch)
    assert ids == list(range(50))  # disjoint, and nothing dropped although 50 is no multiple of 3
    merged = results[0][3]
    assert all(r[3] == merged for r in results) and merged["epoch"] == 1


def _prebuilt_job(rank, world_size, dl, peeked):
    if peeked:
        try:
            iter(dl)
        except RuntimeError as err:
            return str(err)
        return "no error"
    return dl.rank, dl.world_size, len(dl), [b.tolist() for b in dl]


def test_a_loader_built_before_the_process_group_takes_its_rank_when_iteration_starts():
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=2)  # no group yet: rank 0 of 1
    assert (dl.rank, dl.world_size, len(dl)) == (0, 1, 10)
    results = run_group(_prebuilt_job, 2, dl, False)  # forked: each rank holds a copy built before the group
    assert [r[:3] for r in results] == [(0, 2, 5), (1, 2, 5)]
    ids = [i for r in results for batch in r[3] for i in batch]
    assert sorted(ids) == list(range(40))  # each sample once, not once per rank


def _sharded(collate=list):
    return ResumableDataLoader(Shards([5] * 4, [None] * 4), batch_size=2, collate_fn=collate)


def _prebuilt_stream_job(rank, world_size, dl):
    first = next(iter(dl))  # the rank is resolved here
    state = dl.state_dict()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, state)
    resumed = _sharded()
    resumed.load_state_dict(merge_states(gathered))
    return (state["rank"], state["world_size"]), [first, *resumed]


@pytest.mark.slow
def test_a_stream_state_taken_before_the_process_group_does_not_stand_for_a_rank_in_it():
    """A stream's state before its first batch is the one rank of one's; taken again in the group, it is the
    group rank's (the state's fields that stay during a pass are kept between states: they follow the rank), and
    the ranks resume from their states exactly."""
    dl = _sharded()
    assert (dl.state_dict()["rank"], dl.state_dict()["world_size"]) == (0, 1)
    results = run_group(_prebuilt_stream_job, 2, dl)
    assert [r[0] for r in results] == [(0, 2), (1, 2)]
    read = sorted(record for r in results for batch in r[1] for record in batch)
    assert read == [(s, i) for s in range(4) for i in range(5)]  # each shard's records once, across the ranks


def test_a_loader_that_delivered_before_the_process_group_is_refused_loudly():
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4)
    next(iter(dl))  # delivered as rank 0 of 1
    messages = run_group(_prebuilt_job, 2, dl, True)
    assert all(
        "before torch.distributed was initialised as rank" in m and "pass rank= and world_size=" in m for m in messages
    )
