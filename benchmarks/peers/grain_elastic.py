"""Grain's `grain.experimental.ElasticIterator` over a shuffled `MapDataset`, sharded by ShardOptions(rank, W).

Its state is one integer, the next global index (`global_next_index`), the same on every rank that advanced the same
number of steps: any rank's state restores every rank at any world size and any global batch, as long as the global
batch divides by W. Each rank takes every W-th sample of the rest and batches it with `drop_remainder=True`: the
epoch's last partial global batch (N mod the global batch) is never served. Under data parallelism rank 0's
`get_state()` is saved and every rank restores it.

The capability cases (`benchmarks.peers.capabilities`) give it, under the same script, `MapDataset.filter` (the
same predicate as ours), a `FirstFitPackIterDataset` of the documents (its packer, an IterDataset) and
`MapDataset.mix` of two sources: what it does with each is measured, its refusal included.
"""

from __future__ import annotations

import grain.python as grain
from grain.experimental import ElasticIterator, FirstFitPackIterDataset

from benchmarks.features import keep
from benchmarks.peers.grain_index import _Decode, _Jpegs
from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import MIXTURE, SEED, SEQ_LEN, documents, ids, mixture_sources, write_documents


def _dataset(n: int, kind: str = "index") -> grain.MapDataset:
    if kind == "index":
        return grain.MapDataset.range(n).shuffle(seed=SEED)
    return grain.MapDataset.source(_Jpegs(n)).shuffle(seed=SEED).map(_Decode())


def _iterator(ds: grain.MapDataset, world: int, rank: int, global_batch: int, workers: int = 0):
    mp = grain.MultiprocessingOptions(num_workers=workers) if workers else None
    return iter(
        ElasticIterator(
            ds, global_batch, grain.ShardOptions(shard_index=rank, shard_count=world), multiprocessing_options=mp
        )
    )


class GrainElastic(InProcess):
    saves = "rank 0's get_state() (one integer: the next global index); every rank restores it"

    def dataset(self, phase: Phase):
        return _dataset(phase.n)

    def delivered(self, batch) -> list[int]:
        return ids(batch)

    def rank_phase(self, phase: Phase, rank: int, saved: dict | None) -> tuple[list[int], dict]:
        iterator = _iterator(self.dataset(phase), phase.world, rank, phase.batch * phase.world)
        if saved is not None:
            iterator.set_state(saved)
        return [i for b in deliver(iterator, phase.steps[rank]) for i in self.delivered(b)], iterator.get_state()

    def save(self, states: list, phase: Phase) -> dict:
        return states[0]

    def state_at(self, n, data, batch: int, position: int) -> dict:
        return {"global_next_index": position}

    def first_batch(self, n, data, batch: int, state: dict):
        iterator = _iterator(_dataset(n), 1, 0, batch)
        iterator.set_state(state)
        return next(iterator)

    def loader(self, n, data, batch: int, workers: int, kind: str):
        return _iterator(_dataset(n, kind), 1, 0, batch, workers)


class GrainFilter(GrainElastic):
    def dataset(self, phase: Phase):
        return _dataset(phase.n).filter(lambda i: keep(i, i))


class GrainPacked(GrainElastic):
    """Its first-fit packer over the shuffled documents, rows of SEQ_LEN + 1 tokens; a row's ids are its tokens
    whose segment id is not 0 (padding)."""

    def prepare(self, n: int, data, kind: str = "index") -> None:
        write_documents(n, data)

    def dataset(self, phase: Phase):
        docs = grain.MapDataset.source(documents(phase.data)).shuffle(seed=SEED).map(lambda d: {"tokens": d})
        return FirstFitPackIterDataset(
            docs.to_iter_dataset(), length_struct={"tokens": SEQ_LEN + 1}, num_packing_bins=64
        )

    def delivered(self, batch) -> list[int]:
        return (batch["tokens"][batch["tokens_segment_ids"] > 0] - 1).tolist()


class GrainMixture(GrainElastic):
    """`MapDataset.mix` of two sources by `samples.MIXTURE`, shuffled: every sample once."""

    def dataset(self, phase: Phase):
        sources = [grain.MapDataset.range(ids_.start, ids_.stop) for ids_ in mixture_sources(phase.n)]
        return grain.MapDataset.mix(sources, list(MIXTURE.values())).shuffle(seed=SEED)


PEER, FILTER, PACKED, MIXED = GrainElastic(), GrainFilter(), GrainPacked(), GrainMixture()
