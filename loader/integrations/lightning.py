"""PyTorch Lightning: a ResumableDataLoader under `Trainer(use_distributed_sampler=False)` resumes exactly.

Lightning saves rank 0's `state_dict()` of a stateful train loader in its checkpoint and loads it on every rank
when `fit(ckpt_path=...)` resumes; one rank's state stands for every rank in lockstep, at any device count. Three
things Lightning does need this callback:

- It caps the epoch at the `len()` it measured *before* loading the loader state. The restored batch counter plus
  the batches left can exceed that after a resume at more devices (batches done at the old world size count as
  this rank's), so the epoch would end early and skip samples silently; and it keeps one length for all epochs,
  where a resumed epoch's differs from the next one's after a resize. The callback sets Lightning's limit to the
  loader's `len()` once the state is loaded and before every batch.
- Resumed from the checkpoint of an epoch's last step, it goes on with the next epoch through the iterator it made
  before calling `set_epoch`, which supersedes that iterator. The callback moves the loader on first.
- Its accumulation counts batches on its own. The callback checks after every batch that Lightning stepped the
  optimizer exactly when the loader completed an update (`grad_accum` = `accumulate_grad_batches`), before a
  checkpoint could record a half-accumulated update as done or a done one as pending.
- It checkpoints between micro-batches of an update too (`ModelCheckpoint(train_time_interval=...)`, or
  `every_n_train_steps` at the first batch after a resume), counting the micro-batches of the unfinished update
  as done, while the loader counts completed updates only (their gradients are not saved). Resumed, Lightning
  would step K - j batches after the loader's update boundary: the check above refuses it, at every restart. The
  callback records such a checkpoint as of its last completed update, so it resumes like one taken right after
  that step.

Lightning's batch limits live in private attributes (`fit_loop.max_batches`, the CombinedLoader's `limits`); should
a release move them, the epoch-end check refuses to go on rather than skip samples.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

from lightning.pytorch import Callback, LightningModule, Trainer

from loader.core.sampler import AbandonedEpochWarning
from loader.dataloader import ResumableDataLoader


def _whole_epoch(trainer: Trainer) -> bool:
    """No limit of the user's: `limit_train_batches` is the float 1.0 (the int 1 means one batch) and no overfitting."""
    limit = trainer.limit_train_batches
    overfit = cast(Any, trainer).overfit_batches  # Lightning sets it in its setup (trainer/setup.py), undeclared
    return isinstance(limit, float) and limit == 1.0 and not overfit


def _loaders(trainer: Trainer) -> list[ResumableDataLoader]:
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else [dl for dl in combined.flattened if isinstance(dl, ResumableDataLoader)]


class ResumableLoaderCallback(Callback):
    """Makes Lightning end each epoch where the ResumableDataLoader's `len()` says, and refuses an accumulation
    that steps where the loader does not complete an update. Add it to `Trainer(callbacks=[...])` whenever the
    train loader is a ResumableDataLoader."""

    def __init__(self) -> None:
        self._steps_before = 0

    def _follow_len(self, trainer: Trainer) -> None:
        """Lightning's batch limit for this epoch is our loaders' len() as it is now, not as it was measured once."""
        fit_loop, combined = trainer.fit_loop, trainer.fit_loop._combined_loader
        assert combined is not None, "called only when the trainer has our loaders, in its combined loader"
        if not _whole_epoch(trainer) or combined.limits is None:
            return  # a deliberately shortened epoch: Lightning's limits are the user's
        for i, dl in enumerate(combined.flattened):  # in place: the running iterator holds this very list
            if isinstance(dl, ResumableDataLoader):
                combined.limits[i] = float("inf")
        fit_loop.max_batches = len(combined)
        time_based = getattr(trainer, "_val_check_time_interval", None) is not None
        if isinstance(trainer.val_check_interval, float) and not time_based:
            trainer.val_check_batch = max(1, int(fit_loop.max_batches * trainer.val_check_interval))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Runs after Lightning loaded the loader state and made the epoch's iterator, before its set_epoch."""
        loaders = _loaders(trainer)
        if not loaders:
            return
        self._follow_len(trainer)  # the restored epoch's: by it Lightning tells whether that epoch is over
        finished = [dl for dl in loaders if trainer.fit_loop.restarting and dl.exhausted]
        for dl in finished:  # restored at an epoch's end: Lightning goes on with the next epoch through the
            dl.set_epoch(dl.epoch + 1)  # iterator it made before its own set_epoch, which would supersede it
        assert trainer.fit_loop._data_fetcher is not None, "Lightning's setup_data made it, before on_train_start"
        if finished:
            iter(trainer.fit_loop._data_fetcher)  # the next epoch's iterators (and length)
        else:
            trainer.fit_loop._data_fetcher.reset()  # its length was taken under the cap

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint between micro-batches of an update records Lightning's loop at the update's start, where the
        loader's progress (completed updates) and the model (stepped at its end) stand."""
        loaders = _loaders(trainer)
        if not loaders or all(dl.update_complete for dl in loaders) or "loops" not in checkpoint:
            return
        loop = checkpoint["loops"]["fit_loop"]
        batches = loop["epoch_loop.batch_progress"]
        pending = batches["current"]["ready"] % trainer.accumulate_grad_batches
        for counts in (batches["total"], batches["current"]):
            for name in ("ready", "started", "processed", "completed"):
                counts[name] -= pending
        if batches["total"]["completed"] == batches["total"]["processed"] - 1:  # saved in on_train_batch_end:
            loop["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1  # the restart counts that batch's step again

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The last line of defence: an epoch that Lightning ended, unasked, before the loader's end skips samples.
        One the user limited (`limit_train_batches`) moves on here, so that Lightning's set_epoch of the next epoch
        does not warn that it abandons the rest: the user asked for that."""
        stopped = trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
        if stopped:
            return
        if not _whole_epoch(trainer):
            for dl in _loaders(trainer):
                if not dl.exhausted:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", AbandonedEpochWarning)
                        dl.set_epoch(dl.epoch + 1)
            return
        for dl in _loaders(trainer):
            if not dl.exhausted:
                raise RuntimeError(
                    f"Lightning ended epoch {trainer.current_epoch} with {dl.batches_left} batches of this rank's "
                    f"share still in the ResumableDataLoader: they would be skipped. This Lightning release limits the "
                    f"epoch where ResumableLoaderCallback does not lift the limit: report it with the Lightning version"
                )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Before Lightning asks whether this batch is the epoch's last (to step on it) or the loop is done."""
        self._steps_before = trainer.global_step
        if _loaders(trainer):
            self._follow_len(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = trainer.global_step != self._steps_before
        for dl in _loaders(trainer):
            if dl.update_complete != stepped:
                raise RuntimeError(
                    f"Lightning {'stepped' if stepped else 'did not step'} the optimizer after batch {batch_idx} of "
                    f"epoch {trainer.current_epoch}, but the ResumableDataLoader "
                    f"{'has not completed' if stepped else 'completed'} an update of grad_accum={dl.grad_accum} "
                    f"micro-batches: a checkpoint now would record the wrong progress. Pass "
                    f"ResumableDataLoader(grad_accum=K) the Trainer's accumulate_grad_batches=K, the same in every "
                    f"epoch"
                )
