"""Lightning DDP on CPU, real processes, real SIGKILLs: `fit(ckpt_path="last")` resumes exactly at the same and at
another device count, with and without gradient accumulation, across epochs. Every trained sample is counted by
the training step itself (tests/framework_jobs.py) and by the loader's ledger (`loader.checkpoint.audit`)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("lightning", reason="lightning is not installed: pip install -e '.[lightning]'")

from lightning.pytorch import (  # noqa: E402
    Callback,
    LightningModule,
    Trainer,  # noqa: E402
)
from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402

from loader import ResumableDataLoader  # noqa: E402
from loader.integrations.lightning import ResumableLoaderCallback  # noqa: E402
from tests.framework_jobs import Indexed, assert_exactly_once, resumed_step  # noqa: E402
from tests.launch import launch  # noqa: E402
from tests.lightning_job import Regression  # noqa: E402


def run(run_dir, launch_number, devices, *extra, timeout=240):
    argv = [
        "tests/lightning_job.py",
        str(run_dir),
        "--devices",
        str(devices),
        "--launch",
        str(launch_number),
        *map(str, extra),
    ]
    return launch(argv, run_dir.parent / f"launch-{launch_number}.log", timeout)


def log(run_dir, launch_number):
    return (run_dir.parent / f"launch-{launch_number}.log").read_text()


def fit_in_process(tmp_path, grad_accum, **trainer_options) -> Trainer:
    torch.manual_seed(0)
    dl = ResumableDataLoader(Indexed(24), batch_size=4, grad_accum=grad_accum)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        use_distributed_sampler=False,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_options,
    )
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


class Counted(LightningModule):
    """Notes the sample indices of each micro-batch with the optimizer step they feed."""

    def __init__(self, trained: list):
        super().__init__()
        self.net, self.trained = torch.nn.Linear(4, 1), trained

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.trained.append((self.trainer.global_step + 1, index.tolist()))
        return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Died(Exception):
    """The job's end right after a checkpoint."""


class CheckpointAtBatch(Callback):
    """Saves at the end of micro-batch `batch` (counted in the epoch from 1), after its training (as
    ModelCheckpoint(train_time_interval=...) may) or after the validation that follows it, then the job dies."""

    def __init__(self, path, batch: int, hook: str):
        self.path, self.batch, self.hook = path, batch, hook

    def _save(self, trainer, hook: str) -> None:
        if hook == self.hook and trainer.fit_loop.epoch_loop.batch_progress.current.ready == self.batch:
            trainer.save_checkpoint(self.path)
            raise Died

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._save(trainer, "train batch")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._save(trainer, "validation")


@pytest.mark.parametrize("hook", ["train batch", "validation"])
def test_a_checkpoint_between_micro_batches_resumes_at_the_update_boundary(tmp_path, hook):
    """Lightning counts the micro-batches of an unfinished update as done; the loader and the model do not. Resumed
    from such a checkpoint (here after micro-batch 10, the first of update 4), Lightning stepped a micro-batch early
    and the callback refused it, at every restart: now the update is trained again whole, every sample of the epoch
    once, in the uninterrupted run's steps, with Lightning's counters as that run's."""

    def fit(callbacks, trained, **options):
        dl = ResumableDataLoader(Indexed(48), batch_size=2, shuffle=True, seed=0, grad_accum=3)
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            use_distributed_sampler=False,
            max_epochs=1,
            logger=False,
            accumulate_grad_batches=3,
            val_check_interval=5,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ResumableLoaderCallback(), *callbacks],
        )
        trainer.fit(Counted(trained), train_dataloaders=dl, val_dataloaders=DataLoader(Indexed(2)), **options)
        return trainer

    uninterrupted, before, after = [], [], []
    fit([], uninterrupted)
    with pytest.raises(Died):
        fit([CheckpointAtBatch(tmp_path / "mid.ckpt", 10, hook)], before)
    assert [step for step, _ in before][-2:] == [3, 4]  # saved after a micro-batch of step 4
    trainer = fit([], after, ckpt_path=tmp_path / "mid.ckpt")
    trained = [entry for entry in before if entry[0] <= 3] + after
    assert trained == uninterrupted  # each step's micro-batches, in order
    assert sorted(i for _, indices in trained for i in indices) == list(range(48))
    assert trainer.global_step == 8 and trainer.fit_loop.epoch_loop._batches_that_stepped == 8


# The slow tests' jobs: the options of every launch, then each launch's device count and fault
SAME_DEVICE_COUNT = (
    ("--epochs", 2, "--every", 13),
    [(2, ("--fail-at-step", 20, "--fail-rank", 0)), (2, ("--fail-at-step", 27, "--fail-rank", 1)), (2, ())],
)
RESIZE_2_3_2 = (
    ("--epochs", 3, "--every", 2, "--accumulate", 2),
    [(2, ("--fail-at-step", 5, "--fail-rank", 1)), (3, ("--fail-at-step", 15, "--fail-rank", 0)), (2, ())],
)


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
