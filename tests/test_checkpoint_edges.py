"""Edges of checkpointing found by an adversarial review: a restart from an older checkpoint than the newest save,
and what it must leave coherent (the ledger's record of what each epoch dropped, the checkpoints kept)."""

import warnings

import pytest
import torch

from loader import ResumableDataLoader
from loader.checkpoint import Ledger, resume, save_checkpoint
from loader.checkpoint.audit import audit
from loader.checkpoint.publish import CheckpointWarning
from tests.conftest import IndexDataset


def damage(checkpoint) -> None:
    """One flipped bit in a checkpoint's data: `resume` skips it for the one before."""
    data = next(checkpoint.glob("*.distcp"))
    content = bytearray(data.read_bytes())
    content[10] ^= 1
    data.write_bytes(content)


def launch(run_dir, n: int, batch_size: int, every: int = 1, **save_options) -> int:
    """A launch that resumes, trains the rest of epoch 0 with drop_last and a checkpoint every `every` steps and
    after the last, each batch in the identity ledger. Returns the step it resumed from."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = ResumableDataLoader(IndexDataset(n), batch_size=batch_size, shuffle=True, seed=0, drop_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # the damaged checkpoints skipped, then set aside
        step = resumed = resume(run_dir, model=model, optimizer=optimizer, loader=dl)
        dl.ledger = Ledger.open(run_dir, step, n)
        for batch in dl:
            model(batch.float()[:, None]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % every == 0 or dl.exhausted:
                    save_checkpoint(run_dir, step, model=model, optimizer=optimizer, loader=dl, ledger=dl.ledger,
                                **save_options)
    dl.ledger.close()
    return resumed


def test_the_audit_judges_an_epoch_by_the_drops_of_the_launch_that_counts(tmp_path):
    """Launch 1 ends epoch 0 in 4 steps of 3, dropping nothing, and records so. Its last checkpoint is damaged;
    launch 2 resumes from step 2 at batches of 4: the 6 positions left are one step and 2 dropped by policy. The
    ledger kept launch 1's record of the epoch's drops, so the audit called the 2 skipped: a false failure."""
    assert launch(tmp_path, 12, 3, every=2) == 0
    damage(tmp_path / "step-000000004")
    assert launch(tmp_path, 12, 4) == 2
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean
    assert (epoch.seen_once, epoch.dropped, len(epoch.skipped), len(epoch.duplicated)) == (10, 2, 0, 0)
