"""What the framework jobs (tests/*_job.py) share: the dataset, the loader, the options, the fault, and the count
of what the model was trained on, kept by the training step itself, independently of the loader's ledger.

For that count, each rank of each launch appends one line per micro-batch: the optimizer step it feeds (completed
steps + 1), the epoch and the sample indices it held. A launch records the step it resumed from; records of an
earlier launch past that step were replayed and do not count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from loader import ResumableDataLoader
from loader.checkpoint.audit import audit
from loader.core import collectives

SAMPLES = 203  # the framework jobs' dataset: no multiple of their global batches, so every epoch ends short


class Indexed(Dataset):
    """A regression sample per index that also carries the index, so the training step sees what it trains."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(int(index))
        x = torch.randn(4, generator=g)
        return x, x.sum(), int(index)


def job_parser(description: str) -> argparse.ArgumentParser:
    """The options every framework job takes: where, which launch, the schedule, and the fault to inject."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--launch", type=int, required=True, help="this launch's number: 1, 2, ... in order")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--every", type=int, default=3, help="checkpoint every this many optimizer steps")
    p.add_argument("--fail-at-step", type=int, help="SIGKILL --fail-rank right before optimizer step F + 1")
    p.add_argument("--fail-rank", type=int, default=0)
    return p


def strike(args: argparse.Namespace, step: int, rank: int) -> None:
    """SIGKILL this process if it is --fail-rank about to take optimizer step --fail-at-step + 1 (the step's
    micro-batches trained, its update not taken); once per run directory, so the next launch trains through."""
    marker = args.run_dir / f"fault-at-{args.fail_at_step}"
    if step == args.fail_at_step and rank == args.fail_rank and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def job_loader(grad_accum: int) -> ResumableDataLoader:
    """Rank and world size left to torch.distributed, read when iteration starts (the Lightning job builds the
    loader before the process group exists)."""
    return ResumableDataLoader(Indexed(SAMPLES), batch_size=4, shuffle=True, seed=7, grad_accum=grad_accum)


def train_epochs(
    dl: ResumableDataLoader,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    log: TrainedLog,
    step: int,
    backward: Callable[[torch.Tensor, torch.Tensor, bool], None],
    checkpoint: Callable[[int], None],
) -> None:
    """The plain loop the Accelerate and DCP jobs share: `backward(x, y, sync)` with gradient sync only on an
    update's last micro-batch, the optimizer step when the loader says the update is complete, then
    `checkpoint(step)` every --every steps."""
    for epoch in range(dl.epoch, args.epochs):
        dl.set_epoch(epoch)
        for x, y, index in dl:
            backward(x, y, dl.update_complete)
            log.trained(step + 1, epoch, index.tolist())
            if not dl.update_complete:
                continue
            strike(args, step, collectives.rank())
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.every == 0:
                checkpoint(step)


def end_process_group() -> None:
    """How every framework job ends: the default process group destroyed while the interpreter is whole, after
    the DDP-wrapped model is gone. Call it once nothing references that model any more (the trainer, accelerator,
    optimizer and loader that hold it were locals of a function that has returned).

    Both halves matter. A gloo group left to interpreter exit is torn down during finalization: a gloo worker
    thread dropping a finished collective's work decrefs its tensors' Python objects, takes the GIL, finds the
    interpreter finalizing and is ended by pthread_exit, whose forced unwind through a noexcept frame aborts the
    process after training finished ("terminate called without an active exception", exit -6). Lightning leaves
    a gloo group so (it destroys only NCCL groups at exit). And a DDP model that outlives its group deadlocks:
    its reducer drops the group's last reference with the GIL held while a gloo thread waits for the GIL.
    """
    gc.collect()  # the reference cycles holding a model (a LightningModule and its Trainer) go now
    alive = [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]
    assert not alive, f"{len(alive)} DDP model(s) still referenced: they must go before their process group"
    if dist.is_initialized():
        dist.destroy_process_group()


class TrainedLog:
    """One rank's record of one launch."""

    def __init__(self, run_dir: Path, launch: int, rank: int):
        root = Path(run_dir) / "trained"
        root.mkdir(parents=True, exist_ok=True)
        self._file = open(root / f"launch-{launch:03d}-rank-{rank:03d}.jsonl", "a", buffering=1)
        self._start = root / f"launch-{launch:03d}-start.json"

    def started(self, step: int, world_size: int) -> None:
        self._start.write_text(json.dumps({"step": step, "world_size": world_size}))

    def trained(self, step: int, epoch: int, indices) -> None:
        self._file.write(json.dumps([step, epoch, [int(i) for i in indices]]) + "\n")


def trained_counts(run_dir: Path) -> dict[int, Counter]:
    """Per epoch, how often each sample index was trained in steps that count."""
    root = Path(run_dir) / "trained"
    launches = sorted({int(p.name[7:10]) for p in root.glob("launch-*-start.json")})
    starts = {n: json.loads((root / f"launch-{n:03d}-start.json").read_text())["step"] for n in launches}
    counts: dict[int, Counter] = {}
    for i, launch in enumerate(launches):
        cutoff = min((starts[later] for later in launches[i + 1 :]), default=float("inf"))
        for path in sorted(root.glob(f"launch-{launch:03d}-rank-*.jsonl")):
            for line in path.read_text().split("\n")[:-1]:  # what follows the last newline was torn by a kill
                step, epoch, indices = json.loads(line)
                if step <= cutoff:
                    counts.setdefault(epoch, Counter()).update(indices)
    return counts


def resumed_step(run_dir: Path, launch: int) -> int:
    return json.loads((Path(run_dir) / "trained" / f"launch-{launch:03d}-start.json").read_text())["step"]


def assert_exactly_once(run_dir: Path, epochs: int, num_samples: int = SAMPLES) -> None:
    """Every sample of every epoch trained once, as counted here and as the loader's ledger audits it."""
    counts = trained_counts(run_dir)
    assert sorted(counts) == list(range(epochs)), f"epochs trained: {sorted(counts)}"
    for epoch, counter in counts.items():
        repeated = sorted(i for i, c in counter.items() if c > 1)
        skipped = sorted(set(range(num_samples)) - set(counter))
        assert not repeated and not skipped, f"epoch {epoch}: repeated {repeated[:20]}, skipped {skipped[:20]}"
    report = audit(run_dir)
    assert [e.epoch for e in report if e.finished] == list(range(epochs))
    assert all(e.clean and e.seen_once == num_samples for e in report)
