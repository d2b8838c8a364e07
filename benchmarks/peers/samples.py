"""The samples every system serves: an index (an item is its index, so deliveries can be counted by identity,
and loading costs next to nothing) or a small JPEG decoded per sample (a real per-sample cost)."""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks.datasets import IndexDataset

SEED = 0  # every system's shuffle seed
KINDS = ("index", "jpeg")
JPEG_SIDE = 64  # a 64x64 RGB JPEG: a few KB, a decode of ~100 us
MIXTURE = {"web": 0.6, "code": 0.4}  # the mixture cases' sources and weights: source s holds its weight's share
SEQ_LEN = 32  # the packing cases' rows: SEQ_LEN + 1 tokens


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


def mixture_sources(n: int) -> list[range]:
    """The ids of each source of the mixture cases: n samples split by the weights, so that a mixture of n
    positions draws every sample once."""
    bounds = np.cumsum([0] + [round(n * w) for w in MIXTURE.values()])
    bounds[-1] = n
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def write_documents(tokens: int, data: Path) -> None:
    """The packing cases' documents: `tokens` tokens whose value is their stream position + 1 (so every token is
    counted by identity, and none is 0, the padding), one uint32 file, its document starts in a .npy beside it
    (lengths 1-3 x SEQ_LEN, seeded: some longer than a row)."""
    lengths = np.random.default_rng(SEED).integers(1, 3 * SEQ_LEN, tokens // SEQ_LEN + 1)
    starts = np.concatenate(([0], np.cumsum(lengths)))
    data.mkdir(parents=True)
    np.arange(1, tokens + 1, dtype=np.uint32).tofile(data / "tokens.bin")
    np.save(data / "starts.npy", starts[starts < tokens])


def documents(data: Path) -> list[np.ndarray]:
    """The documents `write_documents` wrote, in stream order."""
    tokens = np.fromfile(data / "tokens.bin", dtype=np.uint32).astype(np.int64)
    return np.split(tokens, np.load(data / "starts.npy")[1:])
