"""OLMo-core's data loader (`ai2-olmo-core`): `NumpyFSLDataLoader` over a `NumpyFSLDataset` of fixed-length
instances, with its `dp_rank` / `dp_world_size`, on CPU.

Its state is a count of tokens (`tokens_processed`): on load, the batches to skip are `tokens_processed // the global
batch in tokens`, and each global batch of the shuffled instance order is sliced `dp_rank::dp_world_size`. The order
is cut to a whole number of global batches, so the epoch's last partial global batch (N mod the global batch) is
never served. Under data parallelism rank 0's `state_dict()` is saved and every rank loads it (the count is the same
on every rank in lockstep). Instance i is SEQ_LEN tokens of value i, so an instance is counted by its own tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from olmo_core.data import DataCollator, NumpyDataLoaderBase, NumpyFSLDataset

from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import SEED

SEQ_LEN = 2
MAX_SAMPLES = 10**7  # its token file and its global order file, 120 MB together at 1e7
logging.getLogger("olmo_core").setLevel(logging.WARNING)  # a line per load_state_dict


def _loader(data: Path, n: int, world: int, rank: int, global_batch: int) -> NumpyDataLoaderBase:
    dataset = NumpyFSLDataset(
        str(data / "tokens.npy"),
        sequence_length=SEQ_LEN,
        pad_token_id=n,
        eos_token_id=n + 1,
        vocab_size=n + 2,
        dtype=np.uint32,
    )
    loader = NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset,
        global_batch_size=global_batch * SEQ_LEN,
        collator=DataCollator(pad_token_id=n),
        work_dir=data / "work",
        seed=SEED,
        dp_world_size=world,
        dp_rank=rank,
    )
    loader.reshuffle(epoch=1)  # "before starting the epoch, regardless of whether or not you've called load_state_dict"
    return loader


def _ids(batch: dict) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


class Olmo(InProcess):
    saves = "rank 0's state_dict() (tokens processed); every rank loads it"

    def prepare(self, n: int, data: Path, kind: str = "index") -> None:
        """Instance i is SEQ_LEN tokens of value i, in one uint32 token file (an LM loader: no image samples)."""
        if kind != "index":
            raise ValueError(f"{kind} samples are not measured: OLMo-core's loader serves token instances")
        if n > MAX_SAMPLES:
            raise ValueError(f"N={n:,} is not measured: its token and order files beyond N={MAX_SAMPLES:,}")
        data.mkdir(parents=True)
        np.repeat(np.arange(n, dtype=np.uint32), SEQ_LEN).tofile(data / "tokens.npy")

    def rank_phase(self, phase: Phase, rank: int, saved: dict | None) -> tuple[list[int], dict]:
        loader = _loader(phase.data, phase.n, phase.world, rank, phase.batch * phase.world)
        if saved is not None:
            loader.load_state_dict(saved)
        return [i for b in deliver(loader, phase.steps[rank]) for i in _ids(b)], loader.state_dict()

    def save(self, states: list, phase: Phase) -> dict:
        return states[0]

    def state_at(self, n, data, batch: int, position: int) -> dict:
        loader = _loader(data, n, 1, 0, batch)
        next(iter(loader))
        return {**loader.state_dict(), "tokens_processed": position * SEQ_LEN, "batches_processed": position // batch}

    def first_batch(self, n, data, batch: int, state: dict):
        loader = _loader(data, n, 1, 0, batch)
        loader.load_state_dict(state)
        return next(iter(loader))

    def loader(self, n, data, batch: int, workers: int, kind: str):
        return ({"i": b["input_ids"][:, 0]} for b in _loader(data, n, 1, 0, batch))


PEER = Olmo()
