"""Coherent checkpoints: model, optimizer, scheduler, scaler, RNG and input progress of one completed step.

Why one function for all of it: a restart is coherent only if every part comes from the same optimizer step.
`save_checkpoint` is called by every rank after the optimizer step; it merges the loader progress of all ranks
(one small all_gather), writes model and optimizer with torch.distributed.checkpoint (DCP: sharded or replicated,
loadable at any world size), and publishes the directory atomically (`loader.checkpoint.publish`): a checkpoint either
verifies completely or is skipped by `latest`.

DCP keeps one value per key and fails a load that asks for a key never saved, so nothing here is saved under a
per-rank key: the merged progress and the gathered RNG states of all ranks are replicated, identical values.

Trust: the loader never runs code from a checkpoint. Progress and RNG states are JSON, scheduler and scaler states
and every value DCP stores besides tensors are read with torch.load(weights_only=True) (tensors and plain data only;
anything else is refused, never run), DCP's own ``.metadata`` pickle is read by an unpickler that resolves only DCP's
metadata types (`loader.checkpoint.plain`), and a checkpoint holding a symbolic link is refused.
"""

from __future__ import annotations

import base64
import io
import json
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from errno import errorcode
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.utils._pytree import tree_map_only

from loader.checkpoint.merge import merge_states, one_per_data_rank
from loader.checkpoint.plain import PlainLoadPlanner, PlainReader, check_metadata, load_plain
from loader.checkpoint.publish import CheckpointError, CheckpointWarning, check_arguments, latest, publish, verify
from loader.core.collectives import all_gather, broadcast, distributed, from_rank0, global_ranks, rank, world_size
from loader.core.sampler import ResumableSampler
from loader.core.state import FORMAT, VERSION, StateError, attach_base, check_fingerprint, detach_base
from loader.streams.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from loader.checkpoint.ledger import Ledger

CHECKPOINT_FORMAT = 2  # 2: RNG states as JSON, nothing unpickled; 1 (refused) pickled them


def _dcp(call: Callable[..., Any], state: dict, path: str | Path, group: ProcessGroup | None, **options: Any) -> None:
    """dcp.save or dcp.load; in one process it runs without a process group on purpose, so DCP's warning that it
    does is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        call(state, checkpoint_id=str(path), process_group=group, no_dist=not distributed(), **options)


def _save(state: dict, path: str | Path, group: ProcessGroup | None) -> None:
    _dcp(dcp.save, state, path, group, storage_writer=_Writer(path))


def _load(state: dict, path: str | Path, group: ProcessGroup | None) -> None:
    check_metadata(path)
    _dcp(dcp.load, state, path, group, storage_reader=PlainReader(path), planner=PlainLoadPlanner())


class _Writer(FileSystemWriter):
    """DCP's file writer, except that a failed write raises an OSError with the OS's errno and message, and a path.
    Why: torch.save reports a full disk as a RuntimeError ("unexpected pos") with the OSError only in its
    __context__, which DCP drops when it sends a rank's error to the others."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            cause = _os_cause(err)
            if cause is None or (cause is err and cause.filename):
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename or str(self.path)) from err


def global_progress(loader: Any, group: ProcessGroup | None = None) -> dict:
    """The loader progress of all ranks, merged: loadable at any world size. A collective: every rank calls it.

    Ranks exchange their states without the base they share (see `detach_base`): O(world size) bytes. The states
    are of one step by construction, so ranks that consumed unequal amounts (DDP Join) merge as they are. Under a
    mesh, the peers of each data-parallel rank must hold equal states, one of which is kept; a StateError naming
    both global ranks refuses a peer that differs (see `loader.checkpoint.merge.one_per_data_rank`)."""
    state = loader.state_dict(check_lockstep=False)  # gathered from every rank: none stands alone
    names = [f"global rank {r}" for r in global_ranks(group)]
    gathered = one_per_data_rank(all_gather(detach_base(state), group), names)
    if state.get("kind") != "rank":
        return merge_states(gathered)
    return merge_states(attach_base(gathered, state["base"]), uneven=True)


def _rng_state() -> dict:
    """This process's generators as plain data: torch's CPU, numpy's and random's as `loader.streams.rng` packs them,
    and each CUDA device's in base64."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"cpu": rng_state(), "cuda": [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in cuda]}


def _set_rng_state(state: dict) -> None:
    set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def _check_rng(states: Any, mine: int) -> None:
    """The saved RNG state of this rank, set and then undone: the setters are its only full check, and a state that
    fails must fail before anything is applied."""
    if not isinstance(states, list):
        raise CheckpointError(f"the RNG states must be a list, one per rank, got {type(states).__name__}")
    if mine < len(states):
        current = _rng_state()
        try:
            _set_rng_state(states[mine])
        finally:
            _set_rng_state(current)


def _seed_new_rank(rank: int, saved_world: int, step: int) -> None:
    """A rank that did not exist when the checkpoint was saved gets fresh, distinct, reproducible streams."""
    seed = (step * 1_000_003 + saved_world * 7919 + rank) % (2**32)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _to_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


_PLAIN = "tensors, numbers, strings, bytes, None, and lists, tuples and dicts of them"


def _check_plain(states: dict[str, Any]) -> None:
    """Refuse at save time what resume would refuse: besides tensors, the states (name -> a state_dict()) must be
    data that `load_plain` reads back. Checked in one round trip of the states without their tensors; a TypeError
    names the first entry that is not plain data."""
    skeleton = tree_map_only(torch.Tensor, lambda _: None, states)
    if _plain_or_none(skeleton) is not None:
        return
    path, value = _refused(skeleton, ())
    where = f"{path[0]}.state_dict(){''.join(f'[{key!r}]' for key in path[1:])}" if path else "the saved states"
    raise TypeError(
        f"save_checkpoint: {where} is a {type(value).__name__}, which a checkpoint cannot hold: resume reads "
        f"checkpoints with torch.load(weights_only=True), which takes only {_PLAIN}; make the state_dict() return "
        f"those"
    )


def _plain_or_none(value: Any) -> bytes | None:
    """`value` saved by torch.save, if torch.load(weights_only=True) reads it back; else None."""
    try:
        blob = _to_bytes(value)
        load_plain(io.BytesIO(blob), "")
    except Exception:  # the load refused it, or torch.save did (a lambda, a lock)
        return None
    return blob


def _refused(value: Any, path: tuple) -> tuple[tuple, Any]:
    """The innermost part of `value`, itself refused, that `_plain_or_none` refuses: its path and value."""
    if isinstance(value, (dict, list, tuple)):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if _plain_or_none(item) is None:
                return _refused(item, (*path, key))
    return path, value


def _json(text: Any, what: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{what}: not JSON ({err}); the checkpoint was not written by this release") from None


def _fingerprint_of(loader: Any) -> dict | None:
    sampler = getattr(loader, "resumable_sampler", None)
    return None if sampler is None else sampler.order.fingerprint()


def _before_change(loader: Any) -> str | None:
    """The dataset's fingerprint before a change it declares (a Mixture's `amends=`): a checkpoint saved under it
    resumes, its progress checked against the change (`check_change`)."""
    before = getattr(loader.dataset, "fingerprint_before_change", None)
    return before() if callable(before) else None


def dataset_fingerprint(loader: Any) -> str | None:
    """A source's own digest (e.g. WebDataset shard names and sizes, a Mixture's plan and sources), when it has one:
    what a checkpoint records of the dataset (the manifest's "dataset", `LoaderState`'s), as the progress records
    only the order (length, seed, shuffle)."""
    fingerprint = getattr(loader.dataset, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None


def _of_earlier_release(loader: Any) -> str | None:
    """The dataset's fingerprint as the previous release recorded it, where it offers one that differs (a
    TokenSource's then held no file content): a checkpoint of that release resumes as it would have there."""
    earlier = getattr(loader.dataset, "fingerprint_of_earlier_release", None)
    return earlier() if callable(earlier) else None


def plan_record(loader: Any) -> dict:
    """The dataset's plan where it changed online (a Mixture's weights, `change_mixture`): JSON in the manifest, a
    few hundred bytes, which `resume` (and `LoaderState`) hands back to the dataset before it checks the fingerprint."""
    carried = getattr(loader.dataset, "carried_plan", None)
    plan = carried() if callable(carried) else None
    return {} if plan is None else {"mixture_plan": plan.to_dict()}


def recorded_plan(extra: dict, loader: Any, where: str, base: Any = None) -> Any:
    """The plan with the online changes a checkpoint recorded, checked to extend this run's dataset's own (or
    `base`'s), which `load_checkpoint` then takes: the steps replayed after the restart train under the recorded
    weights. None when it recorded none."""
    recorded = extra.get("mixture_plan")
    check = getattr(loader.dataset, "recorded_plan", None)
    if recorded is None:
        return None
    if not callable(check):
        raise StateError(
            f"{where}: the run changed a Mixture's weights online, but this loader's dataset is a "
            f"{type(loader.dataset).__name__}: resume it with the Mixture it trained"
        )
    try:
        return check(recorded, base)
    except ValueError as err:
        raise StateError(f"{where}: {err}") from None


def check_dataset(saved: str | None, loader: Any, where: str, plan: Any = None) -> None:
    """A checkpoint's dataset fingerprint against this loader's (under `plan`, the one the checkpoint recorded, if
    any): the same, the one before a change the dataset declares (then `check_change` checks the progress), or the
    previous release's (`check_change` warns). A StateError names `where`, both, and the files that changed where
    the dataset tells, otherwise: the same positions would name other samples."""
    current = dataset_fingerprint(loader) if plan is None else loader.dataset.fingerprint(plan)
    if None not in (saved, current) and saved not in (current, _before_change(loader), _of_earlier_release(loader)):
        explain = getattr(loader.dataset, "explain_fingerprint", None)
        changed = (explain(saved) if callable(explain) else None) or (
            "the source's shards (names, sample counts or sample keys), token files (names, sizes or content) or "
            "a Mixture's sources, weights or schedule changed"
        )
        raise StateError(
            f"{where}: dataset fingerprint is {saved!r} in the checkpoint but {current!r} here: {changed}; resume "
            f"with the dataset of the saved run, or change a Mixture's schedule explicitly (amends=, change_at=)"
        )


def check_change(saved: str | None, loader: Any, progress: dict) -> None:
    """A progress saved under the plan before the dataset's declared change (`saved`: its dataset fingerprint) must
    have committed nothing the change moves (the dataset's `check_change`, given the loader's order, through which
    committed positions name dataset indices; a StateError otherwise); one saved with the previous release's
    fingerprint resumes with a warning that says what was not checked."""
    before = _before_change(loader)
    if before is not None and saved == before:
        loader.dataset.check_change(progress, loader.resumable_sampler.order)
    elif saved is not None and saved == _of_earlier_release(loader) != dataset_fingerprint(loader):
        warnings.warn(
            f"the checkpoint holds the dataset fingerprint of an earlier release ({saved}), which covered the token "
            f"files' names and token counts but not their content or that of document offsets files: resumed as "
            f"that release would have, without checking that the files are unchanged since; the next checkpoint "
            f"saved records them (fingerprint {dataset_fingerprint(loader)})",
            CheckpointWarning,
            stacklevel=3,
        )


# What a failed save or load raises: DCP's CheckpointException is a BaseException, which `except Exception` misses.
_FAILURES = (Exception, CheckpointException)


class SaveError(OSError):
    """A checkpoint was not published. Every rank of the save raises it, promptly, naming each failing rank and its
    error; the checkpoints already published are untouched, so the previous one is still the newest.

    An `OSError` because the usual causes are the filesystem's (disk full, EIO, quota, permissions, a file-size
    limit): `errno`, `strerror` and `filename` are those of the first failing rank's OS error, found also where
    another exception wraps it (all None when no rank failed with one), `failures` maps each failing rank to its
    error, as text, which names the errno (ENOSPC), its message and the path."""

    def __init__(self, step: int, where: str, failures: dict[int, str], os_error: OSError | None):
        causes = "; ".join(f"rank {r}: {what}" for r, what in sorted(failures.items()))
        super().__init__(
            f"the checkpoint of step {step} was not published ({where}): {causes}. The newest published checkpoint "
            f"is unchanged; fix the cause (disk space, quota, permissions, a file-size limit) and save again"
        )
        if os_error is not None:
            self.errno, self.strerror, self.filename = os_error.errno, os_error.strerror, os_error.filename
        self.step, self.failures = step, failures

    def __str__(self) -> str:
        return self.args[0]  # not OSError's, which would show only errno, strerror and filename


@dataclass(frozen=True)
class _Failed:
    """Rank 0's verdict that a save failed, broadcast so that every rank raises the same SaveError."""

    where: str
    failures: dict[int, str]
    os_error: OSError | None


def _os_cause(err: BaseException | None) -> OSError | None:
    """The first OSError with an errno in `err`'s chain (itself, then its __cause__ or __context__): a failed write
    often surfaces wrapped in another exception."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _describe(err: BaseException) -> str:
    """An error as a failure's text: our CheckpointErrors say everything already, an OS error is named by its errno,
    message and path, anything else by its type."""
    if isinstance(err, CheckpointError):
        return str(err)
    cause = _os_cause(err)
    if cause is None:
        return f"{type(err).__name__}: {err}"
    text = f"{errorcode.get(cause.errno or 0, cause.errno)} ({cause.strerror})"  # errno is set (_os_cause)
    text += "" if cause.filename is None else f" at {cause.filename}"
    return text if cause is err else f"{text}, raised as {type(err).__name__}: {err}"


def _errors_of(err: BaseException, me: int) -> dict[int, BaseException]:
    """The errors behind `err`, by rank: DCP reports every rank's (a `CheckpointException`), anything else is ours."""
    return {r: e for r, (e, _) in err.failures.items()} if isinstance(err, CheckpointException) else {me: err}


def _failures_of(err: BaseException, me: int) -> dict[int, str]:
    return {r: _describe(e) for r, e in _errors_of(err, me).items()}


def _failed(err: BaseException, me: int, where: str) -> _Failed:
    errors = _errors_of(err, me)
    first = next((c for _, e in sorted(errors.items()) if (c := _os_cause(e)) is not None), None)
    # A plain OSError of it: broadcast to the other ranks, it must unpickle as it was.
    os_error = None if first is None else OSError(first.errno, first.strerror, first.filename)
    return _Failed(where, _failures_of(err, me), os_error)


def _raise(step: int, failed: _Failed, cause: BaseException | None) -> NoReturn:
    raise SaveError(step, failed.where, failed.failures, failed.os_error) from cause


def save_checkpoint(
    run_dir: str | Path,
    step: int | None = None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    manifest_extra: dict | None = None,
    keep_last: int | None = 3,
    keep_quarantined: int | None = 3,
    ledger: Ledger | None = None,
    group: ProcessGroup | None = None,
) -> Path:
    """Publish the checkpoint of completed optimizer step `step`; every rank calls it, after the step.

    `step` defaults to the loader's count (`loader.step`: the step resumed from plus the updates completed since;
    under DDP Join, that of the rank that went furthest). With a `ledger`, a `step` that is not the ledger's count
    is refused with a ValueError on every rank, before anything is written: the ledger labels each record with the
    step it feeds, so a checkpoint saved under another number would make the audit count the records of the steps
    between as replayed (skipped) or twice after a resume.

    Returns the published directory on every rank. A failure on any rank raises a `SaveError` (an `OSError`) on
    every rank, naming the failing ranks and causes, and leaves every published checkpoint untouched. The states
    of model, optimizer, scheduler and scaler must be plain data (tensors, numbers, strings, lists and dicts of
    them), as resume never unpickles anything else: otherwise a TypeError names the entry, before anything is
    written. `keep_last` and `keep_quarantined`: see `loader.checkpoint.publish.publish`."""
    # On every rank alike, before the first collective:
    if step is None and loader.step is None:
        raise ValueError(
            "save_checkpoint: no step= given, and the loader does not know its step (its progress was set by "
            "load_state_dict(), not resume()): pass step=, or set loader.step to the step that progress was saved at"
        )
    check_arguments(
        0 if step is None else step, keep_last, {} if manifest_extra is None else manifest_extra, keep_quarantined
    )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    extras = {
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
    }
    _check_plain({"model": model_sd, "optimizer": optim_sd, **extras})
    if ledger is not None:
        ledger.sync()
    progress = global_progress(loader, group)
    gathered = all_gather((_rng_state(), loader.step, None if ledger is None else ledger.step), group)
    step = _agreed_step(step, [counted for _, counted, _ in gathered], [label for _, _, label in gathered])
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "loader": {"progress": json.dumps(progress)},
        "rng": {"all": json.dumps([rng for rng, _, _ in gathered])},
        "extras": {"blob": _to_bytes(extras)},
    }
    extra = {
        "checkpoint_format": CHECKPOINT_FORMAT,
        "step": step,
        "epoch": progress.get("epoch"),
        "world_size": world_size(group),
        "progress_format": [FORMAT, VERSION],
        "fingerprint": _fingerprint_of(loader),
        "dataset": dataset_fingerprint(loader),
        **plan_record(loader),
        **(manifest_extra or {}),
    }

    if rank(group) != 0:
        return _write_as_other_rank(step, state, group)

    def prepare() -> None:  # the ledger's record of finished epochs can fail like the files: told to every rank
        if ledger is not None:
            ledger.record_finished(progress, loader)

    keep = {"keep_last": keep_last, "keep_quarantined": keep_quarantined}
    return _publish_as_rank0(run_dir, step, state, extra, keep, group, prepare)


def _agreed_step(step: int | None, counted: list[int | None], labelled: list[int | None]) -> int:
    """The checkpoint's step, from every rank's loader count and ledger label (the same lists on every rank, so
    all of them return or raise alike): `step`, or the largest count (a rank that joined early counted fewer),
    which must be the ledger's largest label."""
    if step is None:
        step = max(c for c in counted if c is not None)
    labels = [label for label in labelled if label is not None]
    if labels and max(labels) != step:
        ledger = max(labels)
        first, last = sorted((step, ledger))
        between = f"step {last}" if last == first + 1 else f"steps {first + 1} to {last}"
        raise ValueError(
            f"save_checkpoint(step={step}): the loader completed {ledger} optimizer updates, and the ledger labels "
            f"its records with them (step {ledger} last), so a checkpoint of step {step} would make the audit "
            f"count the records of {between} wrongly (as skipped, or twice) after a resume. Count steps as the "
            f"loader does: omit step= (it is loader.step), or also step the optimizer and count when a failed "
            f"micro-batch completes an update (loader.update_complete after the exception; see docs/checkpoints.md, "
            f"the loop)"
        )
    return step


# Two broadcasts from rank 0 keep all ranks in step, whatever fails where: (1) the directory to write into, or a
# failure before any writing; (2) the published path, or the failure. DCP itself reports a rank's write error to
# every rank, so no rank is left waiting for another.


def _publish_as_rank0(
    run_dir: str | Path,
    step: int,
    state: dict,
    extra: dict,
    keep: dict,
    group: ProcessGroup | None,
    prepare: Callable[[], None],
) -> Path:
    written = None

    def write(tmp: Path) -> None:
        nonlocal written
        broadcast(str(tmp), group)
        written = tmp
        _save(state, tmp, group)

    try:
        prepare()
        published = publish(run_dir, step, write, manifest_extra=extra, **keep)
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


def _write_as_other_rank(step: int, state: dict, group: ProcessGroup | None) -> Path:
    target, failure = broadcast(None, group), None
    if isinstance(target, str):
        try:
            _save(state, target, group)
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
    loader: Any,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    group: ProcessGroup | None = None,
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
    if parts["plan"] is not None:
        loader.dataset.use_plan(parts["plan"])  # the weights changed online up to the checkpoint
    loader.load_state_dict(parts["progress"])
    loader.step = step  # the loop counts on from it (`ResumableDataLoader.step`)
    weights = parts["weights"]
    set_state_dict(model, optimizer, model_state_dict=weights["model"], optim_state_dict=weights["optim"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None:
            target.load_state_dict(parts["extras"][name])
    rng, mine = parts["rng"], rank(group)
    if mine < len(rng):  # checked in _read_small_parts
        _set_rng_state(rng[mine])
    else:
        _seed_new_rank(mine, len(rng), step)
    return step


def _read_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    scheduler: Stateful | None,
    scaler: Stateful | None,
    group: ProcessGroup | None,
) -> tuple[int, dict]:
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
    step, plan = _agreed(path, group, lambda: _check_manifest(path, loader))
    parts = _agreed(path, group, lambda: _read_small_parts(path, loader, scheduler, scaler, group))
    parts["plan"] = plan
    parts["weights"] = _agreed(path, group, lambda: _read_weights(path, model, optimizer, group))
    return step, parts


def _agreed(path: Path, group: ProcessGroup | None, stage: Callable[[], Any]) -> Any:
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


def _check_manifest(path: Path, loader: Any) -> tuple[int, Any]:
    """The manifest against this run: format, order fingerprint, dataset. Returns the step, and the dataset's plan
    the checkpoint recorded (a Mixture changed online), None if none."""
    manifest = verify(path, check_checksums=False)
    extra = dict(manifest.extra)
    if extra.get("checkpoint_format") == 1:
        raise CheckpointError(
            f"checkpoint {path} is of checkpoint_format 1, which stores the RNG states as Python pickles: loading "
            f"them could run any code, and this loader (format {CHECKPOINT_FORMAT}) never unpickles a checkpoint. "
            f"Resume from a checkpoint this release wrote, or load it with the release that wrote it if you trust "
            f"its source"
        )
    if extra.get("checkpoint_format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: checkpoint_format is {extra.get('checkpoint_format')!r}, this loader reads "
            f"{CHECKPOINT_FORMAT}: load it with the release that wrote it"
        )
    current = _fingerprint_of(loader)
    try:
        if current is not None and extra.get("fingerprint") is not None:
            check_fingerprint(extra["fingerprint"], current, where=f"checkpoint {path}")
        plan = recorded_plan(extra, loader, f"checkpoint {path}")
        check_dataset(extra.get("dataset"), loader, f"checkpoint {path}", plan)
    except StateError as err:
        raise CheckpointError(str(err)) from None
    return manifest.step, plan


def _read_small_parts(
    path: Path, loader: Any, scheduler: Stateful | None, scaler: Stateful | None, group: ProcessGroup | None
) -> dict:
    """Loader progress, RNG states, scheduler and scaler: read (a collective), then validated."""
    state: dict[str, dict[str, Any]] = {"loader": {"progress": ""}, "rng": {"all": ""}, "extras": {"blob": b""}}
    _load(state, path, group)
    extras = load_plain(io.BytesIO(state["extras"]["blob"]), "the scheduler and scaler states")
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None and not extras[name]:
            raise CheckpointError(f"checkpoint {path} has no {name} state, but a {name} was passed to load it into")
    progress = _json(state["loader"]["progress"], "the loader progress")
    try:
        _check_progress(loader, progress)
        check_change(verify(path, check_checksums=False).extra.get("dataset"), loader, progress)
    except StateError as err:
        raise CheckpointError(f"checkpoint {path}: the loader progress does not fit this run: {err}") from None
    rng = _json(state["rng"]["all"], "the RNG states")
    _check_rng(rng, rank(group))
    return {"progress": progress, "extras": extras, "rng": rng}


def read_progress(path: str | Path) -> Any:
    """The loader progress a checkpoint holds, read without a loader or a process group (`python -m loader
    inspect`): JSON, through DCP's reader with nothing unpickled. Verify the checkpoint first."""
    state = {"loader": {"progress": ""}}
    _load(state, path, None)
    return _json(state["loader"]["progress"], f"checkpoint {path}: the loader progress")


def _check_progress(loader: Any, progress: dict) -> None:
    """The loader's own validation of a progress, without changing the loader: run on a fresh progress keeper of
    the same configuration (its load_state_dict validates in full, then replaces)."""
    sampler = loader.resumable_sampler
    if sampler is not None:
        fresh = ResumableSampler(sampler.order, sampler.layout, sampler.rank, sampler.schedule, sampler.amended)
        fresh.load_state_dict(progress)
    else:
        loader._stream.check(progress)


def _read_weights(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: ProcessGroup | None
) -> dict:
    """Model and optimizer states read into new tensors shaped like the live ones (a collective): a mismatch in
    shape or keys fails here, while the model and optimizer are untouched."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    weights = tree_map_only(torch.Tensor, torch.empty_like, {"model": model_sd, "optim": optim_sd})
    _load(weights, path, group)
    return weights


def resume(run_dir: str | Path, **objects: Any) -> int:
    """Load the newest checkpoint of `run_dir` that verifies, if any; returns its step (0 for a fresh run).

    Rank 0 chooses (torn or corrupted checkpoints are skipped with a warning) and every rank loads that one; a
    run directory rank 0 cannot read fails every rank."""
    group = objects.get("group")
    found = from_rank0(lambda: latest(run_dir), group)
    return 0 if found is None else load_checkpoint(found, **objects)
