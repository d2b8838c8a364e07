"""Throughput of every system at one rank, as a ratio to the plain DataLoader (shuffle=True): a nearly free sample
(its index) and a JPEG decoded per sample, at each number of workers; the systems interleaved in each case. Each
pass gives samples per wall-clock second and per CPU second (this process and its workers): on a shared machine
the wall clock also measures the neighbours, the CPU time what the loader itself costs. The load average is
recorded before and after each case.

Every candidate reads the N that makes one DataLoader pass last about `run_s`, except one so slow that its pass
would last over SLOW x `run_s` (up to 100x slower than DataLoader on an index here): it reads the N that makes
its own pass last that long (from a short probe pass). A rate does not depend on N once start-up is left out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial

from torch.utils.data import DataLoader

from benchmarks.peers.config import PeersConfig
from benchmarks.peers.phase import Peer
from benchmarks.peers.samples import KINDS, dataset
from benchmarks.peers.store import Store, why_not
from benchmarks.throughput import RATES, oversubscribed, timed_pass
from benchmarks.timing import compare_each

BASELINE = "DataLoader"
SLOW = 4


def _rates(make: Callable[[int], Iterable], n: int, workers: int, name: str) -> dict[str, float]:
    return timed_pass(iter(make(n)), workers, name)


def _size(make: Callable[[int], Iterable], workers: int, name: str, run_s: float, probe: int, cap: int) -> int:
    """Samples for one pass of about `run_s` at the rate of a probe pass, at most `cap`."""
    return min(cap, max(probe, int(_rates(make, probe, workers, name)["wall"] * run_s)))


def _shards(key: str, peer: Peer, store: Store, kind: str, workers: int, pc: PeersConfig) -> Callable[[int], Iterable]:
    return lambda n: peer.loader(n, store.data(key, peer, n, kind), pc.batch, workers, kind)


def _case(
    pc: PeersConfig, peers: dict[str, Peer], store: Store, kind: str, workers: int, reps: int, warmup: int
) -> dict:
    probe = pc.batch * 16 * max(1, workers)
    makers = {BASELINE: lambda n: DataLoader(dataset(kind, n), batch_size=pc.batch, shuffle=True, num_workers=workers)}
    makers.update({key: _shards(key, peer, store, kind, workers, pc) for key, peer in peers.items()})
    candidates, sizes, errors = {}, {}, {}
    for name, make in makers.items():
        try:
            sizes[name] = (
                _size(make, workers, name, pc.run_s, probe, cap=2**62)
                if name == BASELINE
                else _size(make, workers, name, SLOW * pc.run_s, probe, cap=sizes[BASELINE])
            )
            candidates[name] = partial(_rates, make, sizes[name], workers, name)
            candidates[name]()  # writes its shards at that size, outside the timed rounds
        except Exception as err:  # reported, not raised: the other systems go on
            errors[name] = why_not(err)
            candidates.pop(name, None)
    label = f"{kind}, workers={workers}" + oversubscribed(workers)
    load = os.getloadavg()[0]
    result = compare_each(candidates, BASELINE, reps, warmup, f"peers throughput {label}", RATES)
    return {
        "label": label,
        "kind": kind,
        "num_workers": workers,
        "sizes": sizes,
        "errors": errors,
        "load_average": [load, os.getloadavg()[0]],
        **result["wall"],
        "cpu": result["cpu"],
    }


def run(pc: PeersConfig, peers: dict[str, Peer], store: Store, reps: int, warmup: int) -> list[dict]:
    return [_case(pc, peers, store, kind, workers, reps, warmup) for kind in KINDS for workers in pc.workers]
