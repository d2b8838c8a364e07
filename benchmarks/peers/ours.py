"""Ours: ResumableDataLoader with explicit rank and world size.

In lockstep rank 0's state_dict() is saved alone (README: "One rank's state is enough in lockstep"); when ranks
consumed unequal amounts the merged progress of all ranks is saved (what save_checkpoint gathers). Where the global
batch changes at the restart, both launches are given the schedule as a batch-size ramp (`BatchPolicy`): the micro-
batch stays, and K follows the step.

The capability cases (`benchmarks.peers.capabilities`) run the same script over a filter (`filter=`, the filtered
samples reported from `last_filtered()`), packed rows (`PackedSource` of the documents' token file, counted by
token) and a `Mixture` of two sources.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from benchmarks.features import keep
from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import MIXTURE, SEED, SEQ_LEN, dataset, ids, mixture_sources, write_documents
from benchmarks.states import global_state_at
from loader import ResumableDataLoader, merge_states
from loader.core.batch_policy import BatchPolicy
from loader.sources import Mixture, TokenSource
from loader.sources.packing import PackedSource


def _loader(
    data: Dataset, world: int, rank: int, batch: int, accum: int = 1, workers: int = 0, **options
) -> ResumableDataLoader:
    return ResumableDataLoader(
        data,
        batch_size=batch,
        shuffle=True,
        seed=SEED,
        rank=rank,
        world_size=world,
        grad_accum=accum,
        num_workers=workers,
        **options,
    )


class Ours(InProcess):
    saves = "rank 0's state_dict in lockstep; the merged progress (save_checkpoint) when ranks consumed unequally"

    def dataset(self, phase: Phase) -> Dataset:
        return dataset("index", phase.n)

    def options(self) -> dict:
        """The loader's options beyond the script's (a capability's)."""
        return {}

    def delivered(self, dl: ResumableDataLoader, batch) -> list[int]:
        """The ids of a batch just delivered."""
        return ids(batch)

    def rank_phase(self, phase: Phase, rank: int, saved: dict | None) -> tuple[list[int], dict]:
        if phase.schedule is None:
            dl = _loader(self.dataset(phase), phase.world, rank, phase.batch, phase.accum, **self.options())
        else:
            micro = phase.schedule[0][1] // (phase.world * phase.accum)
            policy = BatchPolicy(phase.schedule, micro)
            dl = _loader(self.dataset(phase), phase.world, rank, micro, batch_policy=policy, **self.options())
        if saved is not None:
            dl.load_state_dict(saved)
        return [i for b in deliver(dl, phase.steps[rank]) for i in self.delivered(dl, b)], dl.state_dict()

    def save(self, states: list, phase: Phase) -> dict:
        return states[0] if len(set(phase.steps)) == 1 else merge_states(states, uneven=True)

    def state_at(self, n, data, batch: int, position: int) -> dict:
        return global_state_at(dataset("index", n), batch, position)

    def first_batch(self, n, data, batch: int, state: dict):
        dl = _loader(dataset("index", n), 1, 0, batch)
        dl.load_state_dict(state)
        return next(iter(dl))

    def loader(self, n, data, batch: int, workers: int, kind: str) -> ResumableDataLoader:
        return _loader(dataset(kind, n), 1, 0, batch, workers=workers)


class OursFilter(Ours):
    """`filter=keep` (drops every tenth index); each batch's filtered members, as `last_filtered()` names them, are
    reported as filtered (~i)."""

    def options(self) -> dict:
        return {"filter": keep}

    def delivered(self, dl: ResumableDataLoader, batch) -> list[int]:
        return ids(batch) + [~i for i in dl.last_filtered().tolist()]


class OursPacked(Ours):
    """A PackedSource (best fit) of the documents' token file: a row's ids are its document tokens (not padding)."""

    def prepare(self, n: int, data: Path, kind: str = "index") -> None:
        write_documents(n, data)

    def dataset(self, phase: Phase) -> Dataset:
        tokens = TokenSource(
            phase.data / "tokens.bin", seq_len=SEQ_LEN, dtype="uint32", doc_offsets=phase.data / "starts.npy"
        )
        return PackedSource(tokens, mode="best_fit")

    def delivered(self, dl: ResumableDataLoader, batch) -> list[int]:
        return (batch["tokens"][batch["segment_ids"] >= 0] - 1).tolist()


class OursMixture(Ours):
    """A Mixture of two sources (`samples.MIXTURE`) over n positions: every sample drawn once."""

    def dataset(self, phase: Phase) -> Dataset:
        sources = [TensorDataset(torch.tensor(list(ids_))) for ids_ in mixture_sources(phase.n)]
        return Mixture(sources, list(MIXTURE.values()), phase.n, seed=SEED, names=list(MIXTURE))

    def delivered(self, dl: ResumableDataLoader, batch) -> list[int]:
        return ids(batch[0])


PEER, FILTER, PACKED, MIXED = Ours(), OursFilter(), OursPacked(), OursMixture()
