"""The loader as a `torch.distributed.checkpoint` Stateful, for jobs that run their own DCP flow (torchtitan's
`CheckpointManager(dataloader=LoaderState(dl), ...)`) instead of `loader.checkpoint.save_checkpoint`, and the model
with its optimizer as another, for such jobs without a framework of their own."""

from __future__ import annotations

import json

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from loader.checkpoint.save import global_progress


class LoaderState(Stateful):
    """A ResumableDataLoader as a DCP Stateful, under one replicated key (the merged progress as JSON). Its
    state_dict() is a collective over `group` (default: the world): under a mesh, one progress per data-parallel
    rank, its peers' checked equal (see `global_progress`)."""

    def __init__(self, loader, group=None):
        self.loader, self.group = loader, group

    def state_dict(self) -> dict:
        return {"progress": json.dumps(global_progress(self.loader, self.group))}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loader.load_state_dict(json.loads(state_dict["progress"]))


class ModelAndOptimizer(Stateful):
    """A model and its optimizer as DCP's sharded state dicts (torchtitan's ModelWrapper and OptimizersContainer
    in one): FSDP2, tensor parallel or plain, saved at one mesh shape and loaded at any other."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
