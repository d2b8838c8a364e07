"""torchtitan's own Trainer with this loader: a config registry for `torchtitan.train` (torchtitan 0.3), its llama3
debug model trained on pre-tokenized token files, checkpointed by torchtitan's CheckpointManager, which saves the
loader's progress under its `dataloader` key. Run from the repository root, e.g. at 2 data-parallel ranks:

    torchrun --nproc_per_node 2 -m torchtitan.train --module examples.torchtitan_loader \
        --config llama3_debugmodel_loader --dump_folder /tmp/run --hf_assets_path ./tokenizer \
        --dataloader.dataset_path 'data/*.bin' --dataloader.ledger_dir /tmp/run --training.global_batch_size 16
    # killed, or finished its steps: relaunch at any --nproc_per_node (--training.steps more), it resumes from the
    # newest checkpoint in /tmp/run/checkpoint; then `python -m loader audit /tmp/run` counts every window trained

torchtitan's own loader would refuse that relaunch at another data-parallel degree ("dp_degree is inconsistent before
and after checkpoint, dataloader resharding is not supported yet."). Keep `training.global_batch_size` fixed across
relaunches (torchtitan's default, -1, is local_batch_size times the data-parallel degree, which a resize changes);
torchtitan then changes its gradient accumulation, and each optimizer step trains the same number of windows. The
trainer still loads a tokenizer from `hf_assets_path` (the token files need none): a directory with torchtitan's or
any Hugging Face tokenizer.json, or a vocab.json. `pip install torchtitan==0.3.0` (see docs/frameworks.md).
"""

from __future__ import annotations

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from loader.integrations.torchtitan import ResumableTitanLoader


def llama3_debugmodel_loader() -> Trainer.Config:
    """torchtitan's llama3 debug model (its vocabulary: 2048 ids) on token files, checkpointed every 10 steps with
    everything a resume needs (the model, optimizer, scheduler, trainer step and the loader's progress)."""
    config = llama3_debugmodel()
    config.dataloader = ResumableTitanLoader.Config(dtype="uint16", vocab_size=2048, seed=0)
    config.checkpoint.enable = True
    config.checkpoint.interval = 10
    config.checkpoint.last_save_model_only = False  # the last step's checkpoint resumes too
    config.validator.enable = False  # its validator reads torchtitan's own datasets
    return config
