"""Training on a device mesh, torchtitan style: FSDP2 over the data-parallel dimensions, tensor parallelism over
"tp", and one torch.distributed.checkpoint (DCP) state dict holding model, optimizer and the loader's progress
(`LoaderState`). Run it under torchrun, and restart it at any other mesh shape:

    torchrun --nproc-per-node=4 examples/train_3d.py --run-dir /tmp/run --dp-shard 2 --tp 2
    torchrun --nproc-per-node=3 examples/train_3d.py --run-dir /tmp/run --dp-shard 3 --tp 1   # resumes exactly

The loader partitions over the data-parallel coordinate (`dp_mesh=world_mesh["dp_replicate", "dp_shard"]`,
flattened in the mesh's order), so both tensor-parallel peers of a data-parallel rank get the same batches, as
ColwiseParallel's replicated input requires. The global batch stays `--global-batch` at every shape: grad_accum
follows the data-parallel size. Each launch resumes from the newest checkpoint whose `.metadata` (DCP's commit
marker, written last) exists. `--fail-at-step S --fail-rank R` SIGKILLs rank R right before optimizer step S + 1,
once per run directory; `--ledger` records every sample each data-parallel rank trained (one tensor-parallel peer
writes it) for `python -m loader audit RUN_DIR`. Backend: nccl when every local rank has a GPU, else gloo on the CPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example, also when loaded by path
from train_elastic import FEATURES, Regression, _one_gpu_per_rank, log  # noqa: E402

from loader import ResumableDataLoader  # noqa: E402
from loader.checkpoint.ledger import Ledger  # noqa: E402
from loader.integrations.dcp import LoaderState, ModelAndOptimizer, dcp_load  # noqa: E402

HIDDEN = 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (1: plain FSDP)")
    p.add_argument("--dp-shard", type=int, default=-1, help="FSDP shards (-1: what the other dimensions leave)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    p.add_argument("--every", type=int, default=3, help="optimizer steps between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ledger", action="store_true", help="record every trained sample index for the audit")
    p.add_argument("--fail-at-step", type=int, help="SIGKILL --fail-rank right before optimizer step S + 1")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait for a dead peer")
    return p.parse_args(argv)


def build_mesh(args, device: torch.device):
    """The world mesh (dp_replicate, dp_shard, tp), as torchtitan's ParallelDims builds it."""
    world = dist.get_world_size()
    shard = args.dp_shard if args.dp_shard > 0 else world // (args.dp_replicate * args.tp)
    if args.dp_replicate * shard * args.tp != world:
        raise SystemExit(
            f"--dp-replicate {args.dp_replicate} x --dp-shard {shard} x --tp {args.tp} is not the world size {world}"
        )
    return init_device_mesh(
        device.type, (args.dp_replicate, shard, args.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )


def build_model(world_mesh, device: torch.device) -> torch.nn.Module:
    """A float64 MLP: TP splits its hidden layer over "tp" (when tp > 1), FSDP2 shards it over the dp dimensions
    (HSDP when dp_replicate > 1). The same initial weights at every shape: seeded, made whole, then parallelised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    model = model.to(device=device, dtype=torch.float64)
    if world_mesh["tp"].size() > 1:
        parallelize_module(model, world_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=world_mesh["dp_replicate", "dp_shard"])
    return model


def newest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in run_dir.glob("step-*/.metadata"))
    return done[-1] if done else None


def train(args) -> None:
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}") if _one_gpu_per_rank() else torch.device("cpu")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    world_mesh = build_mesh(args, device)
    dp_mesh = world_mesh["dp_replicate", "dp_shard"]
    dp_flat = dp_mesh._flatten("dp")  # torchtitan's world_mesh["dp"]: the ledger's group
    dp = dp_mesh.size()
    model = build_model(world_mesh, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    accum = args.global_batch // (args.micro_batch * dp)
    if accum * args.micro_batch * dp != args.global_batch:
        raise SystemExit(
            f"--global-batch {args.global_batch} is not a multiple of --micro-batch x dp = {args.micro_batch * dp}"
        )
    dataset = Regression(args.samples)
    loader = ResumableDataLoader(
        dataset, batch_size=args.micro_batch, shuffle=True, seed=args.seed, grad_accum=accum, dp_mesh=dp_mesh
    )
    state = {"train": ModelAndOptimizer(model, optimizer), "dataloader": LoaderState(loader)}

    step, found = 0, newest_checkpoint(args.run_dir)
    if found is not None:
        dcp_load(state, found)
        step = int(found.name[5:])
    rank = dist.get_rank()
    if rank == 0:
        log(
            f"mesh {tuple(world_mesh.mesh.shape)} (dp_replicate, dp_shard, tp), grad_accum {accum}, resumed at "
            f"step {step}, epoch {loader.epoch}"
        )
    if args.ledger and world_mesh["tp"].get_local_rank() == 0:  # one peer per data-parallel rank writes it
        loader.ledger = Ledger.open(args.run_dir, step, len(dataset), group=dp_flat.get_group())
    scale = dp / args.global_batch  # FSDP averages gradients over dp: each update's is the mean over its samples

    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            model.set_requires_gradient_sync(loader.update_complete)
            x, y = x.to(device, torch.float64), y.to(device, torch.float64)
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y, reduction="sum")
            (loss * scale).backward()
            if not loader.update_complete:
                continue
            if step == args.fail_at_step and rank == args.fail_rank:
                marker = args.run_dir / f"fault-at-step-{step}"
                if not marker.exists():
                    marker.touch()
                    log(f"fault injection: SIGKILL during step {step + 1}")
                    os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.every == 0:
                dcp.save(state, checkpoint_id=args.run_dir / f"step-{step:06d}")
    loader.close()  # the ledger's file, now: not at the interpreter's exit
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, args.run_dir / "final-model.pt")
        log(f"done at step {step}")


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl" if _one_gpu_per_rank() else "gloo", timeout=timedelta(seconds=args.timeout))
    train(args)  # on an exception, exit at once: a peer may be gone, so no collective would return
    gc.collect()  # FSDP2's and DTensor's cycles hold the mesh's groups: freed now, while the interpreter is whole,
    dist.destroy_process_group()  # not at its exit, where a group's teardown aborted a rank (-6) once under load
    return 0


if __name__ == "__main__":
    sys.exit(main())
