"""Atomic, durable publication of checkpoint directories.

Why: a worker can be SIGKILLed halfway through writing a checkpoint, and a restart must never load a torn one. So a
checkpoint is written into a private ``step-NNNNNNNNN.tmp-<host>-<pid>-<random>`` directory, every file and directory
is fsynced, ``manifest.json`` (sizes and sha256 of every file, and its own sha256) is written last, and only then is
the directory renamed to ``step-NNNNNNNNN``. A rename within one filesystem is atomic, so a published name always
holds a complete checkpoint; anything else (a leftover ``.tmp-*``, a directory without manifest, a file or manifest
whose size or checksum no longer matches) is skipped by :func:`latest` with a :class:`CheckpointWarning`.

A step published again (the run resumed from an older checkpoint, because :func:`latest` skipped this one as corrupt
or on purpose) moves the earlier ``step-NNNNNNNNN`` aside as ``step-NNNNNNNNN.quarantine-<UTC time>``, with a
warning: kept for inspection, never loaded, so the name always holds the newest publication of its step. Checkpoints
of later steps that were published before this save began are moved aside the same way once it is published: they
belong to the run's abandoned past (skipped as unreadable, perhaps only for a moment, or left on purpose), and a
restart must resume the run's present, not jump back into them. The newest ``keep_quarantined`` (3 by default) of
those are kept, the older ones deleted once the new one is in place; with ``keep_last=None`` (keep every checkpoint)
those that still verify are all kept, only broken ones count. Each warning says what was done: where the directory
is now, or that it was deleted.

A checkpoint's files must be its own: :func:`verify` refuses a directory holding a symbolic link (or a FIFO, socket or
device), which would make it read a file outside the checkpoint.

Assumption: one publisher per run directory. In a torchrun job only rank 0 calls :func:`publish` (after the other
ranks have written their shards into the directory it hands out, if they write any). Pruning and stale-tmp cleanup
assume nobody else is publishing into ``run_dir``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

FORMAT_VERSION = 2  # 2: the manifest carries its own sha256; 1 (read, never written) did not
MANIFEST_NAME = "manifest.json"
_SELF_DIGEST = "manifest_sha256"
_CHUNK = 1 << 20
_NAME = re.compile(r"step-(\d{9,})(?:\.tmp-(.+))?")
_QUARANTINED = re.compile(r"step-\d{9,}\.quarantine-(.+)")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_IN_FLIGHT: set[Path] = set()  # tmp directories this process is writing right now (async saves in threads)


class CheckpointError(ValueError):
    """A checkpoint directory is torn, corrupted or not a checkpoint at all. From :func:`verify`, ``problem`` says
    what is wrong without the advice around it."""

    problem = ""


class CheckpointWarning(UserWarning):
    """:func:`latest` skipped a checkpoint directory; the message names it and says why."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The verified content of a checkpoint's ``manifest.json``; ``extra`` is the caller's ``manifest_extra``."""

    path: Path
    step: int
    created: str
    files: Mapping[str, FileEntry]
    extra: Mapping[str, Any]


def publish(
    run_dir: str | os.PathLike,
    step: int,
    write_files: Callable[[Path], None],
    *,
    manifest_extra: dict[str, Any],
    keep_last: int | None = 3,
    keep_quarantined: int | None = 3,
) -> Path:
    """Write a checkpoint with ``write_files(tmp_dir)`` and publish it atomically as ``run_dir/step-NNNNNNNNN``.

    On any exception only this call's temporary directory is removed; published checkpoints are never deleted (an
    earlier publication of ``step`` is moved aside, see the module's docstring). After
    success, published checkpoints beyond the newest ``keep_last`` (``None``: keep all) are pruned, never the one just
    written, and temporary directories of lower steps left by crashed writers are removed (not those of a writer that
    is still alive on this host, e.g. an async save in another thread). Of the directories moved aside, the newest
    ``keep_quarantined`` (``None``: all) are kept, so that republishing does not fill the disk; with ``keep_last=None``
    every one that still verifies is kept besides.
    """
    check_arguments(step, keep_last, manifest_extra, keep_quarantined)
    run_dir = Path(run_dir)
    _make_run_dir(run_dir)
    final = run_dir / f"step-{step:09d}"
    superseded = _later_than(run_dir, step)  # before this save began: not an async save of a later step that
    # finishes first
    tmp = run_dir / f"{final.name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    _IN_FLIGHT.add(tmp)
    moved: list[_Aside] = []  # told once their fate is known, after the tidying
    try:
        write_files(tmp)
        files = _seal(tmp)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created": datetime.now(timezone.utc).isoformat(),
            "files": files,
            "extra": manifest_extra,
        }
        with open(tmp / MANIFEST_NAME, "xb") as f:
            f.write(_sealed(manifest))
            f.flush()
            os.fsync(f.fileno())
        fsync(tmp)
        moved += _set_aside(final)
        try:
            os.rename(tmp, final)
        except OSError as e:  # a complete checkpoint appeared under that name meanwhile: never replace it
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _already_published(final) from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _tell(moved, keep_last, keep_quarantined)
        raise
    finally:
        _IN_FLIGHT.discard(tmp)
    _after_publication(run_dir, final, step, keep_last, keep_quarantined, superseded, moved)
    return final


def _after_publication(
    run_dir: Path,
    final: Path,
    step: int,
    keep_last: int | None,
    keep_quarantined: int | None,
    superseded: list[Path],
    moved: list[_Aside],
) -> None:
    """Make the rename durable, set aside the checkpoints it supersedes, tidy up, and tell what became of each
    directory moved aside. The step is published once renamed, so a failure here warns: raising would tell the
    caller that the save failed while its checkpoint is complete and loadable."""
    try:
        for path in superseded:
            moved += _set_aside(path, replaced_by=final)
    except OSError as e:
        warnings.warn(
            f"published {final}, but could not move a checkpoint of a later step aside ({e}): a restart would "
            f"resume from that one, not from {final}; move or delete it",
            CheckpointWarning,
            stacklevel=3,
        )
    try:
        fsync(run_dir)
    except OSError as e:
        warnings.warn(
            f"published {final}, but syncing {run_dir} failed ({e}): the checkpoint is complete, but a machine crash "
            f"could still lose its name; check the filesystem",
            CheckpointWarning,
            stacklevel=3,
        )
    try:
        _remove_stale_tmp(run_dir, step)
        if keep_last is not None:
            _prune(run_dir, keep=keep_last, just_written=final)
        if keep_quarantined is not None:
            _prune_quarantined(run_dir, keep=keep_quarantined, spare_intact=keep_last is None)
    except OSError as e:
        warnings.warn(f"published {final}, but could not tidy {run_dir}: {e}", CheckpointWarning, stacklevel=3)
    _tell(moved, keep_last, keep_quarantined)


def check_arguments(
    step: int, keep_last: int | None, manifest_extra: dict[str, Any], keep_quarantined: int | None = 3
) -> None:
    """Refuse bad arguments of :func:`publish` before anything is written (a ValueError or TypeError). A job's ranks
    call it each before their first collective, so all of them refuse alike and none waits for another."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    for name, keep in (("keep_last", keep_last), ("keep_quarantined", keep_quarantined)):
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"{name} must be a positive int or None (keep all), got {keep!r}")
    if not isinstance(manifest_extra, dict):
        raise TypeError(f"manifest_extra must be a dict, got {type(manifest_extra).__name__}")
    try:
        json.dumps(manifest_extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"manifest_extra must be JSON-serialisable (str keys, plain values): {e}") from None


def verify(path: str | os.PathLike, *, check_checksums: bool = True) -> Manifest:
    """Check that ``path`` is a complete checkpoint: the manifest parses, and every file it lists exists with the
    recorded size (always) and sha256 (when ``check_checksums``; reads every byte). Files the manifest does not list
    are ignored, but no entry of the directory may be a symbolic link or other special file (see the module's
    docstring). Raises :class:`CheckpointError` naming the directory and the problem."""
    path = Path(path)
    _check_entries(path)
    try:
        data = (path / MANIFEST_NAME).read_bytes()
        raw = json.loads(data)
    except FileNotFoundError:
        raise _broken(path, f"no {MANIFEST_NAME} (a torn write, or not a checkpoint directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _broken(path, f"unreadable {MANIFEST_NAME}: {e}") from None
    _check_seal(path, raw, data)
    manifest = _parse_manifest(path, raw)
    for rel, entry in manifest.files.items():
        file = path / rel
        try:
            size = file.stat().st_size
            if size != entry.size:
                raise _broken(path, f"size of {rel!r}: expected {entry.size} bytes, got {size}")
            if check_checksums and _sha256(file) != entry.sha256:
                raise _broken(path, f"checksum mismatch for {rel!r}")
        except FileNotFoundError:
            raise _broken(path, f"missing file {rel!r}") from None
        except OSError as e:
            raise _broken(path, f"cannot read file {rel!r}: {e}") from None
    return manifest


def _check_entries(path: Path) -> None:
    """Refuse a checkpoint holding anything but regular files and directories. Why: a symbolic link would make the
    checkpoint's bytes those of a file outside it (checksums included, as the link is followed), and reading a FIFO
    waits forever. A missing directory is left to the manifest's check, which says so."""
    try:
        for entry in _walk(path):
            if not (entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False)):
                what = (
                    f"a symbolic link (to {os.readlink(entry.path)!r}), which this loader never follows"
                    if entry.is_symlink()
                    else "not a regular file or directory (a FIFO, socket or device)"
                )
                rel = Path(entry.path).relative_to(path).as_posix()
                raise _broken(path, f"{rel!r} is {what}: a checkpoint's files must be its own")
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        raise _broken(path, f"cannot list the directory: {e}") from None


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Published checkpoint directories (by name, not verified), oldest step first. Missing ``run_dir``: []."""
    return [p for step, p, tmp in _scan(Path(run_dir)) if not tmp]


def _later_than(run_dir: Path, step: int) -> list[Path]:
    """Published checkpoints of later steps than `step`; none when the directory cannot be listed (publishing
    needs only to write into it: the tidying after it warns)."""
    try:
        return [path for later, path, tmp in _scan(run_dir) if later > step and not tmp]
    except OSError:
        return []


def latest(run_dir: str | os.PathLike, *, check_checksums: bool = True) -> Path | None:
    """The newest checkpoint in ``run_dir`` that verifies, or None (also for a missing ``run_dir``: a fresh run).

    Newer directories that are torn (``.tmp-*``, no manifest) or corrupted, and symbolic links, are skipped with a
    :class:`CheckpointWarning` naming them and the reason; older ones are not inspected."""
    for step, path, tmp in reversed(_scan(Path(run_dir), links=True)):
        if path.is_symlink():
            warnings.warn(
                f"skipping {path}: a symbolic link (to {os.readlink(path)!r}), which this loader never follows: a "
                f"checkpoint's files must be its own; move the checkpoint directory itself into {run_dir}",
                CheckpointWarning,
                stacklevel=2,
            )
            continue
        if tmp:
            warnings.warn(
                f"skipping {path}: unfinished write of step {step} (crashed writer, or one still running)",
                CheckpointWarning,
                stacklevel=2,
            )
            continue
        try:
            verify(path, check_checksums=check_checksums)
        except CheckpointError as e:
            warnings.warn(f"skipping {e}", CheckpointWarning, stacklevel=2)
            continue
        return path
    return None


@dataclass(frozen=True)
class _Aside:
    """A directory moved aside: what it was, whether it verified, and where it went."""

    what: str
    intact: bool
    problem: str
    path: Path


def _set_aside(final: Path, replaced_by: Path | None = None) -> list[_Aside]:
    """Move an earlier publication of this step, or a checkpoint of a later step that `replaced_by` supersedes, out
    of the way, never loaded again; returns it (nothing when there is none), to be told of once its fate is known.

    Why: a run that is publishing step S again has resumed from an older checkpoint, because `latest` skipped this
    one as corrupt or the run went back on purpose; refusing would fail every save of S, on every restart."""
    if not final.exists():
        return []
    try:
        verify(final, check_checksums=False)
        intact, problem = True, ""
    except CheckpointError as e:
        intact, problem = False, e.problem
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = final.with_name(f"{final.name}.quarantine-{stamp}")
    os.rename(final, aside)
    what = (
        f"step {int(final.name[5:])} is published again: the earlier {final}"
        if replaced_by is None
        else f"the run went back from {final} to an earlier step, now published as {replaced_by.name}: {final.name}"
    )
    return [_Aside(what, intact, problem, aside)]


def _tell(moved: list[_Aside], keep_last: int | None, keep_quarantined: int | None) -> None:
    """One warning per directory moved aside, saying what was done with it: kept where it now is (and until when),
    or deleted by `keep_quarantined`."""
    for entry in moved:
        state = "its manifest and sizes are intact" if entry.intact else f"broken: {entry.problem}"
        k = keep_quarantined
        if not entry.path.exists():
            keep_all = ", or keep_last=None to keep every intact checkpoint" if entry.intact else ""
            done = (
                f"was moved aside and deleted: keep_quarantined={k} keeps only the newest {k} directories moved "
                f"aside (pass keep_quarantined=None to keep them all{keep_all})"
            )
        elif k is None or entry.intact and keep_last is None:
            done = f"was moved aside to {entry.path}, which is never loaded, nor deleted; inspect it, then delete it"
        else:
            counted = " broken" if keep_last is None else ""
            done = (
                f"was moved aside to {entry.path}, which is never loaded; inspect it, then delete it (a later "
                f"save deletes it once it is not among the newest {k}{counted} directories moved aside: "
                f"keep_quarantined={k})"
            )
        warnings.warn(f"{entry.what} ({state}) {done}", CheckpointWarning, stacklevel=4)


def _already_published(final: Path) -> FileExistsError:
    return FileExistsError(
        f"checkpoint {final} was published by another writer while this one wrote it: two jobs are publishing into "
        f"{final.parent}; give each job a run directory of its own"
    )


def _broken(path: Path, problem: str) -> CheckpointError:
    error = CheckpointError(
        f"checkpoint {path}: {problem}. It cannot be loaded; latest() skips it for an older checkpoint. "
        f"Delete the directory, or restore it from a copy"
    )
    error.problem = problem
    return error


def _canonical(value: dict[str, Any]) -> bytes:
    return json.dumps(value, indent=1, sort_keys=True).encode("ascii")


def _sealed(body: dict[str, Any]) -> bytes:
    """The manifest's bytes: canonical JSON holding the sha256 of the canonical JSON of everything else. Why: the
    manifest vouches for every other file, so it must vouch for itself, or a flipped bit that still parses (another
    seed, shuffle mode or step) would be believed."""
    return _canonical({**body, _SELF_DIGEST: hashlib.sha256(_canonical(body)).hexdigest()})


def _check_seal(path: Path, raw: Any, data: bytes) -> None:
    """Any changed byte of a sealed manifest fails here: its bytes must be exactly the seal of what they say. Only a
    version-1 manifest, written before the seal, has none; one bit cannot both remove the digest and make it so."""
    if not isinstance(raw, dict):
        raise _broken(path, f"{MANIFEST_NAME} is not a JSON object")
    if raw.get("format_version") == 1 and _SELF_DIGEST not in raw:
        return
    body = {k: v for k, v in raw.items() if k != _SELF_DIGEST}
    if _sealed(body) == data:
        return
    version = raw.get("format_version")
    if version in (1, FORMAT_VERSION):
        raise _broken(path, f"{MANIFEST_NAME} fails its own checksum (a flipped bit, an edit or a torn write)")
    raise _broken(
        path,
        f"unknown format version {version!r} in {MANIFEST_NAME}, whose checksum does not match this loader's "
        f"(it reads versions 1 and {FORMAT_VERSION}): corrupted, or written by a newer loader — then upgrade",
    )


def _parse_manifest(path: Path, raw: dict[str, Any]) -> Manifest:
    version = raw.get("format_version")
    if version not in (1, FORMAT_VERSION):
        raise _broken(
            path,
            f"unknown format version {version!r} in {MANIFEST_NAME} (this loader reads versions 1 and "
            f"{FORMAT_VERSION}; a newer loader may have written it — upgrade, or use a checkpoint this version "
            f"wrote)",
        )
    step, created, files, extra = (raw.get(k) for k in ("step", "created", "files", "extra"))
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _broken(path, f"malformed {MANIFEST_NAME}: 'step' must be a non-negative int, got {step!r}")
    name = _NAME.fullmatch(path.name)
    if name and not name.group(2) and int(name.group(1)) != step:
        named = int(name.group(1))
        raise _broken(path, f"{MANIFEST_NAME} says step {step} but the directory is named for step {named}")
    if not isinstance(created, str) or not isinstance(extra, dict) or not isinstance(files, dict):
        raise _broken(path, f"malformed {MANIFEST_NAME}: 'created' (str), 'files' and 'extra' (objects) are required")
    entries = {}
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        parts = Path(rel).parts
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(digest, str)
            or not _HEX64.fullmatch(digest)
            or not parts
            or Path(rel).is_absolute()
            or ".." in parts
        ):
            raise _broken(path, f"malformed {MANIFEST_NAME}: bad entry for file {rel!r}: {entry!r}")
        entries[rel] = FileEntry(size, digest)
    return Manifest(path, step, created, MappingProxyType(entries), MappingProxyType(extra))


def _seal(root: Path) -> dict[str, dict[str, Any]]:
    """fsync every file and directory under ``root`` (children first) and return the manifest's ``files`` table."""
    files = {}
    for entry in _walk(root):
        rel = Path(entry.path).relative_to(root).as_posix()
        if entry.is_dir(follow_symlinks=False):
            fsync(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            if rel == MANIFEST_NAME:
                raise ValueError(f"write_files must not create {MANIFEST_NAME}: publish() writes it")
            files[rel] = {"size": entry.stat(follow_symlinks=False).st_size, "sha256": _sha256(Path(entry.path))}
            fsync(Path(entry.path))
        else:
            raise ValueError(
                f"write_files created {rel!r}, which is not a regular file or directory (a symlink?); "
                f"a checkpoint must be self-contained, so copy the data in instead"
            )
    fsync(root)
    return files


def _walk(directory: Path) -> Iterator[os.DirEntry]:
    """Every entry under ``directory``, by name, each directory after its contents (fsynced after them); symbolic
    links are listed, never followed."""
    with os.scandir(directory) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        yield entry


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to stable storage (Linux accepts a read-only fd for both)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_run_dir(run_dir: Path) -> None:
    if run_dir.is_dir():
        return
    if run_dir.exists():
        raise NotADirectoryError(f"run_dir {run_dir} exists but is not a directory; pass a directory for checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    fsync(run_dir.parent)


def _scan(run_dir: Path, links: bool = False) -> list[tuple[int, Path, bool]]:
    """(step, path, is_tmp) for every checkpoint-named directory, by step; at equal steps tmp ones come first.
    `links`: symbolic links so named too (only `latest` lists them, to say that it skips them)."""
    try:
        with os.scandir(run_dir) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False) or links and e.is_symlink()) for e in it]
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise NotADirectoryError(
            f"run_dir {run_dir} is not a directory (or one of its parents is a file); pass the checkpoint directory"
        ) from None
    except PermissionError:
        raise PermissionError(
            f"run_dir {run_dir} cannot be listed (permission denied); fix its permissions or pass another directory"
        ) from None
    found = []
    for name, is_dir in entries:
        match = _NAME.fullmatch(name)
        if match and is_dir:
            found.append((int(match.group(1)), run_dir / name, match.group(2) is not None))
    found.sort(key=lambda entry: (entry[0], not entry[2]))
    return found


def _host() -> str:
    return socket.gethostname().replace("-", "_")  # no "-": it separates host, pid and nonce in tmp names


def _writer_alive(tmp: Path) -> bool:
    """Whether a tmp directory may still be written: by this process (async save), or by another live process on
    this host. Our own pid on a directory we are not writing is a dead predecessor's (containers reuse pids);
    writers on other hosts cannot be checked, and by the one-publisher assumption there are none."""
    if tmp in _IN_FLIGHT:
        return True
    host, _, rest = tmp.name.partition(".tmp-")[2].partition("-")
    pid = rest.partition("-")[0]
    if host != _host() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


def _remove_stale_tmp(run_dir: Path, step: int) -> None:
    for tmp_step, path, tmp in _scan(run_dir):
        if tmp and tmp_step < step and not _writer_alive(path):
            shutil.rmtree(path, ignore_errors=True)


def _prune_quarantined(run_dir: Path, *, keep: int, spare_intact: bool = False) -> None:
    """Delete all but the newest ``keep`` directories moved aside (by the UTC time in their names, whatever the step);
    called after a publication, so the one just moved aside is among the kept. `spare_intact` (``keep_last=None``):
    checkpoints that still verify are kept whatever their number, and do not count among the ``keep``."""
    with os.scandir(run_dir) as it:
        aside = sorted(
            (match.group(1), entry.name)
            for entry in it
            if (match := _QUARANTINED.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False)
        )
    if spare_intact:
        aside = [(stamp, name) for stamp, name in aside if not _verifies(run_dir / name)]
    for _, name in aside[: max(len(aside) - keep, 0)]:
        shutil.rmtree(run_dir / name)


def _verifies(path: Path) -> bool:
    """Whether a directory is a complete checkpoint by its manifest and sizes (no checksums: every byte read)."""
    try:
        verify(path, check_checksums=False)
    except CheckpointError:
        return False
    return True


def _prune(run_dir: Path, *, keep: int, just_written: Path) -> None:
    """Delete all but the newest ``keep`` published checkpoints; a directory that cannot be deleted is warned about
    and kept."""
    published = list_checkpoints(run_dir)
    for path in published[: max(len(published) - keep, 0)]:
        if path == just_written:
            continue
        try:
            # Manifest first: a crash mid-delete then leaves a directory that latest() rejects as torn, not one that
            # still claims to be complete.
            (path / MANIFEST_NAME).unlink(missing_ok=True)
            fsync(path)
            shutil.rmtree(path)
        except OSError as e:
            warnings.warn(f"could not prune old checkpoint {path}: {e}", CheckpointWarning, stacklevel=4)
