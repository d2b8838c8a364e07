"""loader: a recovery-aware data loader for PyTorch.

Input progress is committed with the model's state, kept as exact intervals of each epoch's keyed order, and
repartitioned deterministically at any world size, so a restart neither skips nor repeats a sample.

The packages, each importing only those above it in this list:
- `loader.core`: the position-space arithmetic (order, partition, progress, state) and the resumable sampler;
- `loader.streams`: IterableDataset progress (shard deals, worker snapshots, random states);
- `loader.checkpoint`: merging rank states, the lockstep check, atomic publication, save/resume, ledger and audit;
- `loader.metrics`: what the loader did per step (the data wait, samples, failures) and the stall warning;
- `loader.dataloader`: `ResumableDataLoader`, the drop-in DataLoader over all of the above;
- `loader.sources`: datasets (WebDataset shards local or remote, token files, mixtures), leaves over `core`;
- `loader.integrations`: framework glue (Lightning, DCP), and `loader.cli`: the command line (demo, audit, index).
"""

__version__ = "0.1.0"  # the release; pyproject.toml reads it from here (CHANGELOG.md says what each one changed)

from loader.checkpoint.merge import merge_states
from loader.core.order import Order, sample_seed
from loader.core.partition import EpochPlan, Layout
from loader.core.rows import Rows
from loader.core.sampler import AbandonedEpochWarning, ResumableSampler
from loader.core.state import StateError
from loader.dataloader import ContinuedPassWarning, ResumableDataLoader, SampleIndex, WorkerInitError
from loader.metrics import DataStallWarning, MetricsWarning
from loader.streams.shards import ShardedStream

__all__ = [
    "__version__",
    "AbandonedEpochWarning",
    "ContinuedPassWarning",
    "DataStallWarning",
    "EpochPlan",
    "Layout",
    "MetricsWarning",
    "Order",
    "ResumableDataLoader",
    "ResumableSampler",
    "Rows",
    "SampleIndex",
    "ShardedStream",
    "StateError",
    "WorkerInitError",
    "merge_states",
    "sample_seed",
]
