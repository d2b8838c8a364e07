"""How the audit names samples: by WebDataset shard and key, or by mixture source and index."""

from __future__ import annotations

import os
from collections.abc import Callable

from loader.checkpoint import audit
from loader.checkpoint.ledger import LedgerError


def describe_by_key(shards: str):
    from loader.sources import WebDatasetSource

    source = WebDatasetSource(shards, progress=False)

    def describe(index: int) -> str:
        shard, key = source.sample_key(index)
        return f"{index} ({os.path.basename(shard)}:{key})"

    return describe


def by_source(plan_path: str) -> tuple[audit.Grouping, Callable[[int], str]]:
    """The run's mixture plan as the audit's grouping (a row per source) and a describer (position, source, index);
    a LedgerError names the plan file and what is wrong with it."""
    from loader.sources import MixturePlan

    try:
        plan = MixturePlan.load(plan_path)
    except (OSError, ValueError) as err:  # the plan file checks itself as it is read; JSON errors are ValueErrors
        said = str(err) if os.fspath(plan_path) in str(err) else f"{plan_path}: {err}"
        raise LedgerError(f"--mixture {said}") from None

    def describe(position: int) -> str:
        (source,), (index,) = plan.locate([position])
        return f"{position} ({plan.names[source]}:{index})"

    notes = [f"mixture schedule changed at position {k * plan.window} (window {k}): positions before it follow the "
             f"plan before the change" for k in plan.changes]
    return audit.Grouping(plan.names, plan.source_of, plan.num_samples, notes), describe
