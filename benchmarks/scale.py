"""11. Data parallelism at scale: up to 65,536 ranks simulated in one process, and the lockstep check's store.

Per world size W (quick and full: 1, 4, ..., 65,536): `merge_states` of W rank states in lockstep and of W states
a few micro-batches apart (3 to 5 updates into the epoch: the holes DDP Join leaves), the bytes one rank sends in
the checkpoint's gather (its state without the base every rank shares, `detach_base`, after resuming from that
uneven merge, whose holes its base holds), the merged states' bytes, the validation of the merged state as a
restarted rank reads it (`progress_of`), and one rank of W loading it and serving its first batch. The states are
built with `rank_state`, as each rank reports its own; N = 1e9.

The store: one TCPStore server in a process of its own on loopback, and C client threads, each with its own client,
playing W ranks' `LockstepWatch`es (rank r on client r mod C). Every step, every rank completes an update at once,
as after an all_reduce, under one of two protocols: every rank publishes at every update (the exact check, which
every rank ran at any W before, and still does up to 195 ranks), or the turns the loader takes beyond.
Requests are counted on the clients; a step lasts until every rank is done; the latency is one rank's update.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.config import Config
from benchmarks.datasets import IndexDataset
from benchmarks.loaders import ours
from benchmarks.progress import say
from benchmarks.resume import time_to_first_batch
from benchmarks.rows import row, single
from benchmarks.states import global_state_at
from benchmarks.timing import measure, summary
from loader import merge_states
from loader.checkpoint.lockstep import EXACT, LockstepWatch
from loader.core.partition import Layout
from loader.core.state import Progress, detach_base, progress_of, rank_state

N, BATCH = 10**9, 4
UPDATES, SPREAD = 3, 2  # every rank completed UPDATES updates; an uneven rank up to SPREAD more
SECONDS_TARGET = "< 1"
PROGRESS = (1, "bench")  # the progress the simulated ranks count their updates from


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank_states(world: int, uneven: bool) -> list[dict]:
    """The states of W ranks of a fresh run at N = 1e9, in lockstep or a few micro-batches apart (seeded)."""
    base = Progress.from_dict(global_state_at(IndexDataset(N), BATCH, 0))
    spread = np.random.default_rng(world).integers(0, SPREAD + 1, world) if uneven else np.zeros(world, np.int64)
    layout = Layout(world, 1, BATCH, False)
    return [rank_state(base, layout, r, 0, UPDATES + int(extra), False) for r, extra in enumerate(spread)]


def _json_bytes(state: dict) -> int:
    return len(json.dumps(state).encode())


def _load(merged: dict, world: int) -> float:
    """One rank (the last) of W loads the merged state and serves its first batch."""
    loader = ours(IndexDataset(N), batch_size=BATCH, shuffle=True, rank=world - 1, world_size=world)
    return time_to_first_batch(loader, merged)


def _world(cfg: Config, world: int) -> dict:
    lockstep, uneven = rank_states(world, False), rank_states(world, True)
    merged = merge_states(uneven, uneven=True)
    resumed = ours(IndexDataset(N), batch_size=BATCH, shuffle=True, rank=world - 1, world_size=world)
    resumed.load_state_dict(merged)
    next(iter(resumed))
    timed = partial(measure, reps=cfg.reps, warmup=cfg.warmup, section=f"scale W={world:,}", unit="s")
    return {
        "world": world,
        "merge_lockstep_s": timed("merge_states lockstep", partial(_seconds, partial(merge_states, lockstep))),
        "merge_uneven_s": timed("merge_states uneven", partial(_seconds, partial(merge_states, uneven, uneven=True))),
        "validate_s": timed("validate the merged state", partial(_seconds, partial(progress_of, merged))),
        "load_s": timed("load on one rank + first batch", partial(_load, merged, world)),
        "intervals": sum(len(flat) // 2 for _, flat in merged["committed"]),
        "gather_bytes_per_rank": _json_bytes(detach_base(resumed.state_dict(check_lockstep=False))),
        "merged_bytes": {"lockstep": _json_bytes(merge_states(lockstep)), "uneven": _json_bytes(merged)},
    }


# -- the store ------------------------------------------------------------------------------------------------------


class CountingStore:
    """A store client that counts the requests sent through it (one thread uses it at a time)."""

    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args):
            self.requests += 1
            return call(*args)

        return counted


def _store_host(ports) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ports.put(store.port)
    while True:
        time.sleep(1)


PROTOCOLS = ("none (the harness alone)", "every rank, every update", "turns")


def _steps(clients: list[CountingStore], world: int, steps: int, protocol: str) -> dict:
    """`steps` lockstep updates of `world` simulated ranks on the clients' threads under one protocol; the first
    (every rank publishes under either protocol: the first update since the progress was set) reported apart."""
    watches = [LockstepWatch(f"bench/{world}/{protocol}", store=clients[r % len(clients)]) for r in range(world)]
    updates: list[list[tuple[int, float, int]]] = [[] for _ in clients]  # (rank, seconds, requests) per update
    barrier = threading.Barrier(len(clients) + 1)

    def update(rank: int, u: int) -> None:
        if protocol == PROTOCOLS[1]:  # what completed_update does up to EXACT ranks
            watches[rank].publish(rank, (*PROGRESS, u))
        elif protocol == PROTOCOLS[2]:
            watches[rank].completed_update(rank, PROGRESS, world)

    def client(c: int) -> None:
        store = clients[c]
        for u in range(1, steps + 1):
            barrier.wait()
            for rank in range(c, world, len(clients)):
                start, before = time.perf_counter(), store.requests
                update(rank, u)
                if u > 1:
                    updates[c].append((rank, time.perf_counter() - start, store.requests - before))
            barrier.wait()

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(len(clients))]
    for thread in threads:
        thread.start()
    step_s, requests = [], []
    for _ in range(steps):
        before = sum(c.requests for c in clients)
        barrier.wait()
        start = time.perf_counter()
        barrier.wait()  # every rank completed this update
        step_s.append(time.perf_counter() - start)
        requests.append(sum(c.requests for c in clients) - before)
    for thread in threads:
        thread.join()
    done = [one for per_client in updates for one in per_client]
    calling = [seconds for _, seconds, made in done if made] or [0.0]
    return {
        "first_step": {"requests": requests[0], "seconds": step_s[0]},
        "requests_per_step": summary(requests[1:]),
        "step_s": summary(step_s[1:]),
        "calling_update_s": summary(calling),  # an update that made requests
        "rank0_update_s": summary([seconds for rank, seconds, _ in done if rank == 0]),
        "requests_per_s": sum(requests[1:]) / sum(step_s[1:]),
    }


def _store(cfg: Config) -> dict:
    context = mp.get_context("fork")
    ports = context.Queue()
    host = context.Process(target=_store_host, args=(ports,), daemon=True)
    host.start()
    try:
        port = ports.get(timeout=60)
        start = time.perf_counter()
        with ThreadPoolExecutor(min(128, cfg.store_clients)) as pool:  # connections made one by one can stall
            clients = list(
                pool.map(
                    lambda _: CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False)), range(cfg.store_clients)
                )
            )
        say("scale", f"{cfg.store_clients} store clients connected in {time.perf_counter() - start:.1f} s")
        points = []
        for world in cfg.store_ranks:
            point = {"ranks": world}
            for protocol in PROTOCOLS:
                point[protocol] = _steps(clients, world, cfg.store_steps + 1, protocol)
                result = point[protocol]
                say(
                    "scale",
                    f"store, {world:,} ranks, {protocol}: {result['requests_per_step']['median']:,.0f} "
                    f"requests and {result['step_s']['median'] * 1e3:.1f} ms a step",
                )
            points.append(point)
        return {"clients": cfg.store_clients, "steps": cfg.store_steps, "points": points}
    finally:
        os.kill(host.pid, signal.SIGKILL)
        host.join(timeout=10)


# -- the section ----------------------------------------------------------------------------------------------------


def _exponent(points: list[dict], key: str) -> float:
    """How the time grows between the two largest W (1: linear, 2: quadratic), from each one's fastest run: the
    cost itself, where a median on a shared machine also holds what other processes took."""
    small, large = points[-2], points[-1]
    return math.log(large[key]["min"] / small[key]["min"]) / math.log(large["world"] / small["world"])


def _store_rows(point: dict) -> list[dict]:
    ranks = f"{point['ranks']:,} ranks"
    rows = []
    for protocol in PROTOCOLS:
        result = point[protocol]
        rows.append(row(f"step (every rank's update), {ranks}, {protocol}", result["step_s"], "ms", scale=1e3))
        if protocol != PROTOCOLS[0]:
            rows += [
                row(f"store requests per step, {ranks}, {protocol}", result["requests_per_step"], "requests"),
                row(f"rank 0's update, {ranks}, {protocol}", result["rank0_update_s"], "ms", scale=1e3),
            ]
    return rows


def _rows(points: list[dict], store: dict) -> list[dict]:
    largest, smallest = points[-1], points[0]
    w = f"W={largest['world']:,}"
    per_rank = largest["gather_bytes_per_rank"] / smallest["gather_bytes_per_rank"]
    rows = [
        row(f"merge_states, {w}, lockstep", largest["merge_lockstep_s"], "s", SECONDS_TARGET),
        row(
            f"merge_states, {w}, {UPDATES}-{UPDATES + SPREAD} micro-batches each ({largest['intervals']:,} intervals)",
            largest["merge_uneven_s"],
            "s",
            SECONDS_TARGET,
        ),
        row(f"validation of that merged state, {w}", largest["validate_s"], "s", SECONDS_TARGET),
        row(f"load + first batch on one rank, {w}", largest["load_s"], "s", SECONDS_TARGET),
        row(
            f"merge time growth exponent (fastest runs), uneven, W={points[-2]['world']:,} -> {largest['world']:,} "
            f"(1: linear)",
            single(_exponent(points, "merge_uneven_s")),
            "exponent",
            "<= 1.3",
        ),
        row(f"gather bytes per rank (detached, holes in the base), {w}", single(largest["gather_bytes_per_rank"]), "B"),
        row(f"gather bytes per rank, {w} / W={smallest['world']:,}", single(per_rank), "ratio", "<= 1.1"),
        row(f"merged state bytes, {w}, uneven", single(largest["merged_bytes"]["uneven"]), "B"),
    ]
    for point in (store["points"][0], store["points"][-1]) if len(store["points"]) > 1 else store["points"]:
        rows += _store_rows(point)
    exact = store["points"][-1][PROTOCOLS[1]]  # the most requests per step: the store's rate under load
    rows += [
        row(
            f"store requests/s served, {store['clients']:,} client threads, {store['points'][-1]['ranks']:,} ranks "
            f"every update",
            single(exact["requests_per_s"]),
            "requests/s",
        ),
        row(
            "store time per step at 65,536 ranks, every rank every update (65,536 requests at that rate)",
            single(65_536 / exact["requests_per_s"]),
            "s",
        ),
        row(
            f"store time per step at any W, turns ({EXACT} requests at most, at that rate)",
            single(EXACT / exact["requests_per_s"]),
            "ms",
            scale=1e3,
        ),
    ]
    return rows


def run(cfg: Config) -> dict:
    points = [_world(cfg, world) for world in cfg.scale_worlds]
    store = _store(cfg)
    return {
        "n": N,
        "batch_size": BATCH,
        "updates": UPDATES,
        "spread": SPREAD,
        "points": points,
        "store": store,
        "rows": _rows(points, store),
    }
