"""Coherent checkpoints in one process: round trip, validation against the run, failures that change nothing."""

import fractions
import io
import os
import pickle
import random
import re
import shlex
import shutil
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from loader import ContinuedPassWarning, ResumableDataLoader
from loader.checkpoint.publish import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointWarning,
    latest,
    list_checkpoints,
    publish,
    verify,
)
from loader.checkpoint.save import load_checkpoint, resume, save_checkpoint
from tests.conftest import IndexDataset
from tests.test_dataloader import Stream


def make(seed=0, n=60):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    loader = ResumableDataLoader(IndexDataset(n), batch_size=4, shuffle=True, seed=seed)
    return dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)


def continued(loader):
    """A new iterator that continues the pass, without the warning: the batches earlier iterators delivered were
    all trained, which is what the warning is there to question."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContinuedPassWarning)
        return iter(loader)


def train(objects, steps):
    it = continued(objects["loader"])
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
    expected_next = saved["loader"].peek().tolist()

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


def _flip(file, bit: int) -> bytes:
    """Flip one bit of the file; returns its previous content."""
    data = file.read_bytes()
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    file.write_bytes(bytes(flipped))
    return data


def test_a_flipped_manifest_field_is_skipped_not_believed(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, **make())
    manifest = tmp_path / "step-000000002" / "manifest.json"
    at = manifest.read_bytes().index(b'"global"') + 5  # the "a": one bit makes it "globel"
    _flip(manifest, 8 * at + 2)
    assert b'"globel"' in manifest.read_bytes()
    with pytest.warns(CheckpointWarning, match="step-000000002: manifest.json fails its own checksum"):
        assert resume(tmp_path, **make()) == 1


@pytest.mark.parametrize("name", ["manifest.json", ".metadata", "__0_0.distcp"])
def test_a_flipped_bit_anywhere_in_a_checkpoint_falls_back_to_the_previous_one(tmp_path, name):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, **make())
    file = tmp_path / "step-000000002" / name
    for bit in random.Random(name).sample(range(8 * file.stat().st_size), 8):
        intact = _flip(file, bit)
        with pytest.warns(CheckpointWarning, match="skipping checkpoint .*step-000000002"):
            assert resume(tmp_path, **make()) == 1, bit
        file.write_bytes(intact)


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
    _flip(tmp_path / "step-000000003" / "__0_0.distcp", 0)

    restarted = make()
    with pytest.warns(CheckpointWarning, match="skipping checkpoint .*step-000000003: checksum mismatch"):
        assert resume(tmp_path, **restarted) == 2
    train(restarted, 1)
    with pytest.warns(
        CheckpointWarning,
        match=r"step 3 is published again: the earlier .*step-000000003 \(its "
        r"manifest and sizes are intact\) was moved aside to .*step-000000003\.quarantine-",
    ):
        save_checkpoint(tmp_path, 3, **restarted)

    again = make()
    assert resume(tmp_path, **again) == 3  # the new publication, not the one set aside
    assert torch.equal(again["model"].weight, restarted["model"].weight)
    assert len(list(tmp_path.glob("step-000000003.quarantine-*"))) == 1


def everything(objects) -> dict:
    """All that a load may change: parameters, optimizer and scheduler state, the RNG streams, the loader's state."""
    return {
        "model": str(objects["model"].state_dict()),
        "optimizer": str(objects["optimizer"].state_dict()),
        "scheduler": objects["scheduler"].state_dict(),
        "rng": str((random.getstate(), np.random.get_state(), torch.get_rng_state())),
        "loader": objects["loader"].state_dict(),
    }


def wider(objects):
    """The same run with a wider model (3 -> 4 outputs): its shapes do not fit the checkpoint."""
    torch.manual_seed(0)
    objects["model"] = torch.nn.Linear(3, 4)
    objects["optimizer"] = torch.optim.Adam(objects["model"].parameters(), lr=0.1)
    objects["scheduler"] = torch.optim.lr_scheduler.StepLR(objects["optimizer"], step_size=2)
    return objects


def with_sgd(objects):
    """The same run with another optimizer: its state has other keys than the checkpoint's."""
    objects["optimizer"] = torch.optim.SGD(objects["model"].parameters(), lr=0.1, momentum=0.9)
    objects["scheduler"] = torch.optim.lr_scheduler.StepLR(objects["optimizer"], step_size=2)
    return objects


@pytest.mark.parametrize("mismatch, match", [(wider, "size mismatch"), (with_sgd, "momentum_buffer")])
@pytest.mark.parametrize("trained", [False, True])
def test_a_failed_load_changes_nothing(tmp_path, mismatch, match, trained):
    saved = make()
    train(saved, 3)
    path = save_checkpoint(tmp_path, 3, **saved)
    target = mismatch(make())
    if trained:  # a running job, not only a fresh start, is left as it was
        train(target, 2)
    fresh_batch = next(iter(make()["loader"])).tolist()
    before = everything(target)
    with pytest.raises(
        CheckpointError, match=f"(?i)checkpoint {path} was not loaded: rank 0: .*{match}.*Nothing was changed"
    ):
        load_checkpoint(path, **target)
    assert everything(target) == before
    if not trained:  # a caller falling back to a fresh start starts at the first batch, skipping nothing
        assert next(iter(target["loader"])).tolist() == fresh_batch


def test_a_stream_progress_that_cannot_be_repartitioned_changes_nothing(tmp_path):
    torch.manual_seed(0)
    saved = dict(make(), loader=ResumableDataLoader(Stream(40), batch_size=4))
    train(saved, 3)
    path = save_checkpoint(tmp_path, 3, **saved)
    target = dict(make(), loader=ResumableDataLoader(Stream(40), batch_size=4, rank=0, world_size=2))
    before = everything(target)
    with pytest.raises(
        CheckpointError,
        match="the loader progress does not fit this run: this IterableDataset "
        "progress was saved at world_size 1, the loader runs at 2.*Nothing was changed",
    ):
        load_checkpoint(path, **target)
    assert everything(target) == before


def test_missing_parts_are_clear_errors(tmp_path):
    objects = make()
    train(objects, 2)
    path = save_checkpoint(
        tmp_path, 1, model=objects["model"], optimizer=objects["optimizer"], loader=objects["loader"]
    )
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


class RunsCode:
    """Unpickled, it creates the file `marker`: any code could run the same way."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _crafted(tmp_path, objects, part: str, key: str, value, checkpoint_format: int | None = None):
    """Step 2 as save_checkpoint writes it but for `value` at state[part][key], published with a manifest that
    verifies: what a checkpoint crafted by an untrusted source looks like."""
    genuine = save_checkpoint(tmp_path / "genuine", 2, **objects)
    dcp_to_torch_save(genuine, tmp_path / "genuine.pt")
    state = torch.load(tmp_path / "genuine.pt", weights_only=True)
    state[part][key] = value
    extra = dict(verify(genuine).extra)
    extra["checkpoint_format"] = checkpoint_format or extra["checkpoint_format"]
    return publish(tmp_path / "run", 2, lambda d: dcp.save(state, checkpoint_id=d, no_dist=True), manifest_extra=extra)


def _consume(loader, batches: int | None = None) -> list[int]:
    """The indices of the next `batches` batches (all that are left of the epoch: None)."""
    it = continued(loader)
    return [i for _, batch in zip(range(batches) if batches else iter(int, 1), it) for i in batch.tolist()]


CRAFTED = {  # what a crafted checkpoint holds where, and what the refusal says
    "torch-saved object as the scheduler state": (
        "extras",
        "blob",
        lambda marker: _torch_saved(RunsCode(marker)),
        None,
        r"the scheduler and scaler states holds objects other than tensors and plain data \(Unsupported global: "
        r"GLOBAL io.open\): the loader never unpickles them",
    ),
    "object as a DCP value": (
        "loader",
        "progress",
        RunsCode,
        None,
        r"entry 'loader.progress' holds objects other than tensors and plain data \(Unsupported global",
    ),
    "pickle as the RNG states": (
        "rng",
        "all",
        lambda marker: pickle.dumps([RunsCode(marker)]),
        None,
        r"the RNG states: not JSON",
    ),
    "pickled RNG states of format 1": (
        "rng",
        "all",
        lambda marker: pickle.dumps([RunsCode(marker)]),
        1,
        r"is of checkpoint_format 1, which stores the RNG states as Python pickles: loading them could run any code",
    ),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path, case):
    part, key, payload, checkpoint_format, refusal = CRAFTED[case]
    marker = tmp_path / "code-ran"
    objects = make()
    delivered = _consume(objects["loader"], 2)
    save_checkpoint(tmp_path / "run", 1, **objects)
    _consume(objects["loader"], 1)  # consumed after step 1: step 1 replays it
    crafted = _crafted(tmp_path, objects, part, key, payload(marker), checkpoint_format)

    target = make()
    before = everything(target)
    with pytest.raises(CheckpointError, match=f"checkpoint {crafted} (was not loaded: rank 0: )?{refusal}"):
        resume(tmp_path / "run", **target)
    assert not marker.exists() and everything(target) == before
    # What was committed before is intact: step 1 loads, and the epoch goes on from it, every index exactly once.
    assert load_checkpoint(tmp_path / "run" / "step-000000001", **target) == 1
    assert Counter(delivered + _consume(target["loader"])) == Counter(range(60))


def test_a_crafted_checkpoint_of_plain_data_loads(tmp_path):
    """The control of the test above: crafted the same way, the genuine values load."""
    objects = make()
    delivered = _consume(objects["loader"], 2)
    _crafted(tmp_path, objects, "model", "weight", objects["model"].weight.detach().clone())
    target = make()
    assert resume(tmp_path / "run", **target) == 2
    assert torch.equal(target["model"].weight, objects["model"].weight)
    assert Counter(delivered + _consume(target["loader"])) == Counter(range(60))


class RunsCommand:
    """Unpickled, it runs a shell command that creates the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def _with_metadata(tmp_path, objects, value):
    """Step 2 as save_checkpoint writes it, but its DCP `.metadata` pickle also holding `value` (as the planner data,
    which DCP keeps as it finds it), published with a manifest that verifies."""
    genuine = save_checkpoint(tmp_path / "genuine", 2, **objects)
    metadata = pickle.loads((genuine / ".metadata").read_bytes())  # written just now by this test: trusted

    def write(target):
        for part in genuine.iterdir():
            if part.name != MANIFEST_NAME:
                shutil.copy(part, target / part.name)
        metadata.planner_data = value
        (target / ".metadata").write_bytes(pickle.dumps(metadata))

    return publish(tmp_path / "run", 2, write, manifest_extra=dict(verify(genuine).extra))


@pytest.mark.parametrize("payload, names", [(RunsCode, "io.open"), (RunsCommand, f"{os.system.__module__}.system")])
def test_a_crafted_dcp_metadata_is_refused_naming_what_it_names_without_running_it(tmp_path, payload, names):
    marker = tmp_path / "code-ran"
    objects = make()
    delivered = _consume(objects["loader"], 2)
    save_checkpoint(tmp_path / "run", 1, **objects)
    _consume(objects["loader"], 1)  # consumed after step 1: step 1 replays it
    crafted = _with_metadata(tmp_path, objects, payload(marker))

    target = make()
    before = everything(target)
    refusal = (
        f"checkpoint {crafted} was not loaded: rank 0: checkpoint file {crafted / '.metadata'} names {names}, "
        f"which is not one of DCP's metadata types: the loader never unpickles it"
    )
    with pytest.raises(CheckpointError, match=re.escape(refusal)):
        resume(tmp_path / "run", **target)
    assert not marker.exists() and everything(target) == before
    assert load_checkpoint(tmp_path / "run" / "step-000000001", **target) == 1
    assert Counter(delivered + _consume(target["loader"])) == Counter(range(60))
    pickle.loads((crafted / ".metadata").read_bytes())  # what DCP's own reader does: the payload runs
    assert marker.exists()


def test_a_checkpoint_file_linked_from_outside_is_skipped_for_the_previous_one(tmp_path):
    objects = make()
    delivered = _consume(objects["loader"], 2)
    save_checkpoint(tmp_path, 1, **objects)
    _consume(objects["loader"], 1)
    data = save_checkpoint(tmp_path, 2, **objects) / "__0_0.distcp"
    outside = tmp_path.parent / f"{tmp_path.name}-outside.distcp"  # the same bytes: sizes and checksums match
    os.rename(data, outside)
    data.symlink_to(outside)
    target = make()
    with pytest.warns(CheckpointWarning, match=r"step-000000002: '__0_0.distcp' is a symbolic link \(to "):
        assert resume(tmp_path, **target) == 1
    assert Counter(delivered + _consume(target["loader"])) == Counter(range(60))


class Warmup:
    """A learning-rate factor as a callable object: LambdaLR saves its attributes, here a Fraction."""

    def __init__(self):
        self.ratio = fractions.Fraction(1, 3)

    def __call__(self, step: int) -> float:
        return min(1.0, float(self.ratio) * (step + 1))


class WithExtraState(torch.nn.Linear):
    """A module whose extra state (saved by DCP besides the tensors) is a Fraction."""

    def get_extra_state(self):
        return {"ratio": fractions.Fraction(1, 3)}

    def set_extra_state(self, state) -> None:
        pass


def with_lambda_scheduler(objects):
    objects["scheduler"] = torch.optim.lr_scheduler.LambdaLR(objects["optimizer"], Warmup())
    return "scheduler.state_dict()['lr_lambdas'][0]['ratio']"


def with_extra_state(objects):
    torch.manual_seed(0)
    objects["model"] = WithExtraState(3, 2)
    objects["optimizer"] = torch.optim.Adam(objects["model"].parameters(), lr=0.1)
    objects["scheduler"] = torch.optim.lr_scheduler.StepLR(objects["optimizer"], step_size=2)
    return "model.state_dict()['_extra_state']['ratio']"


@pytest.mark.parametrize("change", [with_lambda_scheduler, with_extra_state])
def test_a_state_that_is_not_plain_data_fails_the_save_naming_it(tmp_path, change):
    """Found at save time, before anything is written: never a checkpoint that resume refuses."""
    objects = make()
    where = change(objects)
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"save_checkpoint: {where} is a Fraction, which a checkpoint cannot hold: resume reads checkpoints with "
            f"torch.load(weights_only=True), which takes only tensors, numbers"
        ),
    ):
        save_checkpoint(tmp_path, 1, **objects)
    assert list_checkpoints(tmp_path) == [] and list(tmp_path.iterdir()) == []


def _train(run_dir, epochs, stop_at=None):
    """The guide's loop over 30 samples, 8 steps an epoch: resume, train while not dl.finished(epochs); a
    checkpoint at step `stop_at` then the job dies, or one at the end. Returns the (epoch, index) pairs trained."""
    objects = make(n=30)
    dl = objects["loader"]
    resume(run_dir, **objects)
    trained = []
    while not dl.finished(epochs):
        for batch in dl:
            trained += [(dl.epoch, i) for i in batch.tolist()]
            if dl.step == stop_at:
                save_checkpoint(run_dir, **objects)
                return trained
    if trained:  # a relaunch that trained nothing has nothing new to save
        save_checkpoint(run_dir, **objects)
    return trained


def test_a_relaunch_of_a_finished_run_trains_nothing_more_unless_given_more_epochs(tmp_path):
    """A run of 2 epochs killed at step 5, relaunched, killed at its last step 16 (checkpointed before its pass
    saw the end), relaunched: nothing more is trained, as dl.finished(2) holds from the resume on; given 3 epochs,
    the third is trained. Every index of each epoch exactly once."""
    first = _train(tmp_path, 2, stop_at=5)
    second = _train(tmp_path, 2, stop_at=16)
    assert len(first) == 20 and _train(tmp_path, 2) == []  # the relaunch of the finished run
    objects = make(n=30)
    resume(tmp_path, **objects)
    assert objects["loader"].finished(2) and objects["loader"].finished(0) and not objects["loader"].finished(3)
    third = _train(tmp_path, 3)
    assert sorted(first + second + third) == [(e, i) for e in range(3) for i in range(30)]
    assert _train(tmp_path, 3) == []
    for wrong in (-1, True, 2.0):
        with pytest.raises(ValueError, match="epochs must be an int, 0 or more"):
            objects["loader"].finished(wrong)
