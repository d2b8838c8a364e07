"""A Lightning DDP job on CPU over a ResumableDataLoader, for tests: checkpoints every few steps, SIGKILLs one of
its ranks on request, resumes with `fit(ckpt_path="last")` at whatever device count it is given.

    python tests/lightning_job.py RUN_DIR --devices 2 --launch 1 [--accumulate 2] [--fail-at-step 5 --fail-rank 1]

Lightning runs this file once per rank (hence a real script with a main guard). The loader is built before the
process group exists, as scripts written for Lightning do, and handed to `fit()`.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from loader import ResumableDataLoader
from loader.checkpoint.ledger import Ledger
from loader.integrations.lightning import ResumableLoaderCallback
from tests.framework_jobs import TrainedLog, end_process_group, job_loader, job_parser, strike


class Regression(L.LightningModule):
    """Logs the sample indices of every batch it trains, with the optimizer step they feed."""

    def __init__(self, run_dir: Path, launch: int):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.run_dir, self.launch, self.trained_log = run_dir, launch, None

    def on_train_start(self) -> None:
        self.trained_log = TrainedLog(self.run_dir, self.launch, self.global_rank)
        if self.global_rank == 0:
            self.trained_log.started(self.trainer.global_step, self.trainer.world_size)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.trained_log.trained(self.trainer.global_step + 1, self.trainer.current_epoch, index.tolist())
        return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class AttachLedger(Callback):
    """The identity ledger for `python -m loader audit`: opened once the checkpoint is loaded (its step known)."""

    def __init__(self, loader: ResumableDataLoader, run_dir: Path):
        self.loader, self.run_dir = loader, run_dir

    def on_train_start(self, trainer, pl_module) -> None:
        self.loader.ledger = Ledger.open(self.run_dir, trainer.global_step, len(self.loader.dataset))


class Fault(Callback):
    """The injected SIGKILL, right before an optimizer step."""

    def __init__(self, args):
        self.args = args

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        strike(self.args, trainer.global_step, trainer.global_rank)


def train(args) -> None:
    dl = job_loader(args.accumulate)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
        devices=args.devices,
        use_distributed_sampler=False,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        callbacks=[
            ResumableLoaderCallback(),
            AttachLedger(dl, args.run_dir),
            Fault(args),
            ModelCheckpoint(
                dirpath=args.run_dir / "ckpt", every_n_train_steps=args.every, save_last=True, save_top_k=0
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(args.run_dir, args.launch), train_dataloaders=dl, ckpt_path="last")


def main() -> None:
    p = job_parser(__doc__)
    p.add_argument("--devices", type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    train(args)  # the trainer, the model and the loader were its locals
    end_process_group()


if __name__ == "__main__":
    main()
