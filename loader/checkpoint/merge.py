"""`merge_states`: the states of all ranks, of either kind, as the one state a checkpoint keeps.

Map-style states merge into committed positions (`loader.core.state`); stream states are checked and kept side by
side per rank (`loader.streams.state`). This is the one place that knows both kinds.
"""

from __future__ import annotations

from loader.core.state import StateError, check_header, merge_rank_states
from loader.streams.state import merge_stream_states


def merge_states(states: list[dict], uneven: bool = False) -> dict:
    """Combine the states of all ranks, saved at one step of one world size, into the global progress (see
    `loader.core.state.merge_rank_states`; `uneven` is for map-style states gathered by a collective)."""
    if not isinstance(states, (list, tuple)) or not states:
        raise StateError("merge_states takes a non-empty list of per-rank state dicts (one per rank)")
    kinds = {check_header(s, ("rank", "stream"), f"states[{i}]") for i, s in enumerate(states)}
    if len(kinds) > 1:
        raise StateError("merge_states got map-style and stream states mixed: they come from different loaders")
    return merge_stream_states(states) if kinds == {"stream"} else merge_rank_states(states, uneven)
