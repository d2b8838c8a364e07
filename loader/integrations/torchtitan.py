"""The loader as torchtitan's dataloader: `ResumableTitanLoader.Config` in a torchtitan `Trainer.Config`.

Why: torchtitan's own loaders save one state per data-parallel rank and refuse a checkpoint of another
data-parallel degree ("dp_degree is inconsistent before and after checkpoint, dataloader resharding is not supported
yet."). Here torchtitan's `CheckpointManager` saves, under its `dataloader` key, the merged progress of all ranks
(`LoaderState`: replicated keys), which loads at any degree: every sample once.

The trainer builds the loader with its data-parallel coordinates (the "batch" mesh's rank and size), so tensor,
pipeline and context parallel peers of one data-parallel rank deliver the same batches. Each micro-batch the trainer
draws counts as one update of the loader (grad_accum 1): by the time torchtitan saves, it trained every micro-batch
it drew, whatever its gradient accumulation, so the state saved is all that was delivered. The ledger, when asked
for, labels its records with the same count of micro-batches, which the state carries (`step`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from loader.checkpoint.ledger import Ledger
from loader.core.checks import is_int
from loader.core.collectives import rank, world_size
from loader.core.state import StateError
from loader.dataloader import ResumableDataLoader
from loader.integrations.dcp import LoaderState
from loader.sources.tokens import TokenSource


class ResumableTitanLoader(BaseDataLoader):
    """Pre-tokenized token files (`TokenSource`) as torchtitan's ({"input": x}, labels) batches of
    `local_batch_size` windows of `seq_len`, epoch after epoch (the trainer's `training.steps` ends training),
    resumable at any data-parallel degree."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dtype: str = "uint16"
        """Token dtype of raw files ("uint16", "uint32", "int32"); .npy files and LitData chunks carry their own."""

        vocab_size: int | None = None
        """Token ids must be below it: each batch is checked (e.g. the model's vocabulary size)."""

        shuffle: bool = True
        """A new permutation of the windows every epoch (a pure function of seed and epoch)."""

        seed: int = 0

        num_workers: int = 0

        ledger_dir: str | None = None
        """Record every trained window in this run directory's ledger: `python -m loader audit DIR` counts them."""

    def __init__(
        self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int, **unused: Any
    ) -> None:
        """`unused`: what the trainer passes for its own loaders (the tokenizer: the files are tokenized already;
        snapshot_every_n_steps: Grain's)."""
        if not config.dataset_path:
            raise ValueError(
                "ResumableTitanLoader.Config.dataset_path must name the token files (a glob, a file or a "
                "LitData directory): --dataloader.dataset_path 'data/*.bin'"
            )
        source = TokenSource(config.dataset_path, seq_len, config.dtype, vocab_size=config.vocab_size)
        self.loader: ResumableDataLoader[Any] = ResumableDataLoader(
            source,
            batch_size=local_batch_size,
            shuffle=config.shuffle,
            seed=config.seed,
            rank=dp_rank,
            world_size=dp_world_size,
            drop_last=True,
            num_workers=config.num_workers,
        )
        if len(self.loader) == 0:
            raise ValueError(
                f"{config.dataset_path}: {len(source)} windows of seq_len {seq_len} fill no batch of "
                f"{local_batch_size} on each of {dp_world_size} data-parallel ranks: more tokens, or a "
                f"smaller training.local_batch_size or training.seq_len"
            )
        if config.ledger_dir is not None and (world_size(), rank()) != (dp_world_size, dp_rank):
            raise ValueError(
                f"ledger_dir: the ledger needs one writer per data-parallel rank, which this glue knows "
                f"only when every rank is one (rank {rank()} of {world_size()} is data-parallel rank "
                f"{dp_rank} of {dp_world_size}); record it without tensor, pipeline or context "
                f"parallelism"
            )
        self.config = config

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        loader = self.loader
        if self.config.ledger_dir is not None and loader.ledger is None:  # first iter(): after the checkpoint loaded
            assert loader.step is not None, "load_state_dict sets the step with the state"
            assert isinstance(loader.dataset, TokenSource), "the source __init__ built"
            loader.ledger = Ledger.open(self.config.ledger_dir, loader.step, len(loader.dataset))
        while True:
            for tokens in loader:  # the rest of the epoch
                inputs = tokens[:, :-1]
                positions = torch.arange(inputs.shape[1]).expand_as(inputs)  # a window is one document
                yield {"input": inputs, "positions": positions}, tokens[:, 1:]
            loader.set_epoch(loader.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """A collective (every rank): the merged progress of all data-parallel ranks, and the micro-batches drawn."""
        return {**LoaderState(self.loader).state_dict(), "step": self.loader.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step = state_dict["step"]
        if not is_int(step) or step < 0:
            raise StateError(
                f"the DCP checkpoint loaded into ResumableTitanLoader: field 'step' must be the "
                f"micro-batches drawn (an int >= 0), got {step!r}"
            )
        LoaderState(self.loader).load_state_dict(state_dict)
        self.loader.step = step
