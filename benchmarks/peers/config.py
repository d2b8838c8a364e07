"""Sizes of the peers section per mode (smoke: seconds in CI; quick: minutes here; full: longer)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.peers.faults import FAULTS, Fault


@dataclass(frozen=True)
class PeersConfig:
    # the exactly-once table
    n: int
    stop_updates: int  # optimizer updates (global batch 48) before the stop
    faults: tuple[Fault, ...]
    launch_timeout_s: float  # one launch of every rank (processes for Streaming and LitData)
    # the capability cases (`capabilities.py`): samples (packing: tokens of about as many rows), updates to the stop
    capability_n: int
    capability_stop: int
    # costs, each system at one rank
    batch: int  # rounds and warm-up rounds are the suite's (Config.reps, Config.warmup), but for throughput
    resume_sizes: tuple[int, ...]  # resumed at N/2; each system until its budget stops it
    resume_budget_s: float  # no resume predicted longer than this is started
    write_budget_s: float  # no shards predicted to take longer than this to write are written
    memory_sizes: tuple[int, ...]
    memory_timeout_s: float
    workers: tuple[int, ...]
    run_s: float  # aimed-at duration of one throughput pass of the plain DataLoader
    throughput_reps: int  # rounds: a shared machine spreads per-round ratios widely, and the quartiles must hold


QUICK = PeersConfig(
    n=10_000,
    stop_updates=50,
    faults=FAULTS,
    launch_timeout_s=600.0,
    capability_n=3000,
    capability_stop=20,
    batch=64,
    resume_sizes=tuple(10**k for k in range(5, 10)),
    resume_budget_s=3.0,
    write_budget_s=180.0,
    memory_sizes=(10**5, 10**6, 10**7),
    memory_timeout_s=120.0,
    workers=(0, 2),
    run_s=0.25,
    throughput_reps=15,
)
FULL = replace(QUICK, resume_budget_s=10.0, write_budget_s=600.0, memory_timeout_s=300.0, throughput_reps=25)
SMOKE = replace(
    QUICK,
    n=960,
    stop_updates=5,
    faults=(Fault(4, 4), Fault(4, 3), Fault(4, 3, uneven=True), Fault(4, 4, batch_after=96), Fault(3, None)),
    launch_timeout_s=300.0,
    capability_n=480,
    capability_stop=3,
    resume_sizes=(2000,),
    resume_budget_s=1.0,
    write_budget_s=10.0,
    memory_sizes=(2000,),
    memory_timeout_s=60.0,
    workers=(0,),
    run_s=0.01,
    throughput_reps=1,
)


def peers_config(mode: str) -> PeersConfig:
    return {"smoke": SMOKE, "quick": QUICK, "full": FULL}[mode]
