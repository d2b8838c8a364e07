"""Order and index memory of every system: the peak RSS added by building its loader, loading a state saved at
N/2 and taking the first batch, against N; one fresh process per point (`python -m benchmarks.peers.memory`),
warmed up on a small dataset first so imports and first-call allocations do not count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.memory import in_child, peak_added
from benchmarks.peers.config import PeersConfig
from benchmarks.peers.phase import Peer
from benchmarks.peers.store import Store, why_not
from benchmarks.peers.systems import SYSTEMS
from benchmarks.progress import say
from benchmarks.rows import count

WARM_N = 1000


def _resume(peer: Peer, n: int, data: Path, batch: int) -> None:
    peer.first_batch(n, data, batch, peer.state_at(n, data, batch, n // 2 // batch * batch))


def probe(key: str, n: int, data: Path, warm_data: Path, batch: int) -> dict:
    """Runs in the child."""
    peer = next(s for s in SYSTEMS if s.key == key).load()
    _resume(peer, WARM_N, warm_data, batch)
    return peak_added(lambda: _resume(peer, n, data, batch))


def _point(key: str, peer: Peer, n: int, pc: PeersConfig, store: Store) -> dict:
    try:
        args = [key, str(n), str(store.data(key, peer, n)), str(store.data(key, peer, WARM_N)), str(pc.batch)]
        point = {"n": n, **in_child("benchmarks.peers.memory", args, pc.memory_timeout_s)}
    except Exception as err:  # reported, not raised: the other systems go on
        return {"n": n, "error": why_not(err)}
    if "added_bytes" in point:
        say("peers", f"memory {key} N={count(n)}: +{point['added_bytes'] / 1e6:.2f} MB in {point['seconds']:.2f} s")
    return point


def run(pc: PeersConfig, peers: dict[str, Peer], store: Store) -> dict:
    if not sys.platform.startswith("linux"):
        return {"skipped": "needs Linux /proc/self/status to read the peak RSS"}
    points: dict[str, list[dict]] = {}
    for key, peer in peers.items():
        points[key] = []
        for n in pc.memory_sizes:
            points[key].append(_point(key, peer, n, pc, store))
            if "added_bytes" not in points[key][-1]:
                break  # a larger N would fail or time out too
    return {"batch": pc.batch, "points": points}


if __name__ == "__main__":
    key, n, data, warm, batch = sys.argv[1:6]
    print(json.dumps(probe(key, int(n), Path(data), Path(warm), int(batch))))
