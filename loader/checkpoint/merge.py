"""`merge_states`: the states of all ranks, of either kind, as the one state a checkpoint keeps.

Map-style states merge into committed positions (`loader.core.state`); stream states are checked and kept side by
side per rank (`loader.streams.state`). This is the one place that knows both kinds.

Under tensor, context, pipeline or expert parallelism, several processes hold the state of one data-parallel rank
(`loader.core.mesh`): their states are equal by construction, so one of each is kept (`one_per_data_rank`), and a
peer whose state differs is refused, never merged silently.
"""

from __future__ import annotations

from collections.abc import Sequence

from loader.core.checks import is_int
from loader.core.state import StateError, check_header, merge_rank_states, short
from loader.streams.state import merge_stream_states

_OBSERVED = ("lockstep",)  # what a state saw of the other ranks when it was taken, not its progress: peers that
# looked at different moments may differ in it


def _differences(first: dict, other: dict) -> list[str]:
    """The progress fields in which two states differ."""
    fields = first.keys() | other.keys()
    return sorted((key for key in fields if key not in _OBSERVED and first.get(key) != other.get(key)), key=str)


def _described(first: dict, other: dict, fields: list[str], most: int = 3) -> str:
    """The first few differing fields, with their values as short as an error message needs (a corrupted state may
    hold megabytes in a field)."""
    plain = (int, str, bool, type(None))
    names = [str(key)[:40] for key in fields[:most]]
    shown = [
        f"{name} {short(first.get(key))} vs {short(other.get(key))}"
        if isinstance(first.get(key), plain) and isinstance(other.get(key), plain)
        else name
        for name, key in zip(names, fields)
    ]
    return ", ".join(shown + ([f"{len(fields) - most} more"] if len(fields) > most else []))


def one_per_data_rank(states: list, names: Sequence[str] | None = None) -> list:
    """The states of every process, one per data-parallel rank, in the order first seen. The peers of one rank
    deliver the same batches, so their states must be equal: one that differs (a peer that delivered more or
    fewer batches, or loaded another state, than its replica: a bug in the training loop) raises a StateError
    naming both. `names[i]` names states[i] (default "states[i]"; a gather over the world names global ranks)."""
    names = [f"states[{i}]" for i in range(len(states))] if names is None else names
    first_of: dict[int, int] = {}
    kept = []
    for i, state in enumerate(states):
        rank = state.get("rank") if isinstance(state, dict) else None
        j = first_of.setdefault(rank, i) if is_int(rank) else i  # no rank: the merge names what is wrong with it
        if j == i:
            kept.append(state)
        elif differing := _differences(states[j], state):
            raise StateError(
                f"{names[j]} and {names[i]} hold the progress of the same data-parallel rank {rank}, but it differs "
                f"({_described(states[j], state, differing)}): the peers of a data-parallel rank (tensor, pipeline, "
                f"... parallel) must iterate their loaders alike, every batch, set_epoch and load_state_dict. Nothing "
                f"was merged"
            )
    return kept


def merge_states(states: list[dict], uneven: bool = False) -> dict:
    """Combine the states of all ranks, saved at one step of one world size, into the global progress (see
    `loader.core.state.merge_rank_states`; `uneven` is for map-style states gathered by a collective). The states
    of every process of a mesh may be given: one per data-parallel rank is kept (`one_per_data_rank`)."""
    if not isinstance(states, (list, tuple)) or not states:
        raise StateError("merge_states takes a non-empty list of per-rank state dicts (one per rank)")
    kinds = {check_header(s, ("rank", "stream"), f"states[{i}]") for i, s in enumerate(states)}
    if len(kinds) > 1:
        raise StateError("merge_states got map-style and stream states mixed: they come from different loaders")
    states = one_per_data_rank(list(states))
    return merge_stream_states(states) if kinds == {"stream"} else merge_rank_states(states, uneven)
