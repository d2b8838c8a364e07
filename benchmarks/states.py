"""Loader states at a chosen position, made without iterating to it: positions up to 1e9 in milliseconds.

Ours: a merged state whose committed interval is [0, position) of epoch 0 (the documented resume recipe).
StatefulDataLoader: a real state taken after one batch, with its sample counters moved to the position, which is
exactly what it would have saved there (its generator state is that of the epoch's start either way).
"""

from __future__ import annotations

import copy

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from benchmarks.loaders import ours
from loader import merge_states


def global_state_at(dataset: Dataset, batch_size: int, position: int, shuffle: bool = True, **kwargs) -> dict:
    """The merged state of a run (shuffled unless told; `kwargs`: the loader's other settings, such as
    shuffle_blocks) that committed positions [0, position) of epoch 0."""
    state = merge_states([ours(dataset, batch_size=batch_size, shuffle=shuffle, **kwargs).state_dict()])
    state["committed"] = [[0, [0, position]]] if position else []
    return state


def stateful_state_at(dataset: Dataset, batch_size: int, position: int) -> dict:
    """A StatefulDataLoader (shuffle=True, num_workers=0) state saved after `position` samples (a batch multiple)."""
    loader = StatefulDataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=0)
    next(iter(loader))
    state = copy.deepcopy(loader.state_dict())
    batches = position // batch_size
    state["_num_yielded"] = state["_sampler_iter_yielded"] = batches
    sampler = state["_sampler_iter_state"]
    sampler["samples_yielded"] = sampler["sampler_iter_state"]["yielded"] = batches * batch_size
    return state
