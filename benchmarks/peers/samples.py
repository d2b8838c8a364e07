"""The samples every system serves: an index (an item is its index, so deliveries can be counted by identity,
and loading costs next to nothing) or a small JPEG decoded per sample (a real per-sample cost)."""

from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks.datasets import IndexDataset

SEED = 0  # every system's shuffle seed
KINDS = ("index", "jpeg")
JPEG_SIDE = 64  # a 64x64 RGB JPEG: a few KB, a decode of ~100 us


def ids(batch: Any) -> list[int]:
    """The sample ids of a collated batch: a tensor or array of ints, or a dict with them under "i"."""
    if isinstance(batch, dict):
        batch = batch["i"]
    return np.asarray(batch).reshape(-1).astype(np.int64).tolist()


@functools.cache
def jpeg_bytes() -> bytes:
    """One seeded JPEG, the same for every sample: the decode, not the storage, is the cost measured."""
    from PIL import Image

    rng = np.random.default_rng(SEED)
    ramp = np.linspace(0, 255, JPEG_SIDE, dtype=np.float32)
    pixels = np.stack(
        [
            ramp[None, :] + 0 * ramp[:, None],
            ramp[:, None] + 0 * ramp[None, :],
            rng.uniform(0, 255, (JPEG_SIDE, JPEG_SIDE)),
        ],
        axis=-1,
    )
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def decode(data: bytes) -> torch.Tensor:
    """A JPEG to an HxWx3 uint8 tensor (Pillow, as torchvision's ImageFolder loads images)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy())


class JpegDataset(Dataset):
    """n map-style samples, each decoded from JPEG bytes when loaded."""

    def __init__(self, num_samples: int):
        self.num_samples, self.data = num_samples, jpeg_bytes()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return decode(self.data)


def dataset(kind: str, n: int) -> Dataset:
    """The map-style dataset of a kind of sample."""
    return IndexDataset(n) if kind == "index" else JpegDataset(n)


def item(kind: str, i: int) -> Any:
    """What a shard stores for sample i: the index, or the JPEG bytes."""
    return i if kind == "index" else jpeg_bytes()
