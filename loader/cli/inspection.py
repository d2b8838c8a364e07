"""`python -m loader inspect PATH`: what a checkpoint holds, or a run's newest checkpoint that verifies, without a
loader, a ledger or a process group: its step, epoch and world size, the progress (committed and remaining samples),
the mixture plan with its changes, and the files verified.

Why a command of its own: before a relaunch, or when a job's end is in doubt, the question is "where does this run
stand", and the answer sits in the manifest and the progress, both plain data. Nothing is unpickled (the progress
is read through DCP's reader with the allowlisting unpickler, `loader.checkpoint.plain`); whatever cannot be read
exits 2 with the file and the field named, never a traceback."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from loader.checkpoint.publish import MANIFEST_NAME, CheckpointError, CheckpointWarning, latest, verify
from loader.checkpoint.save import CHECKPOINT_FORMAT, read_progress
from loader.cli.names import read_plan
from loader.core.progress import total
from loader.core.state import Progress, StateError
from loader.streams.state import rank_streams

BAD_INPUT = 2  # as the audit's: the input named could not be read


def main(path: str, mixture: str | None = None) -> int:
    try:
        print("\n".join(describe(Path(path), mixture)))
    except (CheckpointError, StateError, ValueError, OSError, CheckpointException) as err:  # what reading a file
        # or a field raises (DCP's own is a BaseException)
        print(f"inspect: {err}", file=sys.stderr)
        return BAD_INPUT
    return 0


def describe(path: Path, mixture: str | None = None) -> list[str]:
    """The report's lines; a CheckpointError, StateError, ValueError or OSError names the file and field that
    could not be read."""
    checkpoint, lines = _checkpoint(path)
    manifest = verify(checkpoint)  # every byte against its sha256
    extra = dict(manifest.extra)
    if extra.get("checkpoint_format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{checkpoint / MANIFEST_NAME}: extra.checkpoint_format is "
            f"{extra.get('checkpoint_format')!r}, this release reads {CHECKPOINT_FORMAT}"
        )
    files = ", ".join(f"{name} ({entry.size:,} B)" for name, entry in sorted(manifest.files.items()))
    epoch = "" if extra.get("epoch") is None else f"epoch {extra['epoch']}, "  # a stream's: per rank, below
    lines += [
        f"  step {manifest.step}, {epoch}world size {extra.get('world_size')}, saved {manifest.created}",
        f"  files verified (size and sha256): {files}; {MANIFEST_NAME} by its own sha256",
    ]
    progress = read_progress(checkpoint)
    where = f"checkpoint {checkpoint}: the loader progress"
    kind = progress.get("kind") if isinstance(progress, dict) else None
    if kind == "streams":
        lines += _streams(progress, where)
        num_samples = None
    else:
        parsed = Progress.from_dict(progress, where)
        lines += _map_style(parsed)
        num_samples = parsed.num_samples
    plan_file = Path(mixture) if mixture else (path if path != checkpoint else path.parent) / "mixture.json"
    if mixture or plan_file.is_file():
        lines += _plan(plan_file, num_samples)
    return lines


def _checkpoint(path: Path) -> tuple[Path, list[str]]:
    """The checkpoint PATH names: PATH itself when it holds a manifest, else the newest of run directory PATH that
    verifies, with the newer ones skipped and why."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory; name a checkpoint (step-NNNNNNNNN/) or a run directory")
    if (path / MANIFEST_NAME).exists():
        return path, [f"checkpoint {path}"]
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always", CheckpointWarning)
        found = latest(path)
    reasons = [f"  {w.message}" for w in skipped if issubclass(w.category, CheckpointWarning)]
    if found is None:
        raise CheckpointError(
            "\n".join([f"{path}: no checkpoint (step-NNNNNNNNN/ with a {MANIFEST_NAME}) that verifies", *reasons])
        )
    return found, [f"run {path}: newest checkpoint that verifies {found.name}", *reasons]


def _map_style(progress: Progress) -> list[str]:
    n, fingerprint, epoch = progress.num_samples, progress.fingerprint, progress.cursor_epoch
    committed = n if progress.end_of_epoch is not None else total(progress.committed_in(epoch))
    skipped = total(progress.skipped[epoch]) if epoch in progress.skipped else 0
    lines = [
        f"progress: epoch {epoch} of {n:,} samples (seed {fingerprint.get('seed')}, shuffle "
        f"{fingerprint.get('shuffle')}): {committed:,} committed ({skipped:,} of them skipped on request), "
        f"{n - committed:,} remaining"
        + (", every rank at the epoch's end" if progress.end_of_epoch is not None else "")
    ]
    ahead = [f"epoch {e}: {total(spans):,}" for e, spans in sorted(progress.committed.items()) if e > epoch]
    if ahead:
        lines.append(f"  committed in later epochs (ranks ahead): {', '.join(ahead)}")
    for e, dropped in progress.finished:
        lines.append(f"  epoch {e} finished, {total(dropped):,} dropped by the tail rule")
    if progress.schedule is not None:
        lines.append(
            f"  batch-size ramp (first step, global batch): {[list(p) for p in progress.schedule]}, "
            f"step {progress.step}"
        )
    return lines


def _streams(state: dict, where: str) -> list[str]:
    try:
        ranks = rank_streams(state)
    except StateError as err:
        raise StateError(f"{where}: {err}") from None
    return [
        f"progress: a stream over {len(ranks)} ranks: "
        + "; ".join(
            f"rank {r.rank} epoch {r.epoch}, {r.batches:,} batches{', exhausted' if r.exhausted else ''}" for r in ranks
        )
    ]


def _plan(plan_file: Path, num_samples: int | None) -> list[str]:
    plan = read_plan(plan_file)
    if num_samples is not None and plan.num_samples != num_samples:
        raise ValueError(
            f"{plan_file}: num_samples is {plan.num_samples:,}, the checkpoint's progress has "
            f"{num_samples:,}: not this run's mixture plan"
        )
    sources = ", ".join(f"{name} ({length:,} samples)" for name, length in zip(plan.names, plan.lengths))
    return [f"mixture plan {plan_file}: {sources}", f"  {plan.describe()}"]
