"""1. Loader throughput: samples/s of our loader against torch's DataLoader and torchdata's StatefulDataLoader.

Same map-style dataset, batch size and workers, all shuffled, then the same rows as a stream (an IterableDataset
whose iterator has a state, which our workers snapshot with every batch); the `+state_dict` candidates checkpoint
after every batch, as a resumable training loop does. A cheap sample shows the loader's own per-batch cost; an
expensive one (a busy wait per sample) shows whether it stays out of the way when loading dominates. Timing runs
from the first batch of every worker to the last batch: start-up is resume latency, not throughput, and the end of
a pass (where RandomSampler draws the next permutation and workers shut down) is no loader's throughput either.

Each pass gives samples per wall-clock second and per CPU second of the process and its workers. On a shared
machine the wall clock also measures the neighbours; the CPU time is what the loader costs, so our loader is graded
on it in every row. Where the loader's processes outnumber the usable CPUs (2 workers on 2 CPUs), the wall-clock
ratio is the scheduler's: those rows are not graded on it, and are shown next to DataLoader run against itself
(the A/A control: its spread is what the host resolves) and the CPU time per batch of every process and thread
(workers, their queue feeders, the main process).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from torch.utils.data import DataLoader

from benchmarks.config import Config
from benchmarks.datasets import FeatureDataset, FeatureStream
from benchmarks.environment import usable_cpus
from benchmarks.loaders import CANDIDATES, OURS, OURS_CHECKPOINTING, TORCH, Candidate, batch_len, steps
from benchmarks.processes import descendants
from benchmarks.rows import row
from benchmarks.stream_costs import per_batch
from benchmarks.timing import compare, compare_each, ratio_of

TORCH_AGAIN = Candidate("DataLoader (again)", DataLoader, False)  # the A/A control on a crowded host
RATES = {"wall": "samples/s", "cpu": "samples per CPU second"}  # what one pass measures (`timed_pass`)
OURS_TARGET = ">= 0.99"  # our throughput / DataLoader's, with or without a state_dict() per step
STREAM_TARGET = ">= 0.98"  # the same on a stream, whose workers snapshot their state with every batch


def rates(candidate: Candidate, dataset, **kwargs) -> dict[str, float]:
    """Samples per wall-clock and per CPU second of one pass, after every worker delivered its first batch (batch i
    comes from worker i mod num_workers), so that process start-up, slow and erratic on a loaded machine, is not in
    the figure."""
    loader = candidate.make(dataset, **kwargs)
    return timed_pass(steps(loader, candidate.checkpoint), loader.num_workers, candidate.name)


def rate(candidate: Candidate, dataset, **kwargs) -> float:
    """Samples per wall-clock second of one pass (`rates`)."""
    return rates(candidate, dataset, **kwargs)["wall"]


def timed_pass(
    batches: Iterator, num_workers: int, name: str, count: Callable[[Any], int] = batch_len
) -> dict[str, float]:
    """Samples (what `count` counts of a batch: 1 for batches) per wall-clock second and per CPU second (this process
    and its child processes: the workers) of the rest of a pass once each of `num_workers` workers delivered its
    first batch, up to the arrival of the last batch. What a loader does after it (the end of the pass:
    `RandomSampler` draws the next pass's whole permutation there, workers shut down) is left out for every
    candidate, as start-up is."""
    for _ in range(max(1, num_workers)):
        next(batches)
    children, reaped = descendants(), _reaped_s()
    cpu_start = time.process_time()
    start = end = time.perf_counter()
    samples = 0
    for batch in batches:
        samples += count(batch)
        end, cpu_end = time.perf_counter(), time.process_time()
    if not samples:
        raise ValueError(f"{name}: nothing came after the start-up batches; use more samples")
    still = descendants()  # workers a loader left running (joined ones are in the reaped children's time)
    children_s = _reaped_s() - reaped + sum(still.get(pid, 0.0) - cpu for pid, cpu in children.items())
    return {"wall": samples / (end - start), "cpu": samples / (cpu_end - cpu_start + children_s)}


def _reaped_s() -> float:
    """CPU seconds of the child processes that ended and were waited for (their whole lives)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def calibrated_size(dataset_of_size, run_s: float, probe: int, **kwargs) -> int:
    """Samples that make one pass of the plain DataLoader last about `run_s`, from a pass over `probe` samples:
    the same settings give runs of similar length on a laptop and on a 100-core host."""
    return max(probe, int(rate(TORCH, dataset_of_size(probe), **kwargs) * run_s))


def oversubscribed(num_workers: int) -> str:
    """A note on cases with more processes than usable CPUs: the scheduler, not the loader, sets their spread."""
    cpus, processes = usable_cpus(), num_workers + 1
    return f" ({processes} processes on {cpus} CPUs)" if processes > cpus else ""


def cpu_per_batch(candidate: Candidate, dataset, **kwargs) -> float:
    """CPU microseconds per batch of one pass, all processes and threads together, after the start-up batches."""
    return float(per_batch(candidate.make, dataset, candidate.checkpoint, **kwargs).sum())


def _case(cfg: Config, cost: str, busy_us: float, num_workers: int, stream: bool = False) -> dict:
    """Map-style (shuffled), or a stream (`FeatureStream`, the same rows with an iterator state: what each worker
    snapshots with every batch). On a crowded host, also DataLoader against itself (what the host resolves) and
    the CPU each batch costs."""
    kwargs = dict(batch_size=cfg.batch_size, num_workers=num_workers, pin_memory=cfg.device == "cuda")
    if not stream:
        kwargs["shuffle"] = True
    dataset_of_size = partial(FeatureStream if stream else FeatureDataset, features=cfg.features, busy_us=busy_us)
    size = calibrated_size(dataset_of_size, cfg.run_s, cfg.batch_size * 16, **kwargs)
    dataset = dataset_of_size(size)
    crowded = oversubscribed(num_workers)
    label = f"{'stream, ' if stream else ''}{cost}, workers={num_workers}" + crowded
    controls = (TORCH_AGAIN,) if crowded else ()
    candidates = {c.name: partial(rates, c, dataset, **kwargs) for c in CANDIDATES + controls}
    load = os.getloadavg()[0]
    result = compare_each(candidates, TORCH.name, cfg.reps, cfg.warmup, f"throughput {label}", RATES)
    case = {
        "label": label,
        "busy_us": busy_us,
        "dataset_size": size,
        "stream": stream,
        "graded": not crowded,
        "load_average": [load, os.getloadavg()[0]],
        **kwargs,
        **result["wall"],
        "per_cpu_second": result["cpu"],
    }
    if crowded:
        measured = (TORCH, TORCH_AGAIN, OURS_CHECKPOINTING)
        costs = {c.name: partial(cpu_per_batch, c, dataset, **kwargs) for c in measured}
        cpu = compare(costs, TORCH.name, cfg.reps, cfg.warmup, f"CPU per batch {label}", "us")
        cpu["savings"] = {name: ratio_of(cpu, TORCH.name, name) for name in costs if name != TORCH.name}
        case["cpu"] = cpu
    return case


def ratio_rows(case: dict, baseline: str, target: str) -> Iterator[dict]:
    """A row per candidate: its throughput / the baseline's, graded for our loader where every process has a CPU;
    the same per CPU second (process and workers), graded for our loader everywhere: the CPU a pass costs is the
    loader's, however crowded the host; on a crowded host, also the control and the CPU per batch by thread
    (baseline's / the candidate's: above 1 is cheaper)."""
    for name, ratio in case["ratios"].items():
        ours = name.startswith(OURS.name)
        yield row(
            f"{case['label']}: {name} / {baseline}",
            ratio,
            "ratio",
            target if ours and case.get("graded", True) else None,
        )
    for name, ratio in case.get("per_cpu_second", {}).get("ratios", {}).items():
        ours = name.startswith(OURS.name)
        yield row(f"{case['label']}: {name} / {baseline}, per CPU second", ratio, "ratio", target if ours else None)
    for name, saving in case.get("cpu", {}).get("savings", {}).items():
        yield row(f"{case['label']}: CPU per batch, {baseline} / {name}", saving, "ratio")


def run(cfg: Config) -> dict:
    costs = (("cheap", 0.0), ("expensive", cfg.busy_us))
    cases = [
        _case(cfg, cost, busy_us, workers, stream)
        for stream in (False, True)
        for cost, busy_us in costs
        for workers in cfg.workers
    ]
    rows = [r for case in cases for r in ratio_rows(case, TORCH.name, STREAM_TARGET if case["stream"] else OURS_TARGET)]
    return {"cases": cases, "rows": rows}
