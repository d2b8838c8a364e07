"""A save or load that fails on one rank fails on every rank, at once and with the cause: real gloo groups.

Each failure is a real one in the failing rank's process: a file-size limit (RLIMIT_FSIZE with SIGXFSZ ignored, so a
write raises EFBIG), a file where the ledger expects a directory, (as root) a full tmpfs, or objects that do not fit
the checkpoint. A rank that waited for another would wait for the group timeout (gloo's default, 30 min); run_group's
60 s bound fails the test long before.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import signal
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from loader import ResumableDataLoader
from loader.checkpoint.ledger import Ledger
from loader.checkpoint.publish import CheckpointError, latest
from loader.checkpoint.save import load_checkpoint, save_checkpoint
from tests.conftest import IndexDataset
from tests.distributed import run_group

pytestmark = pytest.mark.slow


def _objects(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    loader = ResumableDataLoader(IndexDataset(8), batch_size=2, rank=rank, world_size=world_size)
    return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=loader)


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG in this process (SIGXFSZ ignored, so it raises instead of dying)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _outcome(save) -> dict:
    """What one rank saw of a save: the error's type, errno, message and failures, or the published path."""
    try:
        return {"published": save().name}
    except OSError as e:
        return {
            "type": type(e).__name__,
            "errno": e.errno,
            "strerror": e.strerror,
            "filename": e.filename,
            "message": str(e),
            "failures": getattr(e, "failures", None),
        }


def _save_with_a_full_rank(rank: int, world_size: int, run_dir: str, failing: int) -> dict:
    warnings.simplefilter("ignore")
    objects = _objects(rank, world_size)
    save_checkpoint(run_dir, 1, **objects)
    with _file_size_limit(16) if rank == failing else contextlib.nullcontext():
        failed = _outcome(lambda: save_checkpoint(run_dir, 2, **objects))
    newest = latest(run_dir).name if rank == 0 else None
    retried = _outcome(lambda: save_checkpoint(run_dir, 2, **objects))  # the group is still in step
    return {"failed": failed, "newest_after_failure": newest, "retried": retried}


@pytest.mark.parametrize("world_size, failing", [(2, 1), (3, 0)])
def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path, world_size, failing):
    results = run_group(_save_with_a_full_rank, world_size, str(tmp_path), failing, timeout=60)
    for rank, result in enumerate(results):
        failed = result["failed"]
        assert failed["type"] == "SaveError", (rank, failed)
        assert failed["errno"] == errno.EFBIG and list(failed["failures"]) == [failing]
        assert failed["strerror"] == "File too large"
        assert failed["filename"].startswith(f"{tmp_path}/step-000000002.tmp-")
        message = failed["message"]
        assert "the checkpoint of step 2 was not published (writing " in message
        assert f"rank {failing}: EFBIG (File too large) at {tmp_path}/step-000000002.tmp-" in message
        assert result["retried"] == {"published": "step-000000002"}
    assert results[0]["newest_after_failure"] == "step-000000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001", "step-000000002"]


def _save_with_a_broken_ledger(rank: int, world_size: int, run_dir: str) -> dict:
    warnings.simplefilter("ignore")
    objects = _objects(rank, world_size)
    ledger = objects["loader"].ledger = Ledger.open(run_dir, 0, 8)
    for _ in objects["loader"]:  # the whole epoch: the save records its finished epoch in the ledger
        pass
    if rank == 0:
        Path(run_dir, "ledger", "dropped").write_text("a file where the ledger needs a directory")
    return _outcome(lambda: save_checkpoint(run_dir, **objects, ledger=ledger))  # step 2, the loader's


def test_a_ledger_that_cannot_be_written_fails_the_save_on_every_rank(tmp_path):
    results = run_group(_save_with_a_broken_ledger, 2, str(tmp_path), timeout=60)
    for failed in results:
        assert failed["type"] == "SaveError" and failed["errno"] == errno.EEXIST, failed
        cause = f"was not published (in {tmp_path}): rank 0: EEXIST (File exists) at {tmp_path}/ledger/dropped"
        assert cause in failed["message"]
    assert latest(tmp_path) is None and not list(tmp_path.glob("step-*"))


def _save_on_a_full_disk(rank: int, world_size: int, run_dir: str, filler: str) -> dict:
    warnings.simplefilter("ignore")
    objects = _objects(rank, world_size)
    save_checkpoint(run_dir, 1, **objects)
    if rank == 0:
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # until ENOSPC: the filesystem is full
                f.write(b"\0" * 4096)
    failed = _outcome(lambda: save_checkpoint(run_dir, 2, **objects))
    newest = latest(run_dir).name if rank == 0 else None
    if rank == 0:
        Path(filler).unlink()
    retried = _outcome(lambda: save_checkpoint(run_dir, 2, **objects))
    return {"failed": failed, "newest_after_failure": newest, "retried": retried}


@pytest.fixture
def small_filesystem(tmp_path):
    """A 512 KiB tmpfs: a real disk that fills up. Mounting needs root (CAP_SYS_ADMIN); skipped without it."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True, timeout=30)


def _assert_no_space(failed: dict, run_dir: Path) -> None:
    assert failed["type"] == "SaveError" and failed["errno"] == errno.ENOSPC, failed
    assert failed["strerror"] == "No space left on device" and failed["filename"].startswith(str(run_dir))
    for text in failed["failures"].values():  # every failing rank's cause, named as the OS named it
        assert text.startswith(f"ENOSPC (No space left on device) at {run_dir}") and text in failed["message"], failed


def test_a_full_disk_fails_the_save_on_every_rank_and_the_next_save_publishes(small_filesystem):
    run_dir = small_filesystem / "run"
    results = run_group(_save_on_a_full_disk, 2, str(run_dir), str(small_filesystem / "filler"), timeout=60)
    for result in results:
        _assert_no_space(result["failed"], run_dir)
        assert result["retried"] == {"published": "step-000000002"}
    assert results[0]["newest_after_failure"] == "step-000000001"


def _save_a_model_too_big(rank: int, world_size: int, run_dir: str) -> dict:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights, for a 512 KiB filesystem
    loader = ResumableDataLoader(IndexDataset(8), batch_size=2, rank=rank, world_size=world_size)
    return _outcome(
        lambda: save_checkpoint(run_dir, 1, model=model, optimizer=torch.optim.SGD(model.parameters()), loader=loader)
    )


def test_a_disk_that_fills_during_a_tensor_write_names_enospc(small_filesystem):
    """torch.save reports a write that fails mid-tensor as a RuntimeError ("unexpected pos"), with the ENOSPC only in
    its __context__, which DCP drops when it tells the other ranks: the SaveError still names it, on every rank."""
    run_dir = small_filesystem / "run"
    for failed in run_group(_save_a_model_too_big, 2, str(run_dir), timeout=60):
        _assert_no_space(failed, run_dir)
    assert latest(run_dir) is None and not list(run_dir.iterdir())


def _misfit(rank: int, world_size: int, kind: str) -> dict:
    """This rank's objects, made not to fit the checkpoint on rank 1: another seed, or a wider model."""
    objects = _objects(rank, world_size)
    if rank == 1 and kind == "seed":
        objects["loader"] = ResumableDataLoader(IndexDataset(8), batch_size=2, rank=rank, world_size=world_size, seed=7)
    if rank == 1 and kind == "shape":
        objects["model"] = torch.nn.Linear(4, 5)
        objects["optimizer"] = torch.optim.SGD(objects["model"].parameters(), lr=0.1)
    return objects


def _state(objects: dict) -> str:
    return str(
        (
            objects["model"].state_dict(),
            objects["optimizer"].state_dict(),
            objects["loader"].state_dict(),
            torch.get_rng_state(),
        )
    )


def _load_with_a_misfit_rank(rank: int, world_size: int, run_dir: str, kind: str) -> dict:
    warnings.simplefilter("ignore")
    objects = _objects(rank, world_size)
    next(iter(objects["loader"]))
    path = save_checkpoint(run_dir, 1, **objects)
    target = _misfit(rank, world_size, kind)
    before = _state(target)
    try:
        load_checkpoint(path, **target)
        outcome = None
    except CheckpointError as e:
        outcome = str(e)
    return {
        "outcome": outcome,
        "unchanged": _state(target) == before,
        "then": load_checkpoint(path, **_objects(rank, world_size)),
    }  # the group is still in step


@pytest.mark.parametrize(
    "kind, cause",
    [
        ("seed", "rank 1: checkpoint {path}.fingerprint.seed is 0 in the saved state but 7 in this loader"),
        ("shape", "rank 1: ValueError: Size mismatch between saved torch.Size([4, 4]) and current: torch.Size([5, 4])"),
    ],
)
def test_a_load_that_does_not_fit_one_rank_changes_nothing_on_any_rank(tmp_path, kind, cause):
    results = run_group(_load_with_a_misfit_rank, 2, str(tmp_path), kind, timeout=60)
    path = tmp_path / "step-000000001"
    for result in results:
        assert result["outcome"].startswith(f"checkpoint {path} was not loaded: {cause.format(path=path)}"), result
        assert result["outcome"].endswith(
            "Nothing was changed: model, optimizer, scheduler, scaler, RNG and loader are as they were"
        )
        assert result["unchanged"] and result["then"] == 1
