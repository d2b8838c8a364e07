"""Lightning DDP on CPU, real processes, real SIGKILLs: `fit(ckpt_path="last")` resumes exactly at the same and at
another device count, with and without gradient accumulation, across epochs. Every trained sample is counted by
the training step itself (tests/framework_jobs.py) and by the loader's ledger (`loader.checkpoint.audit`)."""

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed: pip install -e '.[lightning]'")

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402

from loader import ResumableDataLoader  # noqa: E402
from loader.integrations.lightning import ResumableLoaderCallback  # noqa: E402
from tests.launch import launch  # noqa: E402
from tests.lightning_job import Regression  # noqa: E402
from tests.framework_jobs import Indexed, assert_exactly_once, resumed_step  # noqa: E402



def run(run_dir, launch_number, devices, *extra, timeout=240):
    argv = ["tests/lightning_job.py", str(run_dir), "--devices", str(devices), "--launch", str(launch_number),
            *map(str, extra)]
    return launch(argv, run_dir.parent / f"launch-{launch_number}.log", timeout)


def log(run_dir, launch_number):
    return (run_dir.parent / f"launch-{launch_number}.log").read_text()


def fit_in_process(tmp_path, grad_accum, **trainer_options) -> Trainer:
    torch.manual_seed(0)
    dl = ResumableDataLoader(Indexed(24), batch_size=4, grad_accum=grad_accum)
    trainer = Trainer(accelerator="cpu", devices=1, use_distributed_sampler=False, max_epochs=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      **trainer_options)
    trainer.fit(Regression(tmp_path, 1), train_dataloaders=dl)
    return trainer


def test_an_epoch_the_user_limits_keeps_its_limit(tmp_path):
    """limit_train_batches=1 (the int: one batch) is the user's choice, not a cap to lift, and no skip to refuse."""
    trainer = fit_in_process(tmp_path, 1, limit_train_batches=1, callbacks=[ResumableLoaderCallback()])
    assert trainer.global_step == 2  # one batch in each of the two epochs


def test_a_loader_accumulating_otherwise_than_lightning_is_refused_at_the_first_batch(tmp_path):
    with pytest.raises(RuntimeError, match="Lightning did not step the optimizer after batch 0 of epoch 0"):
        fit_in_process(tmp_path, 1, accumulate_grad_batches=2, callbacks=[ResumableLoaderCallback()])


def test_lightning_stepping_where_the_loader_has_no_complete_update_is_refused(tmp_path):
    schedule = GradientAccumulationScheduler({0: 2, 1: 1})  # epoch 1 steps after every batch, the loader after 2
    with pytest.raises(RuntimeError, match="Lightning stepped the optimizer after batch 0 of epoch 1"):
        fit_in_process(tmp_path, 2, callbacks=[ResumableLoaderCallback(), schedule])


@pytest.mark.slow
def test_same_device_count_after_sigkill_mid_epoch_and_after_an_epoch_end_checkpoint(tmp_path):
    """26 steps per epoch at 2 devices, a checkpoint every 13: launch 2 resumes mid-epoch, launch 3 from the
    checkpoint of epoch 0's last step (Lightning goes on with epoch 1 through the iterator it made before)."""
    run_dir = tmp_path / "run"
    job = ("--epochs", 2, "--every", 13)
    assert run(run_dir, 1, 2, *job, "--fail-at-step", 20, "--fail-rank", 0) == -9
    assert run(run_dir, 2, 2, *job, "--fail-at-step", 27, "--fail-rank", 1) != 0
    assert run(run_dir, 3, 2, *job) == 0, log(run_dir, 3)
    assert (resumed_step(run_dir, 2), resumed_step(run_dir, 3)) == (13, 26)
    assert_exactly_once(run_dir, epochs=2)


@pytest.mark.slow
def test_resize_2_3_2_with_accumulation(tmp_path):
    """26 micro-batches of 4 per rank and epoch at 2 devices, 17 at 3, in updates of 2. Launch 2 resumes mid-epoch
    at more devices (Lightning's own cap would end the epoch early), launch 3 mid-epoch at fewer, then trains a
    whole further epoch (whose length differs from the resumed one's)."""
    run_dir = tmp_path / "run"
    job = ("--epochs", 3, "--every", 2, "--accumulate", 2)
    assert run(run_dir, 1, 2, *job, "--fail-at-step", 5, "--fail-rank", 1) != 0
    assert run(run_dir, 2, 3, *job, "--fail-at-step", 15, "--fail-rank", 0) == -9
    assert run(run_dir, 3, 2, *job) == 0, log(run_dir, 3)
    assert (resumed_step(run_dir, 2), resumed_step(run_dir, 3)) == (4, 14)
    assert_exactly_once(run_dir, epochs=3)
