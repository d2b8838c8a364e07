"""Atomic checkpoint publication, on real files and real processes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import pytest

from loader.checkpoint.publish import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointWarning,
    _sealed,
    latest,
    list_checkpoints,
    publish,
    verify,
)

FILES = {"model.pt": b"m" * 3000, "optim.pt": b"o" * 1234, "shards/rank0.distcp": b"0" * 77, "shards/rank1.distcp": b""}
EXTRA = {"epoch": 2, "world_size": 4, "batch_policy": {"global_batch": 64, "micro_batch": 4}, "dataset": "abc123"}


def write(files: dict[str, bytes]):
    def write_files(directory: Path) -> None:
        for rel, data in files.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_bytes(data)

    return write_files


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def publish_steps(run_dir: Path, *steps: int, keep_last: int | None = None) -> None:
    for step in steps:
        publish(run_dir, step, write(FILES), manifest_extra=EXTRA, keep_last=keep_last)


def test_round_trip_with_subdirectories(tmp_path):
    files = {**FILES, "big.bin": random.Random(0).randbytes(5 << 19)}  # 2.5 MiB: hashed in several chunks
    run_dir = tmp_path / "runs" / "a"  # created, parents included
    path = publish(run_dir, 7, write(files), manifest_extra=EXTRA)

    assert path == run_dir / "step-000000007"
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-000000007"]
    manifest = verify(path)
    assert (manifest.path, manifest.step, dict(manifest.extra)) == (path, 7, EXTRA)
    assert {rel: (e.size, e.sha256) for rel, e in manifest.files.items()} == {
        rel: (len(data), hashlib.sha256(data).hexdigest()) for rel, data in files.items()
    }
    raw = json.loads((path / MANIFEST_NAME).read_text())
    assert raw["format_version"] == FORMAT_VERSION and raw["created"] == manifest.created
    assert {rel: (path / rel).read_bytes() for rel in files} == files
    assert latest(run_dir) == path
    assert list_checkpoints(run_dir) == [path]


def test_writer_that_raises_leaves_no_trace(tmp_path):
    publish_steps(tmp_path, 1)
    before = snapshot(tmp_path)

    def half_then_fail(directory: Path) -> None:
        write({"model.pt": b"partial"})(directory)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish(tmp_path, 2, half_then_fail, manifest_extra=EXTRA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]
    assert snapshot(tmp_path) == before
    assert latest(tmp_path) == tmp_path / "step-000000001"


def _publish_then_sigkill(run_dir: str) -> None:
    def write_half_then_die(directory: Path) -> None:
        write(dict(list(FILES.items())[:2]))(directory)
        os.kill(os.getpid(), signal.SIGKILL)

    publish(run_dir, 2, write_half_then_die, manifest_extra=EXTRA)


def test_sigkill_during_write_falls_back_and_warns(tmp_path):
    publish_steps(tmp_path, 1)
    child = multiprocessing.get_context("fork").Process(target=_publish_then_sigkill, args=(str(tmp_path),))
    child.start()
    try:
        child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    (torn,) = tmp_path.glob("step-000000002.tmp-*")
    assert sorted(p.name for p in torn.iterdir()) == ["model.pt", "optim.pt"]

    with pytest.warns(CheckpointWarning, match=f"skipping {torn}: unfinished write of step 2"):
        assert latest(tmp_path) == tmp_path / "step-000000001"

    publish_steps(tmp_path, 3)  # the writer is dead: its torn directory is cleaned up
    assert not torn.exists()


def _damage(kind: str, ckpt: Path) -> str:
    """Damage a published checkpoint; returns the reason latest() must give."""
    model = ckpt / "model.pt"
    manifest = ckpt / MANIFEST_NAME
    if kind == "flip":
        data = bytearray(model.read_bytes())
        data[100] ^= 1
        model.write_bytes(bytes(data))
        return "checksum mismatch for 'model.pt'"
    if kind == "truncate":
        with open(ckpt / "shards" / "rank0.distcp", "r+b") as f:
            f.truncate(10)
        return "size of 'shards/rank0.distcp': expected 77 bytes, got 10"
    if kind == "delete":
        (ckpt / "optim.pt").unlink()
        return "missing file 'optim.pt'"
    if kind == "no_manifest":
        manifest.unlink()
        return f"no {MANIFEST_NAME}"
    if kind == "garbage_manifest":
        manifest.write_text('{"format_version": 1, "step"')
        return f"unreadable {MANIFEST_NAME}"
    if kind == "future_version":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 99}))
        return "unknown format version 99"
    if kind == "bad_entry":  # a writer's bug, sealed: the checksum holds, the content is still refused
        raw = json.loads(manifest.read_text())
        del raw["manifest_sha256"]
        raw["files"]["../escape"] = {"size": 1, "sha256": "0" * 64}
        manifest.write_bytes(_sealed(raw))
        return "bad entry for file '../escape'"
    if kind == "edit":
        raw = json.loads(manifest.read_text())
        raw["extra"]["epoch"] = 3
        manifest.write_text(json.dumps(raw, indent=1, sort_keys=True))
        return f"{MANIFEST_NAME} fails its own checksum"
    if kind.startswith("symlink:"):  # the same bytes, outside the checkpoint: sizes and checksums would match
        rel = kind.partition(":")[2]
        outside = ckpt.parent / "elsewhere" / rel
        outside.parent.mkdir(parents=True, exist_ok=True)
        if (ckpt / rel).exists():
            os.rename(ckpt / rel, outside)
        else:
            outside.write_bytes(b"not listed in the manifest")
        (ckpt / rel).symlink_to(outside)
        return f"{rel!r} is a symbolic link (to {str(outside)!r}), which this loader never follows"
    if kind == "fifo":  # not listed in the manifest, but read by whoever opens it: it would wait forever
        os.mkfifo(ckpt / ".metadata")
        return "'.metadata' is not a regular file or directory (a FIFO, socket or device)"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "flip",
        "truncate",
        "delete",
        "no_manifest",
        "garbage_manifest",
        "future_version",
        "bad_entry",
        "edit",
        "fifo",
        f"symlink:{MANIFEST_NAME}",
        "symlink:model.pt",
        "symlink:shards",
        "symlink:unlisted.txt",
    ],
)
def test_damaged_checkpoint_is_skipped_with_reason(tmp_path, kind):
    publish_steps(tmp_path, 1, 2)
    broken = tmp_path / "step-000000002"
    reason = _damage(kind, broken)

    with pytest.raises(CheckpointError) as info:
        verify(broken)
    assert str(broken) in str(info.value) and reason in str(info.value)
    with pytest.warns(CheckpointWarning) as caught:
        assert latest(tmp_path) == tmp_path / "step-000000001"
    assert [str(w.message) for w in caught] == [f"skipping {info.value}"]


def test_every_single_bit_flip_of_a_manifest_skips_its_checkpoint(tmp_path):
    publish_steps(tmp_path, 1, 2)
    manifest = tmp_path / "step-000000002" / MANIFEST_NAME
    intact = manifest.read_bytes()
    for bit in range(8 * len(intact)):
        flipped = bytearray(intact)
        flipped[bit // 8] ^= 1 << (bit % 8)
        manifest.write_bytes(flipped)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert latest(tmp_path) == tmp_path / "step-000000001", f"bit {bit}"
        assert [str(w.message).split(": ")[0] for w in caught] == [f"skipping checkpoint {manifest.parent}"], bit
    manifest.write_bytes(intact)
    assert latest(tmp_path) == manifest.parent


def test_a_version_1_manifest_without_its_own_checksum_still_loads(tmp_path):
    publish_steps(tmp_path, 1)
    manifest = tmp_path / "step-000000001" / MANIFEST_NAME
    raw = json.loads(manifest.read_text())
    del raw["manifest_sha256"]
    manifest.write_text(json.dumps({**raw, "format_version": 1}, indent=1, sort_keys=True))
    assert verify(manifest.parent).step == 1 and latest(tmp_path) == manifest.parent


def test_size_check_without_checksums(tmp_path):
    publish_steps(tmp_path, 1, 2)
    _damage("flip", tmp_path / "step-000000002")
    assert verify(tmp_path / "step-000000002", check_checksums=False).step == 2
    assert latest(tmp_path, check_checksums=False) == tmp_path / "step-000000002"
    _damage("truncate", tmp_path / "step-000000002")
    with pytest.warns(CheckpointWarning, match="expected 77 bytes, got 10"):
        assert latest(tmp_path, check_checksums=False) == tmp_path / "step-000000001"


def test_renamed_checkpoint_is_rejected(tmp_path):
    publish_steps(tmp_path, 1)
    (tmp_path / "step-000000001").rename(tmp_path / "step-000000005")
    with pytest.raises(CheckpointError, match="manifest.json says step 1 but the directory is named for step 5"):
        verify(tmp_path / "step-000000005")


def test_keep_last_prunes_only_old_checkpoints(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-000000001.bak").mkdir()
    (tmp_path / "step-000000002").write_text("a file, not a checkpoint")
    publish_steps(tmp_path, 1, 3, 4, 5, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000004", "step-000000005"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "step-000000001.bak").is_dir() and (tmp_path / "step-000000002").is_file()

    with pytest.warns(CheckpointWarning, match="the run went back from"):  # the later steps are set aside
        publish_steps(tmp_path, 0, keep_last=1)  # an older step written after newer ones is kept
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000000"]
    assert latest(tmp_path) == tmp_path / "step-000000000"


def test_failed_prune_warns_but_publishes(tmp_path):
    publish_steps(tmp_path, 1)
    manifest = tmp_path / "step-000000001" / MANIFEST_NAME
    manifest.unlink()
    manifest.mkdir()  # unlink() of it fails
    with pytest.warns(CheckpointWarning, match=f"could not prune old checkpoint {tmp_path / 'step-000000001'}"):
        path = publish(tmp_path, 2, write(FILES), manifest_extra=EXTRA, keep_last=1)
    assert latest(tmp_path) == path == tmp_path / "step-000000002"


def test_a_checkpoint_directory_that_is_a_symbolic_link_is_skipped_with_a_warning(tmp_path):
    """Not silently (a restart from an older step, or from scratch, without a word), and never pruned through."""
    run_dir = tmp_path / "run"
    publish_steps(run_dir, 1, 2)
    (run_dir / "step-000000002").rename(tmp_path / "elsewhere")
    (run_dir / "step-000000002").symlink_to(tmp_path / "elsewhere")
    with pytest.warns(CheckpointWarning, match="step-000000002: a symbolic link .* never follows"):
        assert latest(run_dir) == run_dir / "step-000000001"
    publish_steps(run_dir, 3, keep_last=1)
    assert verify(tmp_path / "elsewhere").step == 2


def test_keep_last_none_keeps_all(tmp_path):
    publish_steps(tmp_path, 1, 2, 3, 4, keep_last=None)
    assert len(list_checkpoints(tmp_path)) == 4


def _aside(run_dir: Path, step: int) -> list[Path]:
    return sorted(run_dir.glob(f"step-{step:09d}.quarantine-*"))


@pytest.mark.parametrize("broken", [True, False])
def test_a_step_published_again_sets_the_earlier_one_aside_and_the_newest_publication_wins(tmp_path, broken):
    """A run that resumed from step 1 (step 2 corrupt, or a deliberate step back) publishes step 2 again."""
    publish_steps(tmp_path, 1, 2)
    first = snapshot(tmp_path / "step-000000002")
    state = "its manifest and sizes are intact"
    if broken:
        _damage("truncate", tmp_path / "step-000000002")
        first = snapshot(tmp_path / "step-000000002")
        state = "broken: size of 'shards/rank0.distcp': expected 77 bytes, got 10"
    newer = {"model.pt": b"the new step 2 " * 20}

    with pytest.warns(CheckpointWarning) as caught:
        path = publish(tmp_path, 2, write(newer), manifest_extra=EXTRA, keep_last=None)
    (aside,) = _aside(tmp_path, 2)
    assert [str(w.message) for w in caught] == [
        f"step 2 is published again: the earlier {path} ({state}) was moved aside to {aside}, which is never "
        + (
            "loaded; inspect it, then delete it (a later save deletes it once it is not among the newest 3 broken "
            "directories moved aside: keep_quarantined=3)"
            if broken
            else "loaded, nor deleted; inspect it, then delete it"
        )
    ]
    assert snapshot(aside) == first  # kept for inspection, byte for byte
    assert latest(tmp_path) == path and set(verify(path).files) == {"model.pt"}  # the newest publication
    assert list_checkpoints(tmp_path) == [tmp_path / "step-000000001", path]

    _damage("flip", path)  # the new one broken too: the one set aside is still never a candidate
    with pytest.warns(CheckpointWarning, match="step-000000002: checksum mismatch"):
        assert latest(tmp_path) == tmp_path / "step-000000001"


def _told(caught) -> list[Path | None]:
    """Each directory moved aside, as its warning names it: where it is now, or None for one deleted."""
    where = [str(w.message).partition(" was moved aside ")[2] for w in caught]
    return [None if text.startswith("and deleted") else Path(text[3:].split(", which")[0]) for text in where]


def _republish(run_dir: Path, step: int, keep_last: int | None = None, **kwargs) -> list[Path | None]:
    """Publish `step` (again); returns the directories it moved aside, oldest first, as its warnings tell them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        publish(run_dir, step, write(FILES), manifest_extra=EXTRA, keep_last=keep_last, **kwargs)
    return _told(caught)


def test_every_republication_is_kept_aside(tmp_path):
    for _ in range(3):
        _republish(tmp_path, 4)
    assert len(_aside(tmp_path, 4)) == 2 and latest(tmp_path) == tmp_path / "step-000000004"


@pytest.mark.parametrize("keep, kept", [({}, 3), ({"keep_quarantined": 1}, 1), ({"keep_quarantined": None}, 6)])
def test_only_the_newest_directories_set_aside_are_kept(tmp_path, keep, kept):
    """3 rounds of a run that steps back from step 5 and saves steps 4 and 5 again (each sets both earlier ones
    aside): the newest few are kept, of any step, and the published steps are untouched. Each warning says where
    its directory is, or that it was deleted (all but the last round's, or those of a round before)."""
    moved = [_republish(tmp_path, 4 + i % 2, keep_last=2, **keep) for i in range(8)]
    assert [len(paths) for paths in moved] == [0, 0, 2, 0, 2, 0, 2, 0]
    told = [path for paths in moved for path in paths]
    assert set(tmp_path.glob("step-*.quarantine-*")) <= {path for path in told if path is not None}
    assert len(list(tmp_path.glob("step-*.quarantine-*"))) == kept
    assert list_checkpoints(tmp_path) == [tmp_path / "step-000000004", tmp_path / "step-000000005"]
    assert latest(tmp_path) == tmp_path / "step-000000005"


def test_a_rewind_with_keep_last_none_keeps_every_later_checkpoint_where_its_warning_says(tmp_path):
    """Steps 1 to 5 kept (keep_last=None), then the run went back to step 1 and publishes step 2: the earlier step 2
    and steps 3, 4 and 5 are moved aside, every one intact, and every one kept where its warning says (keep_quarantined
    pruned one of the four, whose warning said it was kept for inspection)."""
    publish_steps(tmp_path, 1, 2, 3, 4, 5, keep_last=None)
    told = _republish(tmp_path, 2)
    assert sorted(verify(path).step for path in told) == [2, 3, 4, 5]  # all there, checksums and all
    assert list_checkpoints(tmp_path) == [tmp_path / "step-000000001", tmp_path / "step-000000002"]


@pytest.mark.parametrize("keep_quarantined, deleted", [(1, 3), (3, 1), (None, 0)])
def test_a_rewind_with_keep_last_says_of_each_checkpoint_moved_aside_what_was_done(tmp_path, keep_quarantined, deleted):
    publish_steps(tmp_path, 1, 2, 3, 4, 5, keep_last=None)
    told = _republish(tmp_path, 2, keep_last=2, keep_quarantined=keep_quarantined)
    kept = [path for path in told if path is not None]
    assert (len(told), len(kept)) == (4, 4 - deleted)
    assert sorted(tmp_path.glob("step-*.quarantine-*")) == sorted(kept)


def test_a_step_published_meanwhile_by_another_writer_is_set_aside_too(tmp_path):
    def publish_step_1_meanwhile(directory: Path) -> None:
        publish_steps(tmp_path, 1)
        write({"other.pt": b"late"})(directory)

    with pytest.warns(CheckpointWarning, match="step 1 is published again"):
        publish(tmp_path, 1, publish_step_1_meanwhile, manifest_extra=EXTRA)
    assert set(verify(tmp_path / "step-000000001").files) == {"other.pt"}
    (aside,) = _aside(tmp_path, 1)
    assert set(verify(aside).files) == set(FILES)


def test_stale_tmp_cleanup_spares_live_writers(tmp_path):
    host = socket.gethostname().replace("-", "_")
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait(timeout=30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead_writer": f"step-000000001.tmp-{host}-{reaped.pid}-aa",
            "our_pid_not_in_flight": f"step-000000001.tmp-{host}-{os.getpid()}-bb",  # a predecessor with our pid
            "other_host": f"step-000000001.tmp-elsewhere-{alive.pid}-cc",
            "live_writer": f"step-000000001.tmp-{host}-{alive.pid}-dd",
            "newer_step": f"step-000000009.tmp-{host}-{reaped.pid}-ee",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
        publish_steps(tmp_path, 5)
        assert {key for key, name in names.items() if (tmp_path / name).exists()} == {"live_writer", "newer_step"}
    finally:
        alive.kill()
        alive.wait(timeout=30)


def test_async_save_in_flight_is_not_cleaned_up(tmp_path):
    entered, release = threading.Event(), threading.Event()
    errors = []

    def slow_writer(directory: Path) -> None:
        entered.set()
        assert release.wait(timeout=30)
        (directory / "model.pt").write_bytes(b"late")  # no mkdir: the directory must have survived

    def background() -> None:
        try:
            publish(tmp_path, 1, slow_writer, manifest_extra=EXTRA)
        except BaseException as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    thread = threading.Thread(target=background)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        publish_steps(tmp_path, 2)
        assert len(list(tmp_path.glob("step-000000001.tmp-*"))) == 1
    finally:
        release.set()
        thread.join(timeout=30)
    assert not thread.is_alive() and errors == []
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000001", "step-000000002"]
    assert verify(tmp_path / "step-000000001").step == 1


def test_missing_run_dir_is_a_fresh_run(tmp_path):
    assert latest(tmp_path / "nothing" / "here") is None
    assert list_checkpoints(tmp_path / "nothing") == []


def test_empty_run_dir_and_only_torn_checkpoints(tmp_path):
    assert latest(tmp_path) is None
    (tmp_path / "step-000000003.tmp-x-1-ab").mkdir()
    with pytest.warns(CheckpointWarning, match="step-000000003.tmp-x-1-ab: unfinished write"):
        assert latest(tmp_path) is None


def test_run_dir_that_is_a_file(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.write_text("oops")
    with pytest.raises(NotADirectoryError, match=f"run_dir {run_dir} is not a directory"):
        latest(run_dir)
    with pytest.raises(NotADirectoryError, match=f"run_dir {run_dir} exists but is not a directory"):
        publish(run_dir, 1, write(FILES), manifest_extra=EXTRA)
    assert run_dir.read_text() == "oops"


def _report_unprivileged(call, conn) -> None:
    if os.geteuid() == 0:  # root reads and writes everything: drop to nobody first
        os.setgid(65534)
        os.setuid(65534)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome = ("returned", call())
        except Exception as e:  # noqa: BLE001 - sent to the parent, which asserts on it
            outcome = (type(e).__name__, str(e))
    conn.send((outcome, [str(w.message) for w in caught]))


def _unprivileged(call) -> tuple:
    """call() in a forked process that runs as nobody when we are root, so permissions apply; returns (outcome,
    warnings), the outcome being ("returned", value) or (exception type name, message)."""
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_report_unprivileged, args=(call, child_end))
    child.start()
    try:
        assert parent_end.poll(timeout=30), "child did not report"
        return parent_end.recv()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


def test_unreadable_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0)
    try:
        outcome, _ = _unprivileged(lambda: latest(run_dir))
    finally:
        run_dir.chmod(0o755)
    assert outcome == (
        "PermissionError",
        f"run_dir {run_dir} cannot be listed (permission denied); fix its permissions or pass another directory",
    )


def test_a_failed_sync_after_the_rename_warns_and_reports_the_step_published():
    """The run directory can be entered and written but not opened (mode 0333), so fsync of it fails for real."""
    base = Path(tempfile.mkdtemp(prefix="loader-sync-"))  # not under pytest's 0700 root: nobody must reach it
    try:
        base.chmod(0o711)
        run_dir = base / "run"
        run_dir.mkdir()
        run_dir.chmod(0o333)
        outcome, caught = _unprivileged(lambda: publish(run_dir, 1, write(FILES), manifest_extra=EXTRA))
        final = run_dir / "step-000000001"
        assert outcome == ("returned", final)
        assert caught == [
            f"published {final}, but syncing {run_dir} failed ([Errno 13] Permission denied: '{run_dir}'): the "
            f"checkpoint is complete, but a machine crash could still lose its name; check the filesystem",
            f"published {final}, but could not tidy {run_dir}: run_dir {run_dir} cannot be listed (permission "
            f"denied); fix its permissions or pass another directory",
        ]
        run_dir.chmod(0o755)
        assert latest(run_dir) == final and verify(final).step == 1
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"step": -1}, ValueError, "step must be a non-negative int, got -1"),
        ({"step": True}, ValueError, "step must be a non-negative int, got True"),
        ({"step": 1.0}, ValueError, "step must be a non-negative int, got 1.0"),
        ({"keep_last": 0}, ValueError, "keep_last must be a positive int or None"),
        ({"keep_quarantined": 0}, ValueError, "keep_quarantined must be a positive int or None"),
        ({"manifest_extra": {"lr": object()}}, TypeError, "manifest_extra must be JSON-serialisable"),
        ({"manifest_extra": [1]}, TypeError, "manifest_extra must be a dict, got list"),
    ],
)
def test_argument_validation(tmp_path, kwargs, error, match):
    args = {"step": 1, "keep_last": 3, "manifest_extra": EXTRA, **kwargs}
    with pytest.raises(error, match=match):
        publish(tmp_path / "run", write_files=write(FILES), **args)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: (d / MANIFEST_NAME).write_text("{}"), "must not create manifest.json"),
        (lambda d: (d / "link").symlink_to("/etc/hostname"), "'link', which is not a regular file or directory"),
    ],
)
def test_bad_write_files_output_is_refused(tmp_path, make, match):
    with pytest.raises(ValueError, match=match):
        publish(tmp_path, 1, make, manifest_extra=EXTRA)
    assert list(tmp_path.iterdir()) == []
