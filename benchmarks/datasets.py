"""Synthetic datasets whose per-sample cost is known, so loaders are compared on loading alone."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def busy_wait(microseconds: float) -> None:
    """Spin for the given time: a per-sample cost (decode, augment) that is the same on every machine and run."""
    deadline = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < deadline:
        pass


class FeatureDataset(Dataset):
    """(features, label) pairs from a resident tensor, plus an optional busy wait per sample."""

    def __init__(self, num_samples: int, features: int, classes: int = 10, busy_us: float = 0.0, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, features, generator=generator)
        self.y = torch.randint(0, classes, (num_samples,), generator=generator)
        self.busy_us = busy_us

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.busy_us:
            busy_wait(self.busy_us)
        return self.x[index], self.y[index]


class IndexDataset(Dataset):
    """A dataset of any length (1e9 included) whose sample is its index: loading costs nothing, the order is all."""

    def __init__(self, num_samples: int):
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        return int(index)


class FeatureStream(IterableDataset):
    """FeatureDataset's rows as a stream: each worker reads every N-th row, through an iterator that saves its
    position (StatefulDataLoader's protocol), so a loader that checkpoints a stream has a state to take."""

    def __init__(self, num_samples: int, features: int, busy_us: float = 0.0):
        self.rows = FeatureDataset(num_samples, features, busy_us=busy_us)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> _Rows:
        info = get_worker_info()
        return _Rows(self.rows, *((info.id, info.num_workers) if info else (0, 1)))


class _Rows:
    def __init__(self, rows: FeatureDataset, worker: int, workers: int):
        self.rows, self.indices, self.i = rows, range(worker, len(rows), workers), 0

    def __iter__(self) -> _Rows:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.i >= len(self.indices):
            raise StopIteration
        self.i += 1
        return self.rows[self.indices[self.i - 1]]

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]
