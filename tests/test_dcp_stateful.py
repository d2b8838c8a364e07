"""The loader as a DCP Stateful in a real gloo group: saved by 2 ranks, loaded by 3, every sample once."""

import itertools
import warnings

import torch.distributed.checkpoint as dcp

from loader import ResumableDataLoader
from loader.checkpoint import LoaderState
from tests.conftest import IndexDataset
from tests.distributed import run_group


def _loader(rank, world_size):
    return ResumableDataLoader(IndexDataset(90), batch_size=4, shuffle=True, seed=2, rank=rank, world_size=world_size)


def _save(rank, world_size, path):
    dl = _loader(rank, world_size)
    delivered = [i for b in itertools.islice(dl, 3 + rank) for i in b.tolist()]  # uneven: 3 and 4 batches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"loader": LoaderState(dl)}, checkpoint_id=path)
    return delivered


def _load(rank, world_size, path):
    dl = _loader(rank, world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"loader": LoaderState(dl)}, checkpoint_id=path)
    return [i for b in dl for i in b.tolist()]


def test_saved_at_two_ranks_loaded_at_three(tmp_path):
    before = sum(run_group(_save, 2, str(tmp_path)), [])
    after = sum(run_group(_load, 3, str(tmp_path)), [])
    assert len(before) == 7 * 4
    everything = before + after
    assert len(everything) == len(set(everything))  # nothing twice
    assert len(set(range(90)) - set(everything)) < 3  # nothing skipped but the < W dropped by policy
