"""`python -m loader demo`: train, lose a worker mid-step, resume at another world size, count every sample.

Single process: the data-parallel ranks are simulated by one ResumableDataLoader per rank, and their gradients
are averaged as DDP would. The global batch stays 48 (4 ranks x 3 micro-steps x 4, then 3 ranks x 4 x 4), so the
resumed run takes the very same optimizer steps as an uninterrupted one. For contrast, the same restart done the
usual way (DistributedSampler at the new world size, skipping the batches each rank had consumed) is counted too.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils.data import Dataset, DistributedSampler

from loader import ResumableDataLoader, merge_states

SAMPLES, FEATURES, MICRO_BATCH, GLOBAL_BATCH, SEED = 1008, 8, 4, 48, 0  # 21 global batches


class Regression(Dataset):
    """y = x . w + noise, each sample generated from its index, so any rank can load any sample."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        x = torch.randn(FEATURES, generator=g)
        return x, x.sum() * 0.5 + 0.1 * torch.randn((), generator=g), index


class Job:
    """Model, optimizer and one loader per simulated rank: the coherent state of a data-parallel job."""

    def __init__(self, world_size: int):
        torch.manual_seed(SEED)
        self.model = torch.nn.Linear(FEATURES, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        accum = GLOBAL_BATCH // (world_size * MICRO_BATCH)
        self.loaders = [
            ResumableDataLoader(Regression(), batch_size=MICRO_BATCH, shuffle=True, seed=SEED, rank=r,
                                world_size=world_size, grad_accum=accum)
            for r in range(world_size)
        ]
        self.iterators = [iter(dl) for dl in self.loaders]
        self.accum = accum

    def step(self, seen: Counter) -> bool:
        """One optimizer update over all ranks; False when the epoch is over."""
        self.optimizer.zero_grad()
        ids = []
        for _ in range(self.accum):
            for it in self.iterators:
                try:
                    x, y, index = next(it)
                except StopIteration:
                    return False
                loss = torch.nn.functional.mse_loss(self.model(x).squeeze(1), y, reduction="sum") / GLOBAL_BATCH
                loss.backward()
                ids += index.tolist()
                if all(dl.update_complete for dl in self.loaders):
                    break
        self.optimizer.step()
        seen.update(ids)
        return True

    def checkpoint(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "loader": merge_states([dl.state_dict() for dl in self.loaders]),
        }

    def restore(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        for dl in self.loaders:
            dl.load_state_dict(ckpt["loader"])
        self.iterators = [iter(dl) for dl in self.loaders]


def _report(name: str, seen: Counter, dropped: int) -> tuple[int, int]:
    once = sum(1 for c in seen.values() if c == 1)
    duplicated = sum(1 for c in seen.values() if c > 1)
    skipped = SAMPLES - len(seen) - dropped
    print(f"  {name:<34} seen once {once:5d}   skipped {skipped:4d}   duplicated {duplicated:4d}   dropped by policy {dropped}")
    return skipped, duplicated


def _dropped(job: Job) -> int:
    """Samples the partition dropped by policy in the finished epoch, as the merged progress records them."""
    (record,) = merge_states([dl.state_dict() for dl in job.loaders])["finished"]
    return sum(stop - start for start, stop in zip(record["dropped"][::2], record["dropped"][1::2]))


def naive_restart(steps_done: int, old_world: int, new_world: int) -> Counter:
    """DistributedSampler at the new world size, each rank skipping what one rank consumed before the failure."""
    seen = Counter()
    per_rank_before = steps_done * GLOBAL_BATCH // old_world
    for r in range(old_world):
        sampler = DistributedSampler(Regression(), num_replicas=old_world, rank=r, shuffle=True, seed=SEED)
        seen.update(list(sampler)[:per_rank_before])
    for r in range(new_world):
        sampler = DistributedSampler(Regression(), num_replicas=new_world, rank=r, shuffle=True, seed=SEED)
        seen.update(list(sampler)[per_rank_before:])
    return seen


def main(fail_at_step: int = 9, old_world: int = 4, new_world: int = 3) -> int:
    for world in (old_world, new_world):
        if world <= 0 or GLOBAL_BATCH % (world * MICRO_BATCH):
            raise SystemExit(f"demo: world size {world} cannot keep the global batch {GLOBAL_BATCH} with micro-batch "
                             f"{MICRO_BATCH}; use one of 1, 2, 3, 4, 6, 12")
    if not 0 < fail_at_step < SAMPLES // GLOBAL_BATCH:
        raise SystemExit(f"demo: --fail-at-step must be in [1, {SAMPLES // GLOBAL_BATCH - 1}], got {fail_at_step}")
    print(f"demo: {SAMPLES} samples, global batch {GLOBAL_BATCH}, {old_world} ranks; one dies during step "
          f"{fail_at_step + 1}; the job resumes with {new_world} ranks")
    reference, reference_seen = Job(old_world), Counter()
    while reference.step(reference_seen):
        pass

    job, seen = Job(old_world), Counter()
    for step in range(fail_at_step):
        job.step(seen)
        print(f"\r  training at {old_world} ranks: step {step + 1}", end="", flush=True)
    ckpt = job.checkpoint()  # committed together with the model after step `fail_at_step`
    for it in job.iterators[:2]:  # mid-step: some ranks already fetched their next micro-batch, then one dies
        next(it)
    print(f"\n  rank {old_world - 1} killed mid-step {fail_at_step + 1}; restarting at {new_world} ranks "
          f"from the checkpoint of step {fail_at_step}")

    job = Job(new_world)
    job.restore(ckpt)
    steps = fail_at_step
    while job.step(seen):
        steps += 1
        print(f"\r  training at {new_world} ranks: step {steps}", end="", flush=True)
    print("\n\nafter one epoch:")
    skipped, duplicated = _report(f"loader (resumed {old_world} -> {new_world} ranks)", seen, _dropped(job))
    _report("uninterrupted reference", reference_seen, _dropped(reference))
    _report("DistributedSampler restart", naive_restart(fail_at_step, old_world, new_world), 0)
    drift = max((a - b).abs().max().item() for a, b in zip(job.model.parameters(), reference.model.parameters()))
    print(f"\nmax parameter difference to the uninterrupted run: {drift:.2e}")
    ok = skipped == 0 and duplicated == 0 and seen == reference_seen and drift < 1e-5
    print("exactly once: yes" if ok else "exactly once: NO")
    return 0 if ok else 1
