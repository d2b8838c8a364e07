"""The loader as a `torch.distributed.checkpoint` Stateful, for jobs that run their own DCP flow (torchtitan's
`CheckpointManager(dataloader=LoaderState(dl), ...)`) instead of `loader.checkpoint.save_checkpoint`."""

from __future__ import annotations

import json

from torch.distributed.checkpoint.stateful import Stateful

from loader.checkpoint.save import global_progress


class LoaderState(Stateful):
    """A ResumableDataLoader as a DCP Stateful, under one replicated key (the merged progress as JSON)."""

    def __init__(self, loader, group=None):
        self.loader, self.group = loader, group

    def state_dict(self) -> dict:
        return {"progress": json.dumps(global_progress(self.loader, self.group))}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loader.load_state_dict(json.loads(state_dict["progress"]))
