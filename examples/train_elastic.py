"""Elastic data-parallel training that survives a killed worker: run it under torchrun.

    torchrun --nproc-per-node=4 --max-restarts=3 examples/train_elastic.py --run-dir /tmp/run --ledger \
        --fail-at-step 7 --fail-rank 2 --fail-mode sigkill

Every launch resumes from the newest checkpoint that verifies (model, optimizer, scheduler, RNG and the loader's
merged progress of one completed step), at whatever world size torchrun gives it. The global batch stays
`--global-batch`: the gradient-accumulation steps follow the world size (`loader.core.batch_policy.BatchPolicy`);
`--ramp 0:24,3:48` grows it by optimizer step instead (a batch-size ramp: K follows the step and the world size,
every step trains the samples of an uninterrupted run's).
Fault injection (once per run directory and step): `sigkill`, `node`, `hang` and `exception` strike mid-step (the
failing rank has already fetched a micro-batch of the next step); `node` also kills the rank's torchrun agent, so the
job comes back with fewer workers; `hang` SIGSTOPs the agent and the rank, a node that stops answering (SIGCONT
brings both back); `checkpoint` kills the rank after it wrote its files of that step's checkpoint, and
`checkpoint-hang` stops it (and its agent) before. `node`, `hang` and `checkpoint-hang` need torchrun's agent.
A peer that stops answering is detected by the process group's timeout, `--timeout`.
Backend: nccl when every local rank has a GPU of its own, else gloo on the CPU.
The loop is the same for any job: `train(args, make_task)` takes the data, model and loss from a `Task`
(examples/train_lm.py trains a language model on a mixture with it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from loader import ResumableDataLoader
from loader.checkpoint.ledger import Ledger
from loader.checkpoint.save import resume, save_checkpoint
from loader.core.batch_policy import BatchPolicy

FEATURES = 8
IN_SAVE = ("checkpoint", "checkpoint-hang")  # fault modes that strike in the checkpoint's save


class Regression(Dataset):
    """y = x . w + noise, each sample generated from its own index (plus `offset`, which sets another source's
    samples apart): any rank can load any sample."""

    def __init__(self, size: int, offset: int = 0):
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + int(index))
        x = torch.randn(FEATURES, generator=g)
        return x, x.sum() * 0.5 + 0.1 * torch.randn((), generator=g)


@dataclass
class Task:
    """What differs between jobs: the data, the model, and the loss of a batch summed over its items (samples, or
    tokens of a language model: `items_per_sample` of them per sample)."""

    dataset: Dataset
    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, Any, torch.device], torch.Tensor]
    items_per_sample: int = 1
    shuffle: bool = True
    controller: Any = None  # bind(loader) once the loader is made, after_update(step) after each optimizer step
    # (before the checkpoint, which then records what it changed), e.g. train_lm.py's mixture weights from losses


def regression_task(args) -> Task:
    def loss(model, batch, device):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x.to(device)).squeeze(1), y.to(device), reduction="sum")

    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return Task(Regression(args.samples), model, loss)


def parse_args(
    argv=None, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None, description: str | None = __doc__
) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--samples", type=int, default=480)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument(
        "--ramp",
        type=ramp_schedule,
        help="a global batch schedule by optimizer step, STEP:G,...: e.g. 0:24,3:48 (instead of --global-batch)",
    )
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9, halved every 10 steps)")
    p.add_argument("--checkpoint-every", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ledger", action="store_true", help="record every delivered sample index for the audit")
    p.add_argument("--snapshot-dir", type=Path, help="rank 0 saves model and optimizer after every step here")
    p.add_argument("--uneven", type=int, default=0, help="rank r stops r * UNEVEN steps early (DDP Join)")
    p.add_argument("--fail-at-step", type=int, help="fail during the step after this many completed steps")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument(
        "--fail-mode",
        choices=("sigkill", "node", "hang", "exception", *IN_SAVE),
        default="sigkill",
        help="node: SIGKILL this rank's torchrun agent, then the rank: the node is gone for good; hang: SIGSTOP both",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait for a dead peer")
    if add_arguments is not None:
        add_arguments(p)
    return p.parse_args(argv)


def ramp_schedule(text: str) -> list[tuple[int, int]]:
    """--ramp's STEP:G pairs, e.g. "0:24,3:48" (BatchPolicy checks the schedule itself)."""
    try:
        return [(int(step), int(g)) for step, g in (pair.split(":") for pair in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--ramp takes STEP:G pairs separated by commas, e.g. 0:24,3:48; got {text!r}"
        ) from None


def log(message: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[rank {rank}] {message}", flush=True)


class FaultInjector:
    """Strikes once per run directory and step (a marker file), so the restarted job trains through, and a launch
    told to fail at another step fails again (a chain of failures)."""

    def __init__(self, args):
        self.args, self.marker = args, args.run_dir / f"fault-injected-at-step-{args.fail_at_step}"

    def armed(self, step: int, rank: int) -> bool:
        a = self.args
        return (
            a.fail_at_step is not None and step == a.fail_at_step and rank == a.fail_rank and not self.marker.exists()
        )

    def strike_mid_step(self, step: int, rank: int) -> None:
        if self.args.fail_mode in IN_SAVE or not self.armed(step, rank):
            return
        self.marker.touch()
        log(f"fault injection: {self.args.fail_mode} during step {step + 1}")
        if self.args.fail_mode == "hang":
            _stop_node()
        if self.args.fail_mode == "node":
            os.kill(os.getppid(), signal.SIGKILL)
        if self.args.fail_mode in ("sigkill", "node"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure during step {step + 1}")

    def strike_in_checkpoint(self, step: int, rank: int) -> None:
        """Kill this rank after its files of the checkpoint are written (before rank 0's manifest and rename), or
        stop it before it writes them."""
        if self.args.fail_mode not in IN_SAVE or not self.armed(step, rank):
            return
        original, mode = dcp.save, self.args.fail_mode

        def save_with_fault(*args, **kwargs):
            self.marker.touch()
            if mode == "checkpoint-hang":
                log(f"fault injection: hangs while writing the checkpoint of step {step}")
                _stop_node()
                return original(*args, **kwargs)
            original(*args, **kwargs)
            log(f"fault injection: killed while writing the checkpoint of step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.save = save_with_fault


def _stop_node() -> None:
    """This node stops answering, as a hung machine would: its torchrun agent, then this rank, are SIGSTOPped."""
    os.kill(os.getppid(), signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def _one_gpu_per_rank() -> bool:
    """nccl needs a GPU of its own per rank on this node; otherwise train on the CPU with gloo."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def train(args, make_task: Callable[[argparse.Namespace], Task] = regression_task) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if _one_gpu_per_rank() else torch.device("cpu")
    )
    torch.manual_seed(args.seed)
    task = make_task(args)
    model = task.model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    policy = BatchPolicy(args.ramp or args.global_batch, args.micro_batch)
    accum = policy.grad_accum(world)  # of step 0; under --ramp the loader's follows the step
    dataset = task.dataset
    loader = ResumableDataLoader(
        dataset,
        batch_size=args.micro_batch,
        shuffle=task.shuffle,
        seed=args.seed,
        **({"batch_policy": policy} if args.ramp else {"grad_accum": accum}),
        num_workers=args.workers,
        drop_last=True,
    )
    objects = dict(model=ddp, optimizer=optimizer, loader=loader, scheduler=scheduler)
    if task.controller is not None:
        task.controller.bind(loader)
    started = time.perf_counter()
    step = resume(args.run_dir, **objects)  # and loader.step, which counts on from it
    log(
        f"world size {world}, grad_accum {loader.grad_accum}, resumed at step {step}, epoch {loader.epoch} "
        f"(checkpoint load {time.perf_counter() - started:.3f} s)"
    )
    if args.ledger:
        loader.ledger = Ledger.open(args.run_dir, step, len(dataset))
    faults = FaultInjector(args)
    scale = world / task.items_per_sample  # DDP averages over ranks: gradient sum / items of the step's global batch
    saved = step

    def run_pass() -> bool:
        """One pass over this rank's share; True when this rank stopped early (uneven inputs)."""
        nonlocal step, saved
        with ddp.join():  # uneven inputs: a rank that stops early shadows the others' all-reduces
            for batch in loader:
                faults.strike_mid_step(step, rank)
                with contextlib.nullcontext() if loader.update_complete else ddp.no_sync():
                    loss = task.loss(ddp, batch, device)
                    (loss * scale / policy.at(step)).backward()
                if not loader.update_complete:
                    continue
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step = loader.step  # the loader counts the updates, as the ledger labels them
                log(f"step {step} loss {loss.item() / (args.micro_batch * task.items_per_sample):.6f}")
                if task.controller is not None:
                    task.controller.after_update(step)
                if args.snapshot_dir is not None and rank == 0:
                    args.snapshot_dir.mkdir(parents=True, exist_ok=True)
                    torch.save(
                        {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                        args.snapshot_dir / f"step-{step:05d}.pt",
                    )
                if step % args.checkpoint_every == 0 and not args.uneven:  # a joined rank takes no collective
                    faults.strike_in_checkpoint(step, rank)
                    started = time.perf_counter()
                    save_checkpoint(args.run_dir, **objects, keep_last=args.keep_last, ledger=loader.ledger)
                    log(f"checkpoint of step {step} saved in {time.perf_counter() - started:.3f} s")
                    saved = step
                if args.uneven and loader.batches_left <= rank * args.uneven * loader.grad_accum:
                    log(f"uneven input: stopping with {loader.batches_left} micro-batches of epoch {loader.epoch} left")
                    return True
        if loader.exhausted:
            log(f"epoch {loader.epoch} finished: iterator exhausted after step {step}")
        return False

    stopped_early = False
    try:
        while not loader.finished(args.epochs) and not stopped_early:  # a relaunch of a finished run: nothing
            stopped_early = run_pass()
    except Exception as err:
        log(f"FAILED during step {step + 1}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise
    done = torch.tensor([step])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)  # a rank that joined early took fewer steps than the job
    step = int(done)
    if saved != step:  # the step of the rank that went furthest, which save_checkpoint takes
        save_checkpoint(args.run_dir, **objects, keep_last=args.keep_last, ledger=loader.ledger)
    loader.close()  # its workers and the ledger's file, now: not at the interpreter's exit, after the group
    if rank == 0:
        torch.save(model.state_dict(), args.run_dir / "final-model.pt")
    log(f"done at step {step}")
    return 0


def _store_of_this_launch(timeout: timedelta) -> dist.Store | None:
    """torchrun's agent shares its rendezvous TCPStore with the workers (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    is set for the agent), and a restarted group finds there the keys of the launch before it: gloo and NCCL then
    connect to dead peers and the restart fails (pytorch#135712; 3 of 3 restarts here). So each launch's keys get a
    prefix of their own: the agent's restart count. That count is one agent's, not the job's, so with several agents
    (nodes) the shared store is refused. None: no shared store, rank 0 hosts a fresh one per launch."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise SystemExit(
            "train_elastic.py: this job of several torchrun agents shares the agents' rendezvous store, which cannot "
            "tell one launch's workers from the next one's after a restart; start every agent with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
        )
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"launch-{os.environ['TORCHELASTIC_RESTART_COUNT']}", shared)


def run(args, make_task: Callable[[argparse.Namespace], Task] = regression_task) -> int:
    """Join the job's process group (torchrun's environment), train, leave."""
    backend = "nccl" if _one_gpu_per_rank() else "gloo"
    timeout = timedelta(seconds=args.timeout)
    store = _store_of_this_launch(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    code = train(args, make_task)  # on an exception, exit at once: the agent restarts the group, peers may be gone
    leave()
    return code


def leave() -> None:
    """Destroy the process group once nothing holds it. DDP's reducer holds it, and DDP sits in reference cycles
    that only the garbage collector frees: destroyed while the model was alive, the group was freed at the
    interpreter's exit instead, where gloo's teardown can hang (pytorch#56297). Every rank passed its last collective
    (the final all_reduce), so no peer waits on this one."""
    gc.collect()  # the DDP model of train(), and its reducer, go now
    dist.destroy_process_group()
    print(f"[rank {int(os.environ.get('RANK', 0))}] left the process group", flush=True)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
