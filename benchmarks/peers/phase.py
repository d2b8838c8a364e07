"""What an adapter is asked to do: launches of a data-parallel job, each rank resuming, delivering and saving."""

from __future__ import annotations

import copy
import importlib.metadata
import itertools
import pickle
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.peers.samples import ids


@dataclass(frozen=True)
class Phase:
    """One run of every rank of `world`: resume from `resume` (a saved state, the index of an earlier phase of
    the same launch whose saved state it loads, or None: a fresh start) and deliver `steps[r]` micro-batches of
    `batch` samples on rank r (None: to the end of the epoch), `accum` micro-batches per optimizer update. The
    samples are the integers 0..n-1 (an item is its index), stored in the system's own format under `data`.
    `schedule`, where the global batch changes at the restart, is the global batch by optimizer update across both
    launches, for a loader that takes a batch-size ramp; every other loader is given the new `batch` at restart."""

    n: int
    world: int
    batch: int
    accum: int
    steps: tuple[int | None, ...]
    resume: Any = None
    data: Path = Path()
    schedule: tuple[tuple[int, int], ...] | None = None

    @property
    def stops(self) -> bool:
        """Whether the phase stops mid-epoch and saves (else it runs to the end and saves nothing)."""
        return self.steps[0] is not None


@dataclass
class Outcome:
    """Sample ids each rank delivered, in order; what the system saves under data parallelism at the stop (None
    when the phase ran to the end); or the error that stopped the phase."""

    ids: list[list[int]] = field(default_factory=list)
    saved: Any = None
    error: str | None = None


class Peer(Protocol):
    """A loader under comparison, used the way its documentation says. `saves` says in words how it saves state
    under data parallelism; `processes` whether its ranks must be processes (it reads the rank from the environment
    or torch.distributed); `distribution` is the installed package whose version is reported."""

    name: str
    distribution: str
    saves: str
    processes: bool

    def prepare(self, n: int, data: Path) -> None:
        """Write the n index samples in the system's own format under `data` (nothing for map-style datasets)."""

    def rank_phase(self, phase: Phase, rank: int, saved: Any) -> tuple[list[int], Any]:
        """One rank's part of a phase: the ids it delivered and its own state at the end."""

    def save(self, states: list, phase: Phase) -> Any:
        """What the job saves from its ranks' states, as the system's documentation says."""

    def state_at(self, n: int, data: Path, batch: int, position: int) -> Any:
        """The state one rank saves after `position` samples of epoch 0 (for the cost measurements)."""

    def first_batch(self, n: int, data: Path, batch: int, state: Any) -> Any:
        """Build the loader, load `state` and return its first batch: what a restarted job waits for."""

    def loader(self, n: int, data: Path, batch: int, workers: int, kind: str) -> Iterable:
        """One rank's loader of one shuffled epoch of `kind` samples (for throughput)."""


def version(distribution: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def deliver(batches: Iterable, steps: int | None) -> Iterator:
    """The first `steps` batches (all of them when None), never asking for one more: a loader counts a batch
    when it hands it out, so fetching a batch to find out there is none left would consume it."""
    return itertools.islice(batches, steps)


def error_text(err: BaseException) -> str:
    """`Type: message (file:line)` of an exception, one line."""
    last = traceback.extract_tb(err.__traceback__)[-1:]
    where = f" ({Path(last[0].filename).name}:{last[0].lineno})" if last else ""
    return f"{type(err).__name__}: {err}".splitlines()[0][:300] + where


def play(peer: Peer, phases: Sequence[Phase], ranks: Sequence[int], gather: Callable[[Any], list]) -> list[Outcome]:
    """Run the phases of one launch on `ranks` (all of them in one process, or this process's rank), in order.
    `gather` turns this process's rank states into every rank's (an all_gather across processes). A phase that
    raises is an outcome with its error; the launch goes on with the next phase."""
    outcomes: list[Outcome] = []
    for phase in phases:
        resume = outcomes[phase.resume].saved if isinstance(phase.resume, int) else phase.resume
        outcome = Outcome()
        states = []
        try:
            if isinstance(phase.resume, int) and outcomes[phase.resume].error:
                raise RuntimeError(f"the phase it resumes from failed: {outcomes[phase.resume].error}")
            for rank in ranks:
                delivered, state = peer.rank_phase(phase, rank, resume)
                outcome.ids.append(delivered)
                states.append(pickle.dumps(state))
        except Exception as err:  # a system that refuses to resume is a result, reported with its error
            outcome.error = error_text(err)
        every = gather(None if outcome.error else states)
        if outcome.error is None and phase.stops and all(s is not None for s in every):
            outcome.saved = peer.save([pickle.loads(s) for part in every for s in part], phase)
        outcomes.append(outcome)
    return outcomes


class InProcess:
    """A system whose rank and world size are arguments, so one process simulates every rank, over a map-style
    dataset that needs no files."""

    processes = False

    def prepare(self, n: int, data: Path, kind: str = "index") -> None:
        """Nothing to write: the samples are a map-style dataset."""


class RankZero:
    """A system over its own shard files that reads the rank from the environment (every rank a process) and
    whose loader saves one state for all ranks: rank 0's `state_dict()`, loaded by every rank. Subclasses give
    `_loader(data, batch, workers, kind)` and `_moved(state, position)` (a state's sample counts set to
    `position`)."""

    processes = True

    def rank_phase(self, phase: Phase, rank: int, saved: dict | None) -> tuple[list[int], dict]:
        dl = self._loader(phase.data, phase.batch)
        if saved is not None:
            dl.load_state_dict(saved)
        return [i for b in deliver(dl, phase.steps[rank]) for i in ids(b)], dl.state_dict()

    def save(self, states: list, phase: Phase) -> dict:
        return states[0]

    def state_at(self, n: int, data: Path, batch: int, position: int) -> dict:
        """A real state after one batch with its sample counts moved to `position` (what it saves there)."""
        dl = self._loader(data, batch)
        next(iter(dl))
        return self._moved(copy.deepcopy(dl.state_dict()), position)

    def first_batch(self, n: int, data: Path, batch: int, state: dict):
        dl = self._loader(data, batch)
        dl.load_state_dict(state)
        return next(iter(dl))

    def loader(self, n: int, data: Path, batch: int, workers: int, kind: str):
        return self._loader(data, batch, workers, kind)
