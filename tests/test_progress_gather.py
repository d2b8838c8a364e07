"""The checkpoint's progress gather over a real gloo group: ranks exchange their states without the base they
share, and the merge is the same as the merge of the full states."""

import pickle

import pytest

from loader import ResumableDataLoader, merge_states
from loader.checkpoint.save import global_progress
from loader.core.state import StateError, attach_base, detach_base
from tests.conftest import IndexDataset
from tests.distributed import run_group

N, BATCH = 20_000, 4


def _loader(rank, world_size):
    return ResumableDataLoader(
        IndexDataset(N), batch_size=BATCH, shuffle=True, seed=9, rank=rank, world_size=world_size
    )


def uneven_base(world_size=64):
    """Progress with many holes: ranks of a larger run stopped after unequal numbers of batches."""
    states = []
    for rank in range(world_size):
        dl = _loader(rank, world_size)
        it = iter(dl)
        for _ in range(1 + 5 * rank % 13):
            next(it)
        states.append(dl.state_dict())
    return merge_states(states, uneven=True)


def _gather_job(rank, world_size, base):
    dl = _loader(rank, world_size)
    dl.load_state_dict(base)
    it = iter(dl)
    for _ in range(rank + 1):  # unequal again
        next(it)
    state = dl.state_dict(check_lockstep=False)  # unequal on purpose: gathered, never saved alone
    return state, global_progress(dl), len(pickle.dumps(detach_base(state)))


def test_ranks_exchange_o_of_w_bytes_and_merge_as_with_full_states():
    base = uneven_base()
    assert len(base["committed"][0][1]) >= 200  # the holes: the part of a state that grows
    results = run_group(_gather_job, 3, base)
    full_merge = merge_states([r[0] for r in results], uneven=True)
    assert all(r[1] == full_merge for r in results)
    assert all(4 * r[2] < len(pickle.dumps(base)) for r in results)  # a digest instead of the holes


def test_a_rank_that_started_from_another_progress_is_named():
    base = uneven_base()
    mine = _loader(0, 2)
    mine.load_state_dict(base)
    other = _loader(1, 2)  # never loaded the checkpoint
    gathered = [detach_base(mine.state_dict()), detach_base(other.state_dict())]
    with pytest.raises(StateError, match=r"states\[1\] \(rank 1\) started from another progress"):
        attach_base(gathered, mine.state_dict()["base"])
