"""An Accelerate job on CPU over a ResumableDataLoader, for tests, launched by torchrun: model and optimizer
prepared, the loader left out of prepare() and registered for checkpointing, `save_state()` every few steps,
`load_state()` of the newest complete checkpoint at start, a SIGKILL of one rank on request.

    torchrun --standalone --nproc-per-node 2 tests/accelerate_job.py RUN_DIR --launch 1 [--fail-at-step 5]
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from accelerate import Accelerator

from loader.checkpoint.ledger import Ledger
from tests.framework_jobs import SAMPLES, TrainedLog, end_process_group, job_loader, job_parser, train_epochs

COMPLETE = "complete"  # save_state() writes in place: a checkpoint counts once every rank has returned from it


def newest_complete(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in run_dir.glob(f"step-*/{COMPLETE}"))
    return done[-1] if done else None


def train(args) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    dl = job_loader(args.accumulate)
    accelerator.register_for_checkpointing(dl)

    step, resume_from = 0, newest_complete(args.run_dir)
    if resume_from is not None:
        accelerator.load_state(resume_from)
        step = int(resume_from.name[5:])
    log = TrainedLog(args.run_dir, args.launch, accelerator.process_index)
    if accelerator.is_main_process:
        log.started(step, accelerator.num_processes)
    dl.ledger = Ledger.open(args.run_dir, step, SAMPLES)

    def backward(x, y, sync: bool) -> None:
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        with contextlib.nullcontext() if sync else accelerator.no_sync(model):
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            accelerator.backward(loss / args.accumulate)

    def checkpoint(step: int) -> None:
        target = args.run_dir / f"step-{step:06d}"
        accelerator.save_state(target)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (target / COMPLETE).touch()

    train_epochs(dl, optimizer, args, log, step, backward, checkpoint)


def main() -> None:
    args = job_parser(__doc__).parse_args()
    torch.set_num_threads(1)
    train(args)  # the accelerator and the DDP model it prepared were its locals
    end_process_group()  # what accelerator.end_training() does, once the DDP model is gone


if __name__ == "__main__":
    main()
