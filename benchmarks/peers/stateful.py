"""torchdata's StatefulDataLoader with its StatefulDistributedSampler.

Its state is per rank ("aggregates across workers but not across ranks"): every rank saves its own state_dict and
rank r loads rank r's on resume; a rank that had no predecessor (a larger world) starts the epoch afresh.
"""

from __future__ import annotations

import copy

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import SEED, dataset, ids


def _loader(data: Dataset, world: int, rank: int, batch: int, num_workers: int = 0) -> StatefulDataLoader:
    sampler = StatefulDistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    return StatefulDataLoader(data, batch_size=batch, sampler=sampler, num_workers=num_workers)


class Stateful(InProcess):
    saves = "every rank its own state_dict; rank r loads rank r's (a new rank starts afresh)"

    def rank_phase(self, phase: Phase, rank: int, saved: list | None) -> tuple[list[int], dict]:
        dl = _loader(dataset("index", phase.n), phase.world, rank, phase.batch)
        if saved and rank < len(saved):
            dl.load_state_dict(saved[rank])
        return [i for b in deliver(dl, phase.steps[rank]) for i in ids(b)], dl.state_dict()

    def save(self, states: list, phase: Phase) -> list:
        return states

    def state_at(self, n, data, batch: int, position: int) -> dict:
        """A real state after one batch with its counters moved to `position` (what it saves there)."""
        dl = _loader(dataset("index", n), 1, 0, batch)
        next(iter(dl))
        state = copy.deepcopy(dl.state_dict())
        state["_num_yielded"] = state["_sampler_iter_yielded"] = position // batch
        state["_sampler_iter_state"] = {"samples_yielded": position, "sampler_state": {"yielded": position}}
        return state

    def first_batch(self, n, data, batch: int, state: dict):
        dl = _loader(dataset("index", n), 1, 0, batch)
        dl.load_state_dict(state)
        return next(iter(dl))

    def loader(self, n, data, batch: int, workers: int, kind: str) -> StatefulDataLoader:
        return _loader(dataset(kind, n), 1, 0, batch, workers)


PEER = Stateful()
