"""Throughput of every system at one rank, as a ratio to the plain DataLoader (shuffle=True): a nearly free sample
(its index) and a JPEG decoded per sample, at each number of workers; the systems interleaved in each case.

Each candidate reads a number of samples that makes one of its passes last about `run_s` (calibrated from a short
pass): the slowest systems here are 100x slower than DataLoader on an index, and one N for all would make either
theirs minutes long or DataLoader's too short to time. A rate does not depend on N once start-up is left out.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

from torch.utils.data import DataLoader

from benchmarks.peers.config import PeersConfig
from benchmarks.peers.phase import Peer
from benchmarks.peers.samples import KINDS, dataset
from benchmarks.peers.store import Store, why_not
from benchmarks.throughput import timed_pass
from benchmarks.timing import compare

BASELINE = "DataLoader"


def _rate(make: Callable[[int], Iterable], n: int, workers: int, name: str) -> float:
    return timed_pass(iter(make(n)), workers, name)


def _calibrated(make: Callable[[int], Iterable], workers: int, name: str, pc: PeersConfig, probe: int) -> int:
    return max(probe, int(_rate(make, probe, workers, name) * pc.run_s))


def _shards(key: str, peer: Peer, store: Store, kind: str, workers: int, pc: PeersConfig) -> Callable[[int], Iterable]:
    return lambda n: peer.loader(n, store.data(key, peer, n, kind), pc.batch, workers, kind)


def _case(pc: PeersConfig, peers: dict[str, Peer], store: Store, kind: str, workers: int) -> dict:
    probe = pc.batch * 16 * max(1, workers)
    makers = {BASELINE: lambda n: DataLoader(dataset(kind, n), batch_size=pc.batch, shuffle=True,
                                             num_workers=workers)}
    makers.update({key: _shards(key, peer, store, kind, workers, pc) for key, peer in peers.items()})
    candidates, sizes, errors = {}, {}, {}
    for name, make in makers.items():
        try:
            sizes[name] = _calibrated(make, workers, name, pc, probe)
            candidates[name] = partial(_rate, make, sizes[name], workers, name)
            candidates[name]()  # writes its shards at that size, outside the timed rounds
        except Exception as err:  # reported, not raised: the other systems go on
            errors[name] = why_not(err)
            candidates.pop(name, None)
    label = f"{kind}, workers={workers}"
    result = compare(candidates, BASELINE, pc.reps, pc.warmup, f"peers throughput {label}", "samples/s")
    return {"label": label, "kind": kind, "num_workers": workers, "sizes": sizes, "errors": errors, **result}


def run(pc: PeersConfig, peers: dict[str, Peer], store: Store) -> list[dict]:
    return [_case(pc, peers, store, kind, workers) for kind in KINDS for workers in pc.workers]
