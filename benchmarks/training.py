"""2. Training-step overhead: a small MLP trained with each loader, against the limit of device-resident data.

The limit runs the same steps on batches already on the device, so (step time with a loader) / (limit) is what
input loading adds to a step. On a GPU that is the headline overhead, with pinned memory on and off; on a CPU
the model and the loader share the cores, so only the ratio of our loader to DataLoader is meaningful there.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from benchmarks.config import Config
from benchmarks.datasets import FeatureDataset
from benchmarks.loaders import CANDIDATES, OURS_CHECKPOINTING, TORCH, Candidate, steps
from benchmarks.rows import row
from benchmarks.timing import compare, ratio_of, sync

RESIDENT = "device-resident (limit)"
UNPINNED = "pin_memory=False"
TARGET = "<= 1.01"  # our step time / the limit on a GPU; / DataLoader's everywhere (on a CPU the limit is no bar)


class Trainer:
    """One model and optimizer, reused by every candidate, so all of them run identical steps."""

    def __init__(self, cfg: Config, classes: int = 10):
        torch.manual_seed(0)
        widths = [cfg.model.features] + [cfg.model.hidden] * cfg.model.depth
        layers = [layer for a, b in zip(widths, widths[1:]) for layer in (nn.Linear(a, b), nn.ReLU())]
        self.model = nn.Sequential(*layers, nn.Linear(widths[-1], classes)).to(cfg.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.device = cfg.device

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = (t.to(self.device, non_blocking=True) for t in batch)
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def seconds_per_step(self, batches: Iterable) -> float:
        """Mean step time after the first step (which pays worker start-up and lazy initialisation)."""
        batches = iter(batches)
        self.step(next(batches))
        sync(self.device)
        start, count = time.perf_counter(), 0
        for batch in batches:
            self.step(batch)
            count += 1
        sync(self.device)
        return (time.perf_counter() - start) / count


def _with_loader(trainer: Trainer, candidate: Candidate, dataset, **kwargs) -> float:
    loader = candidate.make(dataset, **kwargs)
    return trainer.seconds_per_step(steps(loader, candidate.checkpoint))


@contextmanager
def _intra_op_threads(count: int) -> Iterator[None]:
    """Run with `count` torch threads. On a shared CPU, intra-op threads that wait for a preempted sibling turn a
    1 ms step into tens of ms at random; one thread keeps the step time stable enough to compare loaders."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(cfg: Config) -> dict:
    if cfg.device == "cuda":
        return _run(cfg)
    with _intra_op_threads(1):
        return _run(cfg)


def _run(cfg: Config) -> dict:
    m = cfg.model
    dataset = FeatureDataset((m.steps + 1) * m.batch_size, m.features)  # one pass = the steps, workers end cleanly
    cuda = cfg.device == "cuda"
    kwargs = dict(batch_size=m.batch_size, shuffle=True, num_workers=m.num_workers, pin_memory=cuda)
    trainer = Trainer(cfg)
    on_device = [tuple(t.to(cfg.device) for t in batch) for batch in TORCH.make(dataset, batch_size=m.batch_size)]
    candidates = {RESIDENT: partial(trainer.seconds_per_step, on_device)}
    candidates.update({c.name: partial(_with_loader, trainer, c, dataset, **kwargs) for c in CANDIDATES})
    if cuda:  # pinned memory on (above) and off: what the copy to the device costs each loader
        unpinned = {**kwargs, "pin_memory": False}
        candidates.update(
            {
                f"{c.name}, {UNPINNED}": partial(_with_loader, trainer, c, dataset, **unpinned)
                for c in (TORCH, OURS_CHECKPOINTING)
            }
        )
    result = compare(candidates, RESIDENT, cfg.reps, cfg.warmup, "training", "s/step")
    rows = [
        row(f"{name} step / limit", ratio, "ratio", TARGET if cuda and name == OURS_CHECKPOINTING.name else None)
        for name, ratio in result["ratios"].items()
    ]
    ours_vs_torch = ratio_of(result, OURS_CHECKPOINTING.name, TORCH.name)
    rows.append(row(f"{OURS_CHECKPOINTING.name} step / DataLoader step", ours_vs_torch, "ratio", TARGET))
    rows.append(row(f"{OURS_CHECKPOINTING.name} step time", result["values"][OURS_CHECKPOINTING.name], "ms", scale=1e3))
    return {"model": vars(m), "device": cfg.device, **kwargs, **result, "rows": rows}
