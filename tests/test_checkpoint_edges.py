"""Edges of checkpointing found by an adversarial review: a restart from an older checkpoint than the newest save,
and what it must leave coherent (the ledger's record of what each epoch dropped, the checkpoints kept)."""

import itertools

import pytest
import torch

from loader import ResumableDataLoader
from loader.checkpoint import Ledger, resume, save_checkpoint
from loader.checkpoint.audit import audit
from loader.checkpoint.publish import CheckpointWarning, latest
from tests.conftest import IndexDataset
from tests.distributed import run_group


def damage(checkpoint) -> None:
    """One flipped bit in a checkpoint's data: `resume` skips it for the one before."""
    data = next(checkpoint.glob("*.distcp"))
    content = bytearray(data.read_bytes())
    content[10] ^= 1
    data.write_bytes(content)


def launch(run_dir, n: int, batch_size: int, every: int = 1, steps: int | None = None) -> int:
    """A launch that resumes, trains the rest of epoch 0 (or `steps` steps) with drop_last and a checkpoint every
    `every` steps and after the last, each batch in the identity ledger. Returns the step it resumed from."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = ResumableDataLoader(IndexDataset(n), batch_size=batch_size, shuffle=True, seed=0, drop_last=True)
    step = resumed = resume(run_dir, model=model, optimizer=optimizer, loader=dl)
    dl.ledger = Ledger.open(run_dir, step, n)
    for batch in itertools.islice(dl, steps):
        model(batch.float()[:, None]).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % every == 0 or dl.exhausted or step - resumed == steps:
            save_checkpoint(run_dir, step, model=model, optimizer=optimizer, loader=dl, ledger=dl.ledger)
    dl.ledger.close()
    return resumed


def test_the_audit_judges_an_epoch_by_the_drops_of_the_launch_that_counts(tmp_path):
    """Launch 1 ends epoch 0 in 4 steps of 3, dropping nothing, and records so. Its last checkpoint is damaged;
    launch 2 resumes from step 2 at batches of 4: the 6 positions left are one step and 2 dropped by policy. The
    ledger kept launch 1's record of the epoch's drops, so the audit called the 2 skipped: a false failure."""
    assert launch(tmp_path, 12, 3, every=2) == 0
    damage(tmp_path / "step-000000004")
    with pytest.warns(CheckpointWarning) as warned:
        assert launch(tmp_path, 12, 4) == 2
    assert "step-000000004: checksum mismatch" in str(warned[0].message)
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean
    assert (epoch.seen_once, epoch.dropped, len(epoch.skipped), len(epoch.duplicated)) == (10, 2, 0, 0)


def test_an_epoch_finished_by_a_lost_checkpoint_is_unfinished_again_once_the_run_saves_before_its_end(tmp_path):
    """Launch 1 ends epoch 0 at step 4 and records it finished; step 4 is damaged, so launch 2 resumes from step 2,
    saves step 3 and stops. The audit took the epoch for finished and its last step's samples for skipped (a
    failed audit); it is unfinished, nothing skipped or duplicated so far."""
    assert launch(tmp_path, 12, 3, every=2) == 0
    damage(tmp_path / "step-000000004")
    with pytest.warns(CheckpointWarning):
        assert launch(tmp_path, 12, 3, steps=1) == 2
    (epoch,) = audit(tmp_path)
    assert not epoch.finished and epoch.clean and (epoch.seen_once, epoch.not_yet_seen) == (9, 3)


def test_a_restart_resumes_the_runs_present_not_a_later_checkpoint_it_had_gone_back_from(tmp_path):
    """Launch 1 saves steps 2 and 4; step 4 cannot be read for a moment (its manifest away: a network filesystem's
    hiccup), so launch 2 resumes from step 2 and saves step 3. Launch 3, with step 4 readable again, resumed from
    it: launch 2's step 3 lost, and the audit, which counts launch 1 up to step 2 and launch 2's step 3, found step
    4's samples skipped. Step 4 is now set aside when step 3 is published, with a warning."""
    assert launch(tmp_path, 12, 3, every=2) == 0
    (tmp_path / "step-000000004" / "manifest.json").rename(tmp_path / "away.json")
    with pytest.warns(CheckpointWarning) as warned:
        assert launch(tmp_path, 12, 3, steps=1) == 2
    (aside,) = tmp_path.glob("step-000000004*")  # where step 4 is now
    (tmp_path / "away.json").rename(aside / "manifest.json")
    assert launch(tmp_path, 12, 3) == 3
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean and epoch.seen_once == 12
    assert aside.name.startswith("step-000000004.quarantine-") and "the run went back from" in str(warned[-1].message)


class FailsOnce(IndexDataset):
    """Loading `index` raises an OSError the first time (a storage hiccup): its batch is consumed, never served."""

    def __init__(self, n: int, index: int):
        super().__init__(n)
        self.index, self.raised = index, False

    def __getitem__(self, index):
        if index == self.index and not self.raised:
            self.raised = True
            raise OSError(5, "Input/output error", f"sample {index}")
        return int(index)


def loop_launch(run_dir, dataset, stop_at: int | None = None, own_count: bool = False) -> int:
    """The loop of docs/checkpoints.md at batch_size 2, grad_accum 2, a checkpoint every step and at the epoch's
    end, a batch that fails to load caught; until the epoch ends or step `stop_at` is saved (a crash then).
    `own_count`: the loop counts steps itself and goes on past the failure (`except OSError: continue`), as the
    guide's loop did. Returns the step it resumed from."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = ResumableDataLoader(dataset, batch_size=2, grad_accum=2)
    step = resumed = resume(run_dir, model=model, optimizer=optimizer, loader=dl)
    dl.ledger = Ledger.open(run_dir, dl.step if not own_count else step, len(dataset))
    batches = iter(dl)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except OSError:
            if own_count:
                continue
        else:
            model(batch.float()[:, None]).sum().backward()
        if dl.update_complete:
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            save_checkpoint(
                run_dir, step if own_count else None, model=model, optimizer=optimizer, loader=dl, ledger=dl.ledger
            )
            if (step if own_count else dl.step) == stop_at:
                break
    dl.ledger.close()
    return resumed


def test_a_failed_micro_batch_that_completes_an_update_keeps_the_loop_and_the_ledger_on_one_step(tmp_path):
    """16 samples, index 2 fails once, the second micro-batch of update 1. The guide's loop went on past the error
    without counting the update it completed: one step behind the loader, it saved step 1 with the progress of
    step 2, labelled so by the ledger, and the audit of the relaunch called samples 4..7 skipped. The loop that
    counts with the loader trains every other sample once."""
    assert loop_launch(tmp_path, FailsOnce(16, 2), stop_at=1) == 0
    assert loop_launch(tmp_path, FailsOnce(16, 2)) == 1
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean, f"skipped {epoch.skipped.tolist()}, duplicated {epoch.duplicated.tolist()}"
    assert (epoch.seen_once, epoch.failed.tolist()) == (14, [2, 3])
    assert latest(tmp_path).name == "step-000000004"  # 4 updates of 4 samples, the first short of its failed batch


def test_a_step_that_is_not_the_ledgers_is_refused_naming_both_and_the_fix(tmp_path):
    """The guide's former loop, one step behind after the failure: its save of step 1 is refused, nothing
    published, rather than labelling the ledger's step 2 as step 1."""
    with pytest.raises(
        ValueError,
        match=r"save_checkpoint\(step=1\): the loader completed 2 optimizer updates.*"
        r"the records of step 2 wrongly.*omit step=",
    ):
        loop_launch(tmp_path, FailsOnce(16, 2), stop_at=1, own_count=True)
    assert latest(tmp_path) is None


def _open_an_unreadable_run_dir(rank: int, world_size: int, run_dir: str) -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    objects = dict(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=ResumableDataLoader(IndexDataset(8), batch_size=2, rank=rank, world_size=world_size),
    )
    outcomes = []
    for call in (lambda: resume(run_dir, **objects), lambda: Ledger.open(run_dir, 0, 8)):
        try:
            call()
            outcomes.append("returned")
        except OSError as err:
            outcomes.append(f"{type(err).__name__}: {err}")
    return outcomes


@pytest.mark.slow
def test_a_run_directory_that_rank_0_cannot_read_fails_every_rank_at_once(tmp_path):
    """resume and Ledger.open look at the run directory on rank 0 alone: its error was raised there alone, while the
    other ranks waited in the broadcast, never told why: until the group's timeout (gloo's 30 min), a connection
    error once rank 0's process ended, or, where rank 0 went on, matched with its next collective (here Ledger.open's
    broadcast, whose directory rank 1 took for the checkpoint to load). Now every rank raises rank 0's error."""
    run_dir = tmp_path / "run"
    run_dir.write_text("a file where the run directory should be")
    first, second = run_group(_open_an_unreadable_run_dir, 2, str(run_dir))
    assert first == second and len(first) == 2
    assert first[0] == (
        f"NotADirectoryError: run_dir {run_dir} is not a directory (or one of its parents is a "
        f"file); pass the checkpoint directory"
    )
    assert first[1].startswith(("FileExistsError", "NotADirectoryError"))


def test_an_error_that_would_not_survive_the_broadcast_reaches_the_other_ranks_as_its_type_and_message():
    """from_rank0 hands rank 0's error to the others through a pickle: an exception whose constructor takes more
    than its message (SaveError) would fail to unpickle there, so its type and message travel as a RuntimeError;
    one that round-trips (OSError with its errno and path) travels as itself."""
    from loader.checkpoint.save import SaveError
    from loader.core.collectives import _portable

    refused = _portable(SaveError(3, "writing", {1: "ENOSPC"}, None))
    assert type(refused) is RuntimeError and str(refused).startswith("on rank 0: SaveError: the checkpoint of step 3")
    missing = NotADirectoryError(20, "Not a directory", "/run")
    assert _portable(missing) is missing


def test_a_checkpoint_is_published_only_after_the_ledger_records_it_counts_are_on_stable_storage(tmp_path, monkeypatch):
    """A power loss keeps what was fsynced: a published checkpoint whose ledger records were only flushed could count
    steps the ledger lost, and the audit would call their samples skipped. So every rank's ledger file, and the
    record of the epoch's drops, are fsynced before the checkpoint directory is renamed into place."""
    import os

    synced = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    def rename(src, dst):
        if ".tmp-" in os.fspath(src) and ".tmp-" not in os.fspath(dst):  # the publication itself
            published.append(set(synced))
        real_rename(src, dst)

    published = []
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    launch(tmp_path, 12, 4, every=3)  # 3 steps: one checkpoint, at the epoch's end (12 = 3 x 4, nothing dropped)
    ledger_file = next((tmp_path / "ledger").rglob("rank-00000.bin"))
    dropped = tmp_path / "ledger" / "dropped" / "epoch-000000.npy"
    assert len(published) == 1
    assert {ledger_file.stat().st_ino, dropped.stat().st_ino} <= published[0]
