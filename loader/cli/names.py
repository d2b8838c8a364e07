"""How the audit names samples: by WebDataset shard and key, or by mixture source and index; and the documents a
keep= mask filtered before packing, by number."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from loader.checkpoint import audit
from loader.checkpoint.ledger import LedgerError
from loader.sources.array_cache import chunks
from loader.sources.kept import read_mask

if TYPE_CHECKING:
    from loader.sources import MixturePlan


def describe_by_key(shards: str) -> Callable[[int], str]:
    from loader.sources import WebDatasetSource

    source = WebDatasetSource(shards, progress=False)

    def describe(index: int) -> str:
        shard, key = source.sample_key(index)
        return f"{index} ({os.path.basename(shard)}:{key})"

    return describe


def _in_epoch(plan: MixturePlan, window: int) -> str:
    """Where a change at `window` falls when the plan's loader epochs continue its stream: that epoch's position."""
    if not plan.epochs_continue:
        return ""
    epoch, position = divmod(window * plan.window, plan.num_samples)
    return f"; epoch {epoch}, position {position}"


def read_plan(plan_path: str | os.PathLike) -> MixturePlan:
    """A run's mixture plan file (MixturePlan.save); a ValueError names the file and what is wrong with it."""
    from loader.sources import MixturePlan

    try:
        return MixturePlan.load(plan_path)
    except (OSError, ValueError) as err:  # the plan file checks itself as it is read; JSON errors are ValueErrors
        raise ValueError(str(err) if os.fspath(plan_path) in str(err) else f"{plan_path}: {err}") from None


def by_source(plan_path: str) -> tuple[audit.Grouping, Callable[..., str]]:
    """The run's mixture plan as the audit's grouping (a row per source) and a describer (position, source, index);
    a LedgerError names the plan file and what is wrong with it."""
    try:
        plan = read_plan(plan_path)
    except ValueError as err:
        raise LedgerError(f"--mixture {err}") from None

    def describe(position: int, epoch: int = 0) -> str:
        (source,), (index,) = plan.locate(plan.in_epoch([position], epoch))
        return f"{position} ({plan.names[source]}:{index})"

    online = {window: step for step, window in plan.requests}
    counts, _ = plan.window_table(np.array(sorted(online), dtype=np.int64))
    shares = {k: "/".join(map(str, row)) for k, row in zip(sorted(online), counts.tolist())}
    notes = [
        f"mixture weights changed online at step {step}: from position {k * plan.window} (window {k}"
        f"{_in_epoch(plan, k)}), {'/'.join(plan.names)} slots per window {shares[k]}"
        for k, step in sorted(online.items(), key=lambda item: item[1])
    ]
    notes += [
        f"mixture schedule changed at position {k * plan.window} (window {k}{_in_epoch(plan, k)}): positions "
        f"before it follow the plan before the change"
        for k in plan.changes
        if k not in online
    ]
    return audit.Grouping(plan.names, plan.source_of, plan.num_samples, notes), describe


class MaskedDocuments:
    """The documents a keep= mask (`PackedSource(keep=)`'s .npy) drops, for `audit --documents`: named by their
    number in stream order, as the mask counts them (the command line has no token files to name them by; the
    Python audit, given the PackedSource, names them by file and offset). The same in every epoch."""

    def __init__(self, path: str) -> None:
        try:
            mask, _ = read_mask(path, label="--documents ")
            self.dropped = np.concatenate([np.flatnonzero(~chunk) + low for low, chunk in chunks(mask)])
        except (OSError, ValueError) as err:  # a read of the mask's file: a truncated one fails here
            named = str(err) if str(err).startswith("--documents") else f"--documents {path!r}: {err}"
            raise LedgerError(named) from None

    def filtered_documents(self, epoch: int) -> np.ndarray:
        return self.dropped

    def describe_document(self, number: int) -> str:
        return f"document {number}"
