"""Resume cost of every system: seconds from building the loader and loading a state saved at position N/2 to the
first batch (what a restarted job waits for), against N, at one rank; the systems interleaved at each N.

A system whose next point is predicted (its last time x the growth in N) past the budget, or whose shards would
take too long to write, stops there; where and why is recorded.
"""

from __future__ import annotations

import time
from functools import partial

from benchmarks.peers.config import PeersConfig
from benchmarks.peers.phase import Peer
from benchmarks.peers.store import Store, why_not
from benchmarks.peers.systems import OURS
from benchmarks.rows import count
from benchmarks.timing import compare


def _seconds(peer: Peer, n: int, data, batch: int, state) -> float:
    start = time.perf_counter()
    peer.first_batch(n, data, batch, state)
    return time.perf_counter() - start


def _candidate(peer: Peer, key: str, n: int, pc: PeersConfig, store: Store):
    """The timed resume of one system at N/2 (a batch multiple), after one untimed try that must succeed."""
    data = store.data(key, peer, n)
    state = peer.state_at(n, data, pc.batch, n // 2 // pc.batch * pc.batch)
    run = partial(_seconds, peer, n, data, pc.batch, state)
    run()
    return run


def run(pc: PeersConfig, peers: dict[str, Peer], store: Store, reps: int, warmup: int) -> dict:
    points, stopped, last = [], {}, {}  # last: the previous N and each system's median there
    for n in pc.resume_sizes:
        candidates = {}
        for key, peer in peers.items():
            if key in stopped:
                continue
            predicted = last[key] * n / last["n"] if key in last else 0.0
            if predicted > pc.resume_budget_s:
                stopped[key] = {"n": n, "why": f"predicted {predicted:.1f} s > budget {pc.resume_budget_s:.0f} s"}
                continue
            try:
                candidates[key] = _candidate(peer, key, n, pc, store)
            except Exception as err:  # reported, not raised: the other systems go on
                stopped[key] = {"n": n, "why": why_not(err)}
        result = compare(candidates, OURS.key, reps, warmup, f"peers resume N={count(n)}", "s")
        last = {"n": n, **{key: value["median"] for key, value in result["values"].items()}}
        points.append({"n": n, "position": n // 2 // pc.batch * pc.batch, **result})
    return {"batch": pc.batch, "points": points, "stopped": stopped}
