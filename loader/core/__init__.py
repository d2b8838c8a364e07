"""The core: input progress as pure arithmetic in position space, and the sampler that is its stateful shell.

An epoch's order maps position -> dataset index (`order`); progress is the committed positions as intervals
(`progress`); a layout deals an epoch's remaining positions to ranks, micro-batches and updates (`partition`); a
rank's state and the merge of all ranks' states (`state`); the resumable sampler (`sampler`); the
data-parallel coordinates a loader partitions over under a device mesh (`mesh`). Nothing here imports
from the rest of the package.
"""
