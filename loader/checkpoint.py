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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils._pytree import tree_map_only

from loader.collectives import all_gather, broadcast, distributed, rank, world_size
from loader.publish import CheckpointError, check_arguments, latest, publish, verify
from loader.sampler import ResumableSampler
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
    state = loader.state_dict(check_lockstep=False)  # gathered from every rank: none stands alone
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


# What a failed save or load raises: DCP's CheckpointException is a BaseException, which `except Exception` misses.
_FAILURES = (Exception, CheckpointException)


class SaveError(OSError):
    """A checkpoint was not published. Every rank of the save raises it, promptly, naming each failing rank and its
    error; the checkpoints already published are untouched, so the previous one is still the newest.

    An `OSError` because the usual causes are the filesystem's (disk full, EIO, quota, permissions, a file-size
    limit): `errno` is the first failing rank's OS error number (None when no rank failed with an `OSError`),
    `failures` maps each failing rank to its error, as text."""

    def __init__(self, step: int, where: str, failures: dict[int, str], errno: int | None):
        causes = "; ".join(f"rank {r}: {what}" for r, what in sorted(failures.items()))
        super().__init__(
            f"the checkpoint of step {step} was not published ({where}): {causes}. The newest published checkpoint "
            f"is unchanged; fix the cause (disk space, quota, permissions, a file-size limit) and save again"
        )
        self.errno, self.step, self.failures = errno, step, failures


@dataclass(frozen=True)
class _Failed:
    """Rank 0's verdict that a save failed, broadcast so that every rank raises the same SaveError."""

    where: str
    failures: dict[int, str]
    errno: int | None


def _errors_of(err: BaseException, me: int) -> dict[int, BaseException]:
    """The errors behind `err`, by rank: DCP reports every rank's (a `CheckpointException`), anything else is ours."""
    return {r: e for r, (e, _) in err.failures.items()} if isinstance(err, CheckpointException) else {me: err}


def _failures_of(err: BaseException, me: int) -> dict[int, str]:
    """`_errors_of` as text: our own CheckpointErrors say everything already, others are named by type."""
    return {
        r: str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        for r, e in _errors_of(err, me).items()
    }


def _failed(err: BaseException, me: int, where: str) -> _Failed:
    errors = _errors_of(err, me)
    first_os = next((e.errno for _, e in sorted(errors.items()) if isinstance(e, OSError)), None)
    return _Failed(where, _failures_of(err, me), first_os)


def _raise(step: int, failed: _Failed, cause: BaseException | None) -> NoReturn:
    raise SaveError(step, failed.where, failed.failures, failed.errno) from cause


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

    Returns the published directory on every rank. A failure on any rank raises a `SaveError` (an `OSError`) on
    every rank, naming the failing ranks and causes, and leaves every published checkpoint untouched."""
    check_arguments(step, keep_last, {} if manifest_extra is None else manifest_extra)  # on every rank alike
    progress = global_progress(loader, group)
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

    if rank(group) != 0:
        return _write_as_other_rank(step, state, group)

    def prepare() -> None:  # the ledger's record of finished epochs can fail like the files: told to every rank
        if ledger is not None:
            ledger.record_finished(progress, loader)

    return _publish_as_rank0(run_dir, step, state, extra, keep_last, group, prepare)


# Two broadcasts from rank 0 keep all ranks in step, whatever fails where: (1) the directory to write into, or a
# failure before any writing; (2) the published path, or the failure. DCP itself reports a rank's write error to
# every rank, so no rank is left waiting for another.


def _publish_as_rank0(
    run_dir, step: int, state: dict, extra: dict, keep_last, group, prepare: Callable[[], None]
) -> Path:
    written = None

    def write(tmp: Path) -> None:
        nonlocal written
        broadcast(str(tmp), group)
        written = tmp
        _dcp(dcp.save, state, tmp, group)

    try:
        prepare()
        published = publish(run_dir, step, write, manifest_extra=extra, keep_last=keep_last)
    except BaseException as err:
        where = f"in {run_dir}" if written is None else f"writing {written}, now removed"
        failed = _failed(err, 0, where)
        if written is None:
            broadcast(failed, group)
        broadcast(failed, group)
        if not isinstance(err, _FAILURES):
            raise  # KeyboardInterrupt, SystemExit: the other ranks were told, this one stops
        _raise(step, failed, err)
    broadcast(str(published), group)
    return published


def _write_as_other_rank(step: int, state: dict, group) -> Path:
    target, failure = broadcast(None, group), None
    if isinstance(target, str):
        try:
            _dcp(dcp.save, state, target, group)
        except _FAILURES as err:  # reported after rank 0's verdict, so no rank waits forever
            failure = err
    outcome = broadcast(None, group)
    if isinstance(outcome, _Failed):
        _raise(step, outcome, failure)
    if failure is not None:
        _raise(step, _failed(failure, rank(group), f"writing {target}"), failure)
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

    All or nothing, on every rank: the manifest is verified and checked against this run (dataset fingerprint,
    progress format), and model, optimizer, scheduler, scaler, RNG and loader states are all read and validated
    before any of them changes. A failure on any rank raises a CheckpointError on every rank, naming the checkpoint,
    the ranks and the cause, and leaves all of them as they were, so a caller may fall back to a fresh start. The
    price: model and optimizer states are read into a second copy first (on their device)."""
    path = Path(path)
    fresh_optimizer = not optimizer.state
    try:
        step, parts = _read_checkpoint(path, model, optimizer, loader, scheduler, scaler, group)
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()  # get_state_dict gave it a state (a step with lr 0) to learn its layout
        raise
    loader.load_state_dict(parts["progress"])
    weights = parts["weights"]
    set_state_dict(model, optimizer, model_state_dict=weights["model"], optim_state_dict=weights["optim"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None:
            target.load_state_dict(parts["extras"][name])
    rng, mine = parts["rng"], rank(group)
    if mine < len(rng):
        _set_rng_state(rng[mine])
    else:
        _seed_new_rank(mine, len(rng), step)
    return step


def _read_checkpoint(path: Path, model, optimizer, loader, scheduler, scaler, group) -> tuple[int, dict]:
    """Every part of the checkpoint, read and validated, nothing applied. Each stage ends with the ranks agreeing on
    its outcome, so they all go on, or all raise, together."""
    verdict = None
    if rank(group) == 0:
        try:
            verify(path)  # checksums: read every byte once, on one rank
        except CheckpointError as err:
            verdict = str(err)
    verdict = broadcast(verdict, group)
    if verdict is not None:
        raise CheckpointError(verdict)
    step = _agreed(path, group, lambda: _check_manifest(path, loader))
    parts = _agreed(path, group, lambda: _read_small_parts(path, loader, scheduler, scaler, group))
    parts["weights"] = _agreed(path, group, lambda: _read_weights(path, model, optimizer, group))
    return step, parts


def _agreed(path: Path, group, stage: Callable[[], Any]) -> Any:
    """stage() on every rank, then one all_gather of the outcomes: a rank that failed alone would leave the others
    applying a checkpoint it refused, or waiting for it in the next collective."""
    try:
        value, failure, reports = stage(), None, {}
    except _FAILURES as err:
        value, failure, reports = None, err, _failures_of(err, rank(group))
    failed = {r: text for report in all_gather(reports, group) for r, text in report.items()}
    if failed:
        ranks: dict[str, list[int]] = {}
        for r, text in sorted(failed.items()):
            ranks.setdefault(text, []).append(r)
        causes = "; ".join(
            f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {text.rstrip('.')}" for text, rs in ranks.items()
        )
        raise CheckpointError(
            f"checkpoint {path} was not loaded: {causes}. Nothing was changed: model, optimizer, scheduler, scaler, "
            f"RNG and loader are as they were"
        ) from failure
    return value


def _check_manifest(path: Path, loader) -> int:
    """The manifest against this run: format, order fingerprint, dataset. Returns the step."""
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
            f"here: the source's shards (names, sample counts or sample keys) changed; resume with the shards of the "
            f"saved run"
        )
    return manifest.step


def _read_small_parts(path: Path, loader, scheduler, scaler, group) -> dict:
    """Loader progress, RNG states, scheduler and scaler: read (a collective), then validated."""
    state = {"loader": {"progress": ""}, "rng": {"all": b""}, "extras": {"blob": b""}}
    _dcp(dcp.load, state, path, group)
    extras = _from_bytes(state["extras"]["blob"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None and not extras[name]:
            raise CheckpointError(f"checkpoint {path} has no {name} state, but a {name} was passed to load it into")
    progress = json.loads(state["loader"]["progress"])
    try:
        _check_progress(loader, progress)
    except StateError as err:
        raise CheckpointError(f"checkpoint {path}: the loader progress does not fit this run: {err}") from None
    return {"progress": progress, "extras": extras, "rng": pickle.loads(state["rng"]["all"])}


def _check_progress(loader, progress: dict) -> None:
    """The loader's own validation of a progress, without changing the loader: run on a fresh progress keeper of
    the same configuration (its load_state_dict validates in full, then replaces)."""
    sampler = loader.resumable_sampler
    if sampler is not None:
        ResumableSampler(sampler.order, sampler.layout, sampler.rank).load_state_dict(progress)
    else:
        loader._stream.check(progress)


def _read_weights(path: Path, model, optimizer, group) -> dict:
    """Model and optimizer states read into new tensors shaped like the live ones (a collective): a mismatch in
    shape or keys fails here, while the model and optimizer are untouched."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    weights = tree_map_only(torch.Tensor, torch.empty_like, {"model": model_sd, "optim": optim_sd})
    _dcp(dcp.load, weights, path, group)
    return weights


def resume(run_dir: str | Path, **objects) -> int:
    """Load the newest checkpoint of `run_dir` that verifies, if any; returns its step (0 for a fresh run).

    Rank 0 chooses (torn or corrupted checkpoints are skipped with a warning) and every rank loads that one."""
    group = objects.get("group")
    found = broadcast(latest(run_dir) if rank(group) == 0 else None, group)
    return 0 if found is None else load_checkpoint(found, **objects)
