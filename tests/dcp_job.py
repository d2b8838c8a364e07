"""DCP the torchtitan way, for tests: an FSDP2 model and its optimizer, with the loader's progress as one more entry
of the torch.distributed.checkpoint state dict, saved with `dcp.save` or `dcp.async_save` (on a gloo group of its
own, as torchtitan does, so the writer's collectives never interleave with training's) and loaded at any world size.

A checkpoint counts once its `.metadata` exists: DCP writes it last, after every rank's data. Run by the forked
agent of tests/elastic.py (`main(argv)`); with `--async-save`, `--hold-at-step S` writes the checkpoint of step S
only when the next one is taken (training went on meanwhile), `--stall-at-step S` never writes it, and
`--fail-at-step F` SIGKILLs `--fail-rank` right before optimizer step F + 1. Rank 0 keeps the full model of
each checkpointed step in snapshots/, so a resumed run can show that it loaded that step's model.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from loader.checkpoint.ledger import Ledger
from loader.integrations.dcp import LoaderState, ModelAndOptimizer, dcp_load
from tests.framework_jobs import SAMPLES, TrainedLog, end_process_group, job_loader, job_parser, train_epochs


class HeldWriter(FileSystemWriter):
    """Storage that writes only once `release` is set: later (or never) while training goes on."""

    def __init__(self, path: Path, release: threading.Event):
        super().__init__(path)
        self.release = release

    def write_data(self, plan, planner):
        self.release.wait()
        return super().write_data(plan, planner)


def newest_committed(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in run_dir.glob("step-*/.metadata"))
    return done[-1] if done else None


def full_model(model: torch.nn.Module) -> dict:
    """The whole model on rank 0 (a collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    writer_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    dl = job_loader(args.accumulate)
    state = {"train": ModelAndOptimizer(model, optimizer), "loader": LoaderState(dl)}

    step, found = 0, newest_committed(args.run_dir)
    if found is not None:
        dcp_load(state, found)
        step = int(found.name[5:])
        loaded = full_model(model)
        if rank == 0:
            saved = torch.load(args.run_dir / "snapshots" / f"step-{step:06d}.pt")
            assert all(torch.equal(loaded[k], saved[k]) for k in saved), f"checkpoint {found} holds another model"
    log = TrainedLog(args.run_dir, args.launch, rank)
    if rank == 0:
        log.started(step, world)
    dl.ledger = Ledger.open(args.run_dir, step, SAMPLES)
    pending, held = None, threading.Event()

    def backward(x, y, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)
        (torch.nn.functional.mse_loss(model(x).squeeze(1), y) / args.accumulate).backward()

    def checkpoint(step: int) -> None:
        nonlocal pending, held
        snapshot = full_model(model)
        if rank == 0:
            (args.run_dir / "snapshots").mkdir(exist_ok=True)
            torch.save(snapshot, args.run_dir / "snapshots" / f"step-{step:06d}.pt")
        target = args.run_dir / f"step-{step:06d}"
        if not args.async_save:
            dcp.save(state, checkpoint_id=target)
            return
        if pending is not None:
            held.set()  # a held write goes on only now, --every steps after its state was taken
            pending.result()  # one write at a time, as torchtitan waits for the previous one
        held, writer = threading.Event(), FileSystemWriter(target)
        if step in (args.hold_at_step, args.stall_at_step):
            writer = HeldWriter(target, held if step == args.hold_at_step else threading.Event())
        pending = dcp.async_save(state, storage_writer=writer, process_group=writer_group)

    train_epochs(dl, optimizer, args, log, step, backward, checkpoint)
    if pending is not None:
        pending.result()


def main(argv=None) -> int:
    p = job_parser(__doc__)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--hold-at-step", type=int, help="this step's checkpoint is written only at the next one")
    p.add_argument("--stall-at-step", type=int, help="this step's checkpoint is never written")
    args = p.parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    train(args)
    end_process_group()
    return 0
