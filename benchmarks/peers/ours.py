"""Ours: ResumableDataLoader with explicit rank and world size.

In lockstep rank 0's state_dict() is saved alone (README: "One rank's state is enough in lockstep"); when ranks
consumed unequal amounts the merged progress of all ranks is saved (what save_checkpoint gathers). Where the global
batch changes at the restart, both launches are given the schedule as a batch-size ramp (`BatchPolicy`): the micro-
batch stays, and K follows the step.
"""

from __future__ import annotations

from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import SEED, dataset, ids
from benchmarks.states import global_state_at
from loader import ResumableDataLoader, merge_states
from loader.core.batch_policy import BatchPolicy


def _loader(n: int, world: int, rank: int, batch: int, accum: int = 1, workers: int = 0, kind: str = "index"):
    return ResumableDataLoader(
        dataset(kind, n),
        batch_size=batch,
        shuffle=True,
        seed=SEED,
        rank=rank,
        world_size=world,
        grad_accum=accum,
        num_workers=workers,
    )


def _phase_loader(phase: Phase, rank: int) -> ResumableDataLoader:
    if phase.schedule is None:
        return _loader(phase.n, phase.world, rank, phase.batch, phase.accum)
    micro = phase.schedule[0][1] // (phase.world * phase.accum)
    return ResumableDataLoader(
        dataset("index", phase.n),
        batch_size=micro,
        shuffle=True,
        seed=SEED,
        rank=rank,
        world_size=phase.world,
        batch_policy=BatchPolicy(phase.schedule, micro),
    )


class Ours(InProcess):
    saves = "rank 0's state_dict in lockstep; the merged progress (save_checkpoint) when ranks consumed unequally"

    def rank_phase(self, phase: Phase, rank: int, saved: dict | None) -> tuple[list[int], dict]:
        dl = _phase_loader(phase, rank)
        if saved is not None:
            dl.load_state_dict(saved)
        return [i for b in deliver(dl, phase.steps[rank]) for i in ids(b)], dl.state_dict()

    def save(self, states: list, phase: Phase) -> dict:
        return states[0] if len(set(phase.steps)) == 1 else merge_states(states, uneven=True)

    def state_at(self, n, data, batch: int, position: int) -> dict:
        return global_state_at(dataset("index", n), batch, position)

    def first_batch(self, n, data, batch: int, state: dict):
        dl = _loader(n, 1, 0, batch)
        dl.load_state_dict(state)
        return next(iter(dl))

    def loader(self, n, data, batch: int, workers: int, kind: str) -> ResumableDataLoader:
        return _loader(n, 1, 0, batch, workers=workers, kind=kind)


PEER = Ours()
