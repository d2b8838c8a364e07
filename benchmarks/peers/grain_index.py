"""Grain's DataLoader over a random-access source with an IndexSampler sharded by ShardOptions.

Its checkpoint is the data iterator's state (get_state / set_state: the last index seen per worker and the
sampler's repr), one per rank: rank r restores rank r's; a rank that had no predecessor starts afresh.
"""

from __future__ import annotations

import json

import grain.python as grain

from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import SEED, decode, ids, jpeg_bytes


class _Jpegs:
    """n records of JPEG bytes (a random-access source), decoded by a map operation."""

    def __init__(self, n: int):
        self.n, self.data = n, jpeg_bytes()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> bytes:
        return self.data


class _Decode(grain.MapTransform):
    def map(self, element: bytes):
        return decode(element).numpy()


def _loader(n: int, world: int, rank: int, batch: int, num_workers: int = 0, kind: str = "index"):
    shard = grain.ShardOptions(shard_index=rank, shard_count=world, drop_remainder=False)
    sampler = grain.IndexSampler(n, shard_options=shard, shuffle=True, num_epochs=1, seed=SEED)
    source, ops = (grain.RangeDataSource(0, n, 1), []) if kind == "index" else (_Jpegs(n), [_Decode()])
    return grain.DataLoader(
        data_source=source, sampler=sampler, operations=ops + [grain.Batch(batch)], worker_count=num_workers
    )


class GrainIndex(InProcess):
    saves = "every rank its iterator's get_state(); rank r restores rank r's (a new rank starts afresh)"

    def rank_phase(self, phase: Phase, rank: int, saved: list | None) -> tuple[list[int], bytes]:
        iterator = iter(_loader(phase.n, phase.world, rank, phase.batch))
        if saved and rank < len(saved):
            iterator.set_state(saved[rank])
        return [i for b in deliver(iterator, phase.steps[rank]) for i in ids(b)], iterator.get_state()

    def save(self, states: list, phase: Phase) -> list:
        return states

    def state_at(self, n, data, batch: int, position: int) -> bytes:
        """A real state after one batch with its last seen index moved to `position` - 1."""
        iterator = iter(_loader(n, 1, 0, batch))
        next(iterator)
        state = json.loads(iterator.get_state())
        state["last_seen_indices"] = {"0": position - 1}
        return json.dumps(state).encode()

    def first_batch(self, n, data, batch: int, state: bytes):
        iterator = iter(_loader(n, 1, 0, batch))
        iterator.set_state(state)
        return next(iterator)

    def loader(self, n, data, batch: int, workers: int, kind: str):
        return _loader(n, 1, 0, batch, workers, kind)


PEER = GrainIndex()
