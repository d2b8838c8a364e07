"""Coherent checkpoints in one process: round trip, validation against the run, failures that change nothing."""

import random

import numpy as np
import pytest
import torch

from loader import ResumableDataLoader
from loader.checkpoint import load_checkpoint, resume, save_checkpoint
from loader.publish import CheckpointError, CheckpointWarning, latest
from tests.conftest import IndexDataset

def make(seed=0, n=60):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    loader = ResumableDataLoader(IndexDataset(n), batch_size=4, shuffle=True, seed=seed)
    return dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)


def train(objects, steps):
    it = iter(objects["loader"])
    for _ in range(steps):
        batch = next(it).float()
        loss = objects["model"](batch[:, None].repeat(1, 3)).pow(2).mean()
        loss.backward()
        objects["optimizer"].step()
        objects["scheduler"].step()
        objects["optimizer"].zero_grad()


def test_round_trip_restores_every_part_of_the_step(tmp_path):
    saved = make()
    train(saved, 3)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 3, **saved)
    expected_rng = (random.random(), np.random.rand(), torch.rand(1))
    expected_next = next(iter(saved["loader"])).tolist()

    restored = make()
    assert load_checkpoint(path, **restored) == 3
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected_rng
    assert next(iter(restored["loader"])).tolist() == expected_next
    for a, b in zip(saved["model"].parameters(), restored["model"].parameters()):
        assert torch.equal(a, b)
    assert restored["scheduler"].state_dict() == saved["scheduler"].state_dict()
    assert str(restored["optimizer"].state_dict()) == str(saved["optimizer"].state_dict())


def test_resume_picks_the_newest_verified_checkpoint(tmp_path):
    objects = make()
    assert resume(tmp_path / "nothing-yet", **objects) == 0
    for step in (1, 2):
        train(objects, 1)
        save_checkpoint(tmp_path, step, **objects)
    (latest(tmp_path) / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="step-000000002"):
        assert resume(tmp_path, **make()) == 1


def test_a_checkpoint_of_another_run_is_refused_naming_the_field(tmp_path):
    path = save_checkpoint(tmp_path, 1, **make(seed=0))
    fresh = make(seed=7)
    before = fresh["loader"].state_dict()
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-000000001.*seed is 0 .* but 7"):
        load_checkpoint(path, **fresh)
    with pytest.raises(CheckpointError, match="num_samples is 60 .* but 61"):
        load_checkpoint(path, **make(n=61))
    assert fresh["loader"].state_dict() == before


def test_a_step_saved_again_after_a_fallback_publishes_instead_of_crash_looping(tmp_path):
    objects = make()
    for step in (1, 2, 3):
        train(objects, 1)
        save_checkpoint(tmp_path, step, **objects)
    data = tmp_path / "step-000000003" / "__0_0.distcp"
    data.write_bytes(bytes([data.read_bytes()[0] ^ 1]) + data.read_bytes()[1:])  # one flipped bit

    restarted = make()
    with pytest.warns(CheckpointWarning, match="skipping checkpoint .*step-000000003: checksum mismatch"):
        assert resume(tmp_path, **restarted) == 2
    train(restarted, 1)
    with pytest.warns(CheckpointWarning, match=r"step 3 is published again: the earlier .*step-000000003 \(its "
                      r"manifest and sizes are intact\) was moved aside to .*step-000000003\.quarantine-"):
        save_checkpoint(tmp_path, 3, **restarted)

    again = make()
    assert resume(tmp_path, **again) == 3  # the new publication, not the one set aside
    assert torch.equal(again["model"].weight, restarted["model"].weight)
    assert len(list(tmp_path.glob("step-000000003.quarantine-*"))) == 1


def test_missing_parts_are_clear_errors(tmp_path):
    objects = make()
    train(objects, 2)
    path = save_checkpoint(tmp_path, 1, model=objects["model"], optimizer=objects["optimizer"], loader=objects["loader"])
    target = make()
    before = (target["loader"].state_dict(), target["model"].weight.clone())
    with pytest.raises(CheckpointError, match="has no scheduler state"):
        load_checkpoint(path, **target)
    assert target["loader"].state_dict() == before[0] and torch.equal(target["model"].weight, before[1])
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(tmp_path / "step-000000009", **make())


def test_grad_scaler_state_round_trips(tmp_path):
    objects = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    scaler.scale(torch.ones(()))
    scaler.update(512.0)
    path = save_checkpoint(tmp_path, 1, **objects, scaler=scaler)
    restored = torch.amp.GradScaler("cpu")
    load_checkpoint(path, **make(), scaler=restored)
    assert restored.state_dict() == scaler.state_dict() and restored.get_scale() == 512.0
