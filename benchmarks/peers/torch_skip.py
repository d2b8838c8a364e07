"""torch's DataLoader with a DistributedSampler, resumed the common way: skip the batches already trained.

Under data parallelism the loop saves rank 0's optimizer step (with the model, as Lightning and Accelerate do);
on resume every rank skips step x grad_accum micro-batches of its new loader at the batch-sampler level, without
loading them (as accelerate's skip_first_batches does).
"""

from __future__ import annotations

import itertools

from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import SEED, dataset, ids


class _Skip(Sampler):
    """A batch sampler without its first `skip` batches."""

    def __init__(self, batches: BatchSampler, skip: int):
        self.batches, self.skip = batches, skip

    def __iter__(self):
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.skip)


def _loader(data: Dataset, world: int, rank: int, batch: int, skip: int = 0, num_workers: int = 0) -> DataLoader:
    """Rank `rank`'s loader of epoch 0, its first `skip` batches skipped."""
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(0)
    batches = _Skip(BatchSampler(sampler, batch, drop_last=False), skip)
    return DataLoader(data, batch_sampler=batches, num_workers=num_workers)


class TorchSkip(InProcess):
    saves = "rank 0's optimizer step; on resume each rank skips step x grad_accum batches of its new loader"

    def rank_phase(self, phase: Phase, rank: int, saved: dict | None) -> tuple[list[int], dict]:
        step = saved["step"] if saved else 0
        dl = _loader(dataset("index", phase.n), phase.world, rank, phase.batch, step * phase.accum)
        delivered = [i for b in deliver(dl, phase.steps[rank]) for i in ids(b)]
        return delivered, {"epoch": 0, "step": step + len(delivered) // (phase.batch * phase.accum)}

    def save(self, states: list, phase: Phase) -> dict:
        return states[0]

    def state_at(self, n, data, batch: int, position: int) -> dict:
        return {"epoch": 0, "step": position // batch}

    def first_batch(self, n, data, batch: int, state: dict):
        return next(iter(_loader(dataset("index", n), 1, 0, batch, state["step"])))

    def loader(self, n, data, batch: int, workers: int, kind: str) -> DataLoader:
        return _loader(dataset(kind, n), 1, 0, batch, num_workers=workers)


PEER = TorchSkip()
