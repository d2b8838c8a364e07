"""The data-parallel coordinates a loader partitions over: (dp rank, dp world size) of a DeviceMesh or a process
group, else those given as rank= and world_size=, else the world's.

Why: under tensor, context, pipeline or expert parallelism several processes train on one batch. Everything that
decides a batch (order, partition, sample seeds, worker seeds, shard deals) is a function of (seed, epoch,
position, dp rank, worker), never of the global rank, so the peers of one data-parallel coordinate compute the same
batches without communicating, and progress is one record per dp rank (see `loader.checkpoint.merge`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from loader.core.collectives import distributed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def flat_rank(coordinate: Sequence[int], shape: Sequence[int]) -> int:
    """A coordinate of a mesh as one rank, in the mesh's order (the last dimension fastest). For a mesh made by
    `init_device_mesh` this is the rank `_flatten()` and `get_local_rank()` give, torchtitan's dp rank under HSDP
    (`["dp_replicate", "dp_shard"]`); for any layout it is the same on the peers of one coordinate, which the ranks
    of their groups (numbered in global rank order) need not be."""
    rank = 0
    for position, size in zip(coordinate, shape):
        rank = rank * size + position
    return rank


def _of_mesh(mesh: DeviceMesh) -> tuple[int, int]:
    if not callable(getattr(mesh, "get_coordinate", None)):
        raise TypeError(
            f"dp_mesh must be a torch.distributed DeviceMesh (e.g. world_mesh['dp'], or "
            f"world_mesh['dp_replicate', 'dp_shard']), got {type(mesh).__name__}; pass a ProcessGroup "
            f"as dp_group="
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not in dp_mesh {mesh}: pass each process "
            f"the data-parallel submesh of the world mesh it belongs to (world_mesh['dp'])"
        )
    shape = tuple(mesh.mesh.shape)
    return flat_rank(coordinate, shape), math.prod(shape)


def _of_group(group: dist.ProcessGroup) -> tuple[int, int]:
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of dp_group: pass each "
            f"process the data-parallel group it belongs to"
        )
    return rank, dist.get_world_size(group)


def data_parallel(
    rank: int | None,
    world_size: int | None,
    dp_mesh: DeviceMesh | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple:
    """(rank, world_size) to partition over: the data-parallel coordinates of `dp_mesh` (1-D, or several
    dimensions flattened in the mesh's order) or of `dp_group`; else `rank` and `world_size` as given (None: the
    world's, read by the loader when iteration starts)."""
    if dp_mesh is None and dp_group is None:
        return rank, world_size
    given = [
        name
        for name, value in (("rank", rank), ("world_size", world_size), ("dp_mesh", dp_mesh), ("dp_group", dp_group))
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"{' and '.join(given)} were given: name the data-parallel coordinates one way, dp_mesh= (a "
            f"DeviceMesh), dp_group= (a ProcessGroup), or rank= and world_size="
        )
    if not distributed():
        raise ValueError(
            f"{given[0]}= needs torch.distributed initialised: build the loader after init_process_group and the mesh"
        )
    if dp_mesh is not None:
        return _of_mesh(dp_mesh)
    assert dp_group is not None, "one of dp_mesh, dp_group is given (returned above otherwise)"
    return _of_group(dp_group)
