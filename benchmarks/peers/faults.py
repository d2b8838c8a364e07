"""The one script of faults applied to every system: stop mid-epoch, resume, count every sample by identity.

N samples whose item is its index, global batch 48 held across world sizes (per-rank micro-batch 48 / (W x
grad_accum)); the job stops after a number of optimizer updates, saves the way the system's documentation says,
and a new launch runs to the end of the epoch. Uneven stops give ranks unequal consumption before the stop
(rank 1 one micro-batch ahead, rank 2 one behind, as DDP Join or uneven inputs leave them); a system that cannot
express a stop is never asked to: every one here delivers as many batches as it is told. A change of the global
batch at the restart (48 -> 96, as a batch-size ramp does) stops after an odd number of updates (51 at quick size),
so that the stop does not fall on a whole number of the new global batches.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.peers.phase import Outcome, Peer, Phase, error_text, play
from benchmarks.peers.ranks import launch

GLOBAL_BATCH = 48
UNEVEN = (0, 1, -1, 0)  # micro-batches rank r is ahead of rank 0 at an uneven stop (4 ranks)


@dataclass(frozen=True)
class Fault:
    """A stop at `before` ranks and a resume at `after` (None: no stop, one uninterrupted epoch: the control)."""

    before: int
    after: int | None
    accum: int = 1
    uneven: bool = False
    batch_after: int | None = None  # the global batch after the restart, where it changes there

    @property
    def key(self) -> tuple:
        """What its stop depends on: faults with the same key share one stop."""
        return self.accum, self.uneven, self.batch_after

    @property
    def label(self) -> str:
        if self.after is None:
            return f"no restart, W={self.before}"
        return (
            f"{self.before}→{self.after}"
            + (" uneven" if self.uneven else "")
            + (f", grad_accum {self.accum}" if self.accum > 1 else "")
            + (f", global batch {GLOBAL_BATCH}→{self.batch_after}" if self.batch_after else "")
        )

    def batch(self, world: int, resumed: bool = False) -> int:
        """The micro-batch at `world` ranks, before the stop or after the restart (`resumed`)."""
        return (self.batch_after if resumed and self.batch_after else GLOBAL_BATCH) // (world * self.accum)

    def updates(self, updates: int) -> int:
        """Optimizer updates before the stop; where the global batch changes, the first odd count from `updates`,
        so that the stop is not a whole number of the new global batches."""
        return updates + (updates % 2 == 0) if self.batch_after else updates

    def schedule(self, updates: int) -> tuple[tuple[int, int], ...] | None:
        """The global batch by optimizer update across the stop, for a loader that takes a batch-size ramp."""
        return ((0, GLOBAL_BATCH), (self.updates(updates), self.batch_after)) if self.batch_after else None

    def stop(self, updates: int) -> tuple[int, ...]:
        """Micro-batches each rank delivered before the stop, after `updates` optimizer updates."""
        steps = self.updates(updates) * self.accum
        return tuple(steps + (UNEVEN[r] if self.uneven else 0) for r in range(self.before))


FAULTS = (
    Fault(4, 4),
    Fault(4, 3),
    Fault(4, 6),
    Fault(4, 4, uneven=True),
    Fault(4, 3, uneven=True),
    Fault(4, 6, uneven=True),
    Fault(4, 4, accum=2),
    Fault(4, 3, accum=2),
    Fault(4, 6, accum=2),
    Fault(4, 4, batch_after=2 * GLOBAL_BATCH),
    Fault(4, None),
    Fault(3, None),
    Fault(6, None),
)


def _missed(counts: np.ndarray) -> dict:
    return {"skipped": int((counts == 0).sum()), "duplicated": int((counts[counts > 1] - 1).sum())}


def tally(n: int, delivered: list[list[int]], sources: Sequence[range] = ()) -> dict:
    """Skipped (never delivered) and duplicated (delivered more than once: the extra deliveries) sample counts; an
    id ~i (below 0) is sample i recorded as filtered by policy, a delivery of its own (counted as "filtered").
    With `sources` (the ids of each source of a mixture), the same counts per source too."""
    flat = np.fromiter((i for rank in delivered for i in rank), dtype=np.int64)
    filtered = int((flat < 0).sum())
    counts = np.bincount(np.where(flat < 0, ~flat, flat), minlength=n)
    return {
        **_missed(counts),
        "delivered": int(flat.size) - filtered,
        **({"filtered": filtered} if filtered else {}),
        **({"by_source": [_missed(counts[ids.start : ids.stop]) for ids in sources]} if sources else {}),
    }


def cell(result: dict) -> str:
    """skipped / duplicated, or why there is no count."""
    if "cannot_resume" in result:
        return f"cannot resume ({result['cannot_resume'].split(':')[0]})"
    if "error" in result:
        return f"error ({result['error'].split(':')[0]})"
    return f"{result['skipped']}/{result['duplicated']}"


def _launch(peer: Peer, module: str, phases: list[Phase], timeout_s: float) -> list[Outcome]:
    """One launch: in this process, or as one process per rank; a launch that fails fails each of its phases."""
    try:
        if peer.processes:
            return launch(module, phases, timeout_s)
        return play(peer, phases, range(phases[0].world), lambda states: [states])
    except Exception as err:
        return [Outcome(error=error_text(err))] * len(phases)


def _result(n: int, stop: Outcome | None, outcome: Outcome, sources: Sequence[range] = ()) -> dict:
    """Counts of the stop and the resume together (or of the control alone), or why there are none."""
    if stop is not None and stop.error:  # nothing was saved: what ran after it is no resume
        return {"error": f"the stop failed: {stop.error}"}
    if outcome.error:
        key = "cannot_resume" if stop is not None else "error"
        return {key: outcome.error, **({"state_bytes": len(pickle.dumps(stop.saved))} if stop and stop.saved else {})}
    if stop is None:
        return tally(n, outcome.ids, sources)
    return {"state_bytes": len(pickle.dumps(stop.saved)), **tally(n, stop.ids + outcome.ids, sources)}


def _resume(fault: Fault, same_launch: bool, index: dict, stopped: list[Outcome]):
    """Where a fault's resume starts: nothing (the control), its stop's phase in the same launch, or its state."""
    if fault.after is None:
        return None
    key = index[fault.key]
    return key if same_launch else stopped[key].saved


def exactly_once(
    peer: Peer,
    module: str,
    n: int,
    stop_updates: int,
    faults: tuple[Fault, ...] = FAULTS,
    timeout_s: float = 600.0,
    sources: Sequence[range] = (),
) -> dict[str, dict]:
    """Every fault on one system, as few launches as the script allows: one per world size. The first launch (at
    the world size every fault stops at) makes the stops, the resumes at that size and its control; each other
    world size resumes from the saved states in a launch of its own. Data is written once, in a temporary
    directory, in the system's own format. `module` names the adapter module (`module:NAME`: its NAME, not its
    PEER, as a process rank loads it); `sources`, for a mixture, the ids of each source (counted apart too)."""
    (before,) = {f.before for f in faults if f.after is not None} or {faults[0].before}
    with tempfile.TemporaryDirectory(prefix="loader-peers-") as directory:
        data = Path(directory) / "data"
        peer.prepare(n, data)

        def phase(fault: Fault, world: int, steps, resume=None) -> Phase:
            resumed = resume is not None
            return Phase(
                n,
                world,
                fault.batch(world, resumed),
                fault.accum,
                tuple(steps),
                resume,
                data,
                fault.schedule(stop_updates),
            )

        stops = {f.key: f for f in faults if f.after is not None}
        first = [phase(f, before, f.stop(stop_updates)) for f in stops.values()]
        index = {key: i for i, key in enumerate(stops)}
        worlds = sorted({before} | {f.after or f.before for f in faults}, key=lambda w: (w != before, w))
        results: dict[str, dict] = {}
        stopped: list[Outcome] = []
        for world in worlds:
            mine = [f for f in faults if (f.after or f.before) == world]
            resumes = [phase(f, world, [None] * world, _resume(f, world == before, index, stopped)) for f in mine]
            phases = (first if world == before else []) + resumes
            outcomes = _launch(peer, module, phases, timeout_s)
            if world == before:
                stopped, outcomes = outcomes[: len(first)], outcomes[len(first) :]
            for f, outcome in zip(mine, outcomes):
                stop = None if f.after is None else stopped[index[f.key]]
                results[f.label] = _result(n, stop, outcome, sources)
    return {f.label: results[f.label] for f in faults}
