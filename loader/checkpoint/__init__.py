"""Checkpoints of a training job: model, optimizer, scheduler, RNG and input progress of one completed step.

- `merge`: every rank's loader state as the one state a checkpoint keeps (`merge_states`);
- `lockstep`: whether one rank's state may stand for every rank (checked at save time, through the store);
- `publish`: atomic publication of a checkpoint directory and the search for the newest that verifies;
- `save`: `save_checkpoint` / `resume` (DCP for model and optimizer, the merged progress, every rank's RNG);
- `ledger`, `audit`, `replay`: the identity ledger, its exactly-once audit, and the restart budget.

The names below are imported when first used: the loader imports `lockstep` on every process, and must not pull
torch.distributed.checkpoint (~0.6 s) into each one.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "merge_states": "merge",
    "CheckpointError": "publish",
    "latest": "publish",
    "SaveError": "save",
    "global_progress": "save",
    "load_checkpoint": "save",
    "resume": "save",
    "save_checkpoint": "save",
    "Ledger": "ledger",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loader.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"loader.checkpoint.{_EXPORTS[name]}"), name)
