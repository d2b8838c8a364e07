"""Lightning DDP on CPU, real processes, real SIGKILLs: `fit(ckpt_path="last")` resumes exactly at the same and at
another device count, with and without gradient accumulation, across epochs. Every trained sample is counted by
the training step itself (tests/framework_jobs.py) and by the loader's ledger (`loader.checkpoint.audit`)."""

from concurrent.futures import ThreadPoolExecutor

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


# The slow tests' jobs: the options of every launch, then each launch's device count and fault
SAME_DEVICE_COUNT = (("--epochs", 2, "--every", 13),
                     [(2, ("--fail-at-step", 20, "--fail-rank", 0)), (2, ("--fail-at-step", 27, "--fail-rank", 1)),
                      (2, ())])
RESIZE_2_3_2 = (("--epochs", 3, "--every", 2, "--accumulate", 2),
                [(2, ("--fail-at-step", 5, "--fail-rank", 1)), (3, ("--fail-at-step", 15, "--fail-rank", 0)), (2, ())])


def launches(run_dir, job) -> list[int]:
    """The job's launches, one after the other; their exit codes."""
    options, plan = job
    return [run(run_dir, number, devices, *options, *fault) for number, (devices, fault) in enumerate(plan, 1)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both jobs at once (each one's launches one after the other): a launch is mostly one rank importing Lightning
    while the other waits for it, so two jobs take little longer than one on two cores. A test gets its job's run
    directory and the job, whose result() is its launches' exit codes (or raises the job's error)."""
    with ThreadPoolExecutor(2) as pool:
        running = {}
        for name, job in (("same device count", SAME_DEVICE_COUNT), ("resize", RESIZE_2_3_2)):
            run_dir = tmp_path_factory.mktemp("lightning") / "run"
            running[name] = run_dir, pool.submit(launches, run_dir, job)
        yield running


@pytest.mark.slow
def test_same_device_count_after_sigkill_mid_epoch_and_after_an_epoch_end_checkpoint(jobs):
    """26 steps per epoch at 2 devices, a checkpoint every 13: launch 2 resumes mid-epoch, launch 3 from the
    checkpoint of epoch 0's last step (Lightning goes on with epoch 1 through the iterator it made before)."""
    run_dir, job = jobs["same device count"]
    first, second, third = job.result()
    assert first == -9 and second != 0
    assert third == 0, log(run_dir, 3)
    assert (resumed_step(run_dir, 2), resumed_step(run_dir, 3)) == (13, 26)
    assert_exactly_once(run_dir, epochs=2)


@pytest.mark.slow
def test_resize_2_3_2_with_accumulation(jobs):
    """26 micro-batches of 4 per rank and epoch at 2 devices, 17 at 3, in updates of 2. Launch 2 resumes mid-epoch
    at more devices (Lightning's own cap would end the epoch early), launch 3 mid-epoch at fewer, then trains a
    whole further epoch (whose length differs from the resumed one's)."""
    run_dir, job = jobs["resize"]
    first, second, third = job.result()
    assert first != 0 and second == -9
    assert third == 0, log(run_dir, 3)
    assert (resumed_step(run_dir, 2), resumed_step(run_dir, 3)) == (4, 14)
    assert_exactly_once(run_dir, epochs=3)
