"""Coherent checkpoints: model, optimizer, scheduler, scaler, RNG and input progress of one completed step.

Why one function for all of it: a restart is coherent only if every part comes from the same optimizer step.
`save_checkpoint` is called by every rank after the optimizer step; it merges the loader progress of all ranks
(one small all_gather), writes model and optimizer with torch.distributed.checkpoint (DCP: sharded or replicated,
loadable at any world size), and publishes the directory atomically (`loader.publish`): a checkpoint either
verifies completely or is skipped by `latest`.

DCP keeps one value per key and fails a load that asks for a key never saved, so nothing here is saved under a
per-rank key: the merged progress and the gathered RNG states of all ranks are replicated, identical values.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from loader.collectives import all_gather, broadcast, distributed, rank, world_size
from loader.publish import CheckpointError, latest, publish, verify
from loader.state import FORMAT, VERSION, StateError, attach_base, check_fingerprint, detach_base, merge_states

CHECKPOINT_FORMAT = 1


def _dcp(call, state: dict, path, group) -> None:
    """dcp.save or dcp.load; in one process it runs without a process group on purpose, so DCP's warning that it
    does is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        call(state, checkpoint_id=str(path), process_group=group, no_dist=not distributed())


def global_progress(loader, group=None) -> dict:
    """The loader progress of all ranks, merged: loadable at any world size. A collective: every rank calls it.

    Ranks exchange their states without the base they share (see `detach_base`): O(world size) bytes. The states
    are of one step by construction, so ranks that consumed unequal amounts (DDP Join) merge as they are."""
    state = loader.state_dict()
    gathered = all_gather(detach_base(state), group)
    if state.get("kind") != "rank":
        return merge_states(gathered)
    return merge_states(attach_base(gathered, state["base"]), uneven=True)


class LoaderState(Stateful):
    """A ResumableDataLoader as a DCP Stateful, under one replicated key (the merged progress as JSON)."""

    def __init__(self, loader, group=None):
        self.loader, self.group = loader, group

    def state_dict(self) -> dict:
        return {"progress": json.dumps(global_progress(self.loader, self.group))}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loader.load_state_dict(json.loads(state_dict["progress"]))


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _seed_new_rank(rank: int, saved_world: int, step: int) -> None:
    """A rank that did not exist when the checkpoint was saved gets fresh, distinct, reproducible streams."""
    seed = (step * 1_000_003 + saved_world * 7919 + rank) % (2**32)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=False)


def _fingerprint_of(loader) -> dict | None:
    sampler = getattr(loader, "resumable_sampler", None)
    return None if sampler is None else sampler.order.fingerprint()


def _dataset_fingerprint(loader) -> str | None:
    """A source's own digest (e.g. WebDataset shard names and sizes), when it has one."""
    fingerprint = getattr(loader.dataset, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader,
    scheduler=None,
    scaler=None,
    manifest_extra: dict | None = None,
    keep_last: int | None = 3,
    ledger=None,
    group=None,
) -> Path:
    """Publish the checkpoint of completed optimizer step `step`; every rank calls it, after the step.

    Returns the published directory on every rank. A failure leaves every published checkpoint untouched."""
    progress = global_progress(loader, group)
    if ledger is not None and rank(group) == 0:
        ledger.record_finished(progress, loader)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "loader": {"progress": json.dumps(progress)},
        "rng": {"all": pickle.dumps(all_gather(_rng_state(), group))},
        "extras": {"blob": _to_bytes({
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(),
        })},
    }
    extra = {
        "checkpoint_format": CHECKPOINT_FORMAT,
        "step": step,
        "epoch": progress.get("epoch"),
        "world_size": world_size(group),
        "progress_format": [FORMAT, VERSION],
        "fingerprint": _fingerprint_of(loader),
        "dataset": _dataset_fingerprint(loader),
        **(manifest_extra or {}),
    }

    if rank(group) == 0:
        return _publish_as_rank0(run_dir, step, state, extra, keep_last, group)
    return _write_as_other_rank(step, state, group)


# Two broadcasts from rank 0 keep all ranks in step, whatever fails where: (1) the directory to write into, or an
# error before any writing; (2) the published path, or an error.
_ERROR = "error:"


def _publish_as_rank0(run_dir, step: int, state: dict, extra: dict, keep_last, group) -> Path:
    announced = False

    def write(tmp: Path) -> None:
        nonlocal announced
        broadcast(str(tmp), group)
        announced = True
        _dcp(dcp.save, state, tmp, group)

    try:
        if (Path(run_dir) / f"step-{step:09d}").exists():
            raise FileExistsError(f"the checkpoint of step {step} is already published in {run_dir}")
        published = publish(run_dir, step, write, manifest_extra=extra, keep_last=keep_last)
    except BaseException as err:
        if not announced:
            broadcast(f"{_ERROR}{err}", group)
        broadcast(f"{_ERROR}{err}", group)
        raise
    broadcast(str(published), group)
    return published


def _write_as_other_rank(step: int, state: dict, group) -> Path:
    target, failure = broadcast(None, group), None
    if not target.startswith(_ERROR):
        try:
            _dcp(dcp.save, state, target, group)
        except Exception as err:  # noqa: BLE001 - reported after rank 0's verdict, so no rank waits forever
            failure = err
    outcome = broadcast(None, group)
    if outcome.startswith(_ERROR) or failure is not None:
        raise CheckpointError(
            f"the checkpoint of step {step} was not published: {outcome[len(_ERROR):] if outcome.startswith(_ERROR) else failure}"
        )
    return Path(outcome)


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader,
    scheduler=None,
    scaler=None,
    group=None,
) -> int:
    """Restore everything saved by `save_checkpoint` at any world size; returns the step. Every rank calls it.

    The manifest is verified and checked against this run (dataset fingerprint, progress format) before anything
    is loaded; a mismatch raises a CheckpointError naming the checkpoint and the field."""
    path = Path(path)
    verdict = None
    if rank(group) == 0:
        try:
            verify(path)  # checksums: read every byte once, on one rank
        except CheckpointError as err:
            verdict = str(err)
    verdict = broadcast(verdict, group)
    if verdict is not None:
        raise CheckpointError(verdict)
    manifest = verify(path, check_checksums=False)
    extra = dict(manifest.extra)
    if extra.get("checkpoint_format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: checkpoint_format is {extra.get('checkpoint_format')!r}, this loader reads "
            f"{CHECKPOINT_FORMAT}: load it with the release that wrote it"
        )
    current = _fingerprint_of(loader)
    try:
        if current is not None and extra.get("fingerprint") is not None:
            check_fingerprint(extra["fingerprint"], current, where=f"checkpoint {path}")
    except StateError as err:
        raise CheckpointError(str(err)) from None
    saved_dataset, current_dataset = extra.get("dataset"), _dataset_fingerprint(loader)
    if None not in (saved_dataset, current_dataset) and saved_dataset != current_dataset:
        raise CheckpointError(
            f"checkpoint {path}: dataset fingerprint is {saved_dataset!r} in the checkpoint but {current_dataset!r} "
            f"here: the source's shards (names or sample counts) changed; resume with the shards of the saved run"
        )
    # The small parts first: they are checked before DCP loads the model and optimizer in place.
    state = {"loader": {"progress": ""}, "rng": {"all": b""}, "extras": {"blob": b""}}
    _dcp(dcp.load, state, path, group)
    extras = _from_bytes(state["extras"]["blob"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None and extras[name] is None:
            raise CheckpointError(f"checkpoint {path} has no {name} state, but a {name} was passed to load it into")
    try:  # validated in full before it changes anything
        loader.load_state_dict(json.loads(state["loader"]["progress"]))
    except StateError as err:
        raise CheckpointError(f"checkpoint {path}: the loader progress does not fit this run: {err}") from None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    weights = {"model": model_sd, "optim": optim_sd}
    _dcp(dcp.load, weights, path, group)
    set_state_dict(model, optimizer, model_state_dict=weights["model"], optim_state_dict=weights["optim"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None:
            target.load_state_dict(extras[name])
    rng = pickle.loads(state["rng"]["all"])
    mine = rank(group)
    if mine < len(rng):
        _set_rng_state(rng[mine])
    else:
        _seed_new_rank(mine, len(rng), manifest.step)
    return manifest.step


def resume(run_dir: str | Path, **objects) -> int:
    """Load the newest checkpoint of `run_dir` that verifies, if any; returns its step (0 for a fresh run).

    Rank 0 chooses (torn or corrupted checkpoints are skipped with a warning) and every rank loads that one."""
    group = objects.get("group")
    found = broadcast(latest(run_dir) if rank(group) == 0 else None, group)
    return 0 if found is None else load_checkpoint(found, **objects)
