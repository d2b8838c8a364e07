"""loader: a recovery-aware data loader for PyTorch.

Input progress is committed with the model's state, kept as exact intervals of each epoch's keyed order, and
repartitioned deterministically at any world size, so a restart neither skips nor repeats a sample.
"""

from loader.dataloader import ContinuedPassWarning, ResumableDataLoader, SampleIndex
from loader.order import Order, sample_seed
from loader.partition import EpochPlan, Layout
from loader.sampler import ResumableSampler
from loader.shards import ShardedStream
from loader.state import StateError, merge_states

__all__ = [
    "ContinuedPassWarning",
    "EpochPlan",
    "Layout",
    "Order",
    "ResumableDataLoader",
    "ResumableSampler",
    "SampleIndex",
    "ShardedStream",
    "StateError",
    "merge_states",
    "sample_seed",
]
