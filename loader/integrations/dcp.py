"""The loader as a `torch.distributed.checkpoint` Stateful, for jobs that run their own DCP flow (torchtitan's
`CheckpointManager(dataloader=LoaderState(dl), ...)`) instead of `loader.checkpoint.save_checkpoint`, and the model
with its optimizer as another, for such jobs without a framework of their own, and `dcp_load`: DCP's load without
running code from the checkpoint."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from loader.checkpoint.plain import PlainLoadPlanner, PlainReader, check_metadata
from loader.checkpoint.publish import CheckpointWarning
from loader.checkpoint.save import (
    check_change,
    check_dataset,
    dataset_fingerprint,
    global_progress,
    plan_record,
    recorded_plan,
)
from loader.core.state import StateError
from loader.dataloader import ResumableDataLoader

_WHERE = "the DCP checkpoint loaded into LoaderState"  # DCP does not tell a Stateful which checkpoint it loads


class LoaderState(Stateful):
    """A ResumableDataLoader as a DCP Stateful, under replicated keys: the merged progress and the dataset's
    fingerprint (what `save_checkpoint`'s manifest records), as JSON strings (DCP saves them as bytes; nothing is
    unpickled to read them). Once a Mixture's weights changed online (`change_mixture`), `dataset` holds the
    fingerprint and the plan with its changes, `{"fingerprint": ..., "mixture_plan": ...}`, a few hundred bytes, so
    that the replayed steps train the recorded weights; without a change it is the fingerprint alone, as before.
    Its state_dict() is a collective over `group` (default: the world): under a mesh, one progress per data-parallel
    rank, its peers' checked equal (see `global_progress`). load_state_dict() refuses what `resume` refuses: another
    dataset (a Mixture's weights or schedule edited without `amends=`, or a recorded plan that is not this
    mixture's with changes added), or a declared change of schedule inside what the checkpoint committed. It does
    not hold the step: set `loader.step` after loading (`change_mixture` needs it)."""

    def __init__(self, loader: ResumableDataLoader, group: dist.ProcessGroup | None = None) -> None:
        self.loader, self.group = loader, group

    def state_dict(self) -> dict:
        fingerprint, plan = dataset_fingerprint(self.loader), plan_record(self.loader)
        return {
            "progress": json.dumps(global_progress(self.loader, self.group)),
            "dataset": json.dumps({"fingerprint": fingerprint, **plan} if plan else fingerprint),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        progress, saved = json.loads(state_dict["progress"]), json.loads(state_dict["dataset"])
        plan = None
        if isinstance(saved, dict):  # a Mixture changed online: its fingerprint and the plan with the changes
            plan, saved = recorded_plan(saved, self.loader, _WHERE), saved.get("fingerprint")
        check_dataset(saved, self.loader, _WHERE, plan)
        try:
            check_change(saved, self.loader, progress)
        except StateError as err:
            raise StateError(f"{_WHERE}: the loader progress does not fit this run: {err}") from None
        self.loader.load_state_dict(progress)  # validated in full first: a refusal leaves the plan as it was too
        if plan is not None:  # recorded_plan returned one: the dataset is a Mixture
            mixture: Any = self.loader.dataset
            mixture.use_plan(plan)  # the weights changed online up to the checkpoint


class ModelAndOptimizer(Stateful):
    """A model and its optimizer as DCP's sharded state dicts (torchtitan's ModelWrapper and OptimizersContainer
    in one): FSDP2, tensor parallel or plain, saved at one mesh shape and loaded at any other."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class _ProgressOnly(Stateful):
    """A LoaderState reading the layout LoaderState wrote before 0.1.0: the progress only, no dataset fingerprint
    (torch's dcp.load fails on it with "Missing key ... dataset")."""

    def __init__(self, target: LoaderState, where: str):
        self.target, self.where = target, where

    def state_dict(self) -> dict:
        return {"progress": ""}  # a placeholder: DCP replaces it with the saved string

    def load_state_dict(self, state_dict: dict) -> None:
        self.target.load_state_dict({"progress": state_dict["progress"], "dataset": json.dumps(None)})
        warnings.warn(
            f"{self.where} holds the loader progress only, as LoaderState wrote it before release 0.1.0: loaded with "
            f"the order's check (length, seed, shuffle) as that version did, without checking that the dataset "
            f"(shards, token files, a Mixture's plan) is the one it was saved with; the next save records it",
            CheckpointWarning,
            stacklevel=4,
        )


def dcp_load(state_dict: dict, checkpoint_id: str | os.PathLike, **options: Any) -> None:
    """`torch.distributed.checkpoint.load`, except that nothing the checkpoint holds runs code: its `.metadata` is
    read with only DCP's metadata types, values besides tensors with torch.load(weights_only=True); a crafted file
    raises a CheckpointError naming it and what it names (DCP's own load unpickles both). `options`: dcp.load's
    (process_group=, no_dist=...). A LoaderState saved before 0.1.0 (its progress only) loads with a warning."""
    saved = check_metadata(checkpoint_id)
    request = {
        key: _ProgressOnly(value, f"the DCP checkpoint {checkpoint_id}'s {key!r}")
        if isinstance(value, LoaderState) and f"{key}.progress" in saved and f"{key}.dataset" not in saved
        else value
        for key, value in state_dict.items()
    }
    dcp.load(
        request,
        checkpoint_id=checkpoint_id,
        storage_reader=PlainReader(checkpoint_id),
        planner=PlainLoadPlanner(),
        **options,
    )
    state_dict.update((key, value) for key, value in request.items() if not isinstance(value, Stateful))
