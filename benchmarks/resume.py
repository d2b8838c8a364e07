"""4. Resume cost: seconds from load_state_dict() to the first batch, against the position in the epoch.

Ours jumps: the order is a keyed permutation evaluated at the resumed positions, so the cost should be a few
milliseconds and flat up to position 5e8 of N = 1e9. StatefulDataLoader (shuffle=True, num_workers=0) replays:
it rebuilds randperm(N) and steps through `position` samples, so it is measured at growing N (position N/2) until
the next point is predicted to exceed a time budget; where it stopped is recorded, and its slope extrapolated.
"""

from __future__ import annotations

import time
from functools import partial

from torchdata.stateful_dataloader import StatefulDataLoader

from benchmarks.config import Config
from benchmarks.datasets import IndexDataset
from benchmarks.loaders import ours
from benchmarks.progress import say
from benchmarks.rows import count, row, single
from benchmarks.states import global_state_at, stateful_state_at
from benchmarks.timing import compare, measure

BATCH = 64
OURS, THEIRS = "ResumableDataLoader", "StatefulDataLoader"
LATENCY_TARGET = "< 10"  # ms
FLAT_TARGET = "<= 1.5"  # resume at the last position / at position 0


def time_to_first_batch(loader, state: dict) -> float:
    """load_state_dict(state), then the first batch of a new pass: what a restarted job waits for."""
    start = time.perf_counter()
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


def _ours(dataset, state: dict) -> float:
    return time_to_first_batch(ours(dataset, batch_size=BATCH, shuffle=True), state)


def _theirs(dataset, state: dict) -> float:
    return time_to_first_batch(StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0), state)


def _ours_at(cfg: Config, position: int) -> dict:
    dataset = IndexDataset(cfg.resume_n)
    run = partial(_ours, dataset, global_state_at(dataset, BATCH, position))
    section = f"resume N={count(cfg.resume_n)} position={count(position)}"
    return {"position": position, "seconds": measure(OURS, run, cfg.reps, cfg.warmup, section, "s")}


def _side_by_side(cfg: Config, n: int) -> dict:
    """Both loaders resumed at position n/2 of one N, interleaved; ratio = theirs / ours (how much faster)."""
    dataset, position = IndexDataset(n), n // 2 // BATCH * BATCH
    candidates = {
        OURS: partial(_ours, dataset, global_state_at(dataset, BATCH, position)),
        THEIRS: partial(_theirs, dataset, stateful_state_at(dataset, BATCH, position)),
    }
    result = compare(candidates, OURS, cfg.reps, cfg.warmup, f"resume side by side N={count(n)}", "s")
    return {"n": n, "position": position, **result}


def _stateful_sweep(cfg: Config) -> tuple[list[dict], dict | None]:
    """Side-by-side points at growing N while StatefulDataLoader's predicted resume fits the budget."""
    points: list[dict] = []
    for n in cfg.stateful_resume_sizes:
        if points:
            last = points[-1]
            predicted = last["values"][THEIRS]["median"] * n / last["n"]  # it grows at least linearly
            if predicted > cfg.stateful_budget_s:
                say("resume", f"{THEIRS} stopped before N={count(n)}: predicted {predicted:.1f} s > budget")
                return points, {"n": n, "predicted_s": predicted, "budget_s": cfg.stateful_budget_s}
        points.append(_side_by_side(cfg, n))
    return points, None


def run(cfg: Config) -> dict:
    ours_points = [_ours_at(cfg, p) for p in cfg.resume_positions]
    stateful, stopped = _stateful_sweep(cfg)
    first, last = ours_points[0], ours_points[-1]
    rows = [
        row(
            f"ours at position {count(p['position'])} of {count(cfg.resume_n)}",
            p["seconds"],
            "ms",
            LATENCY_TARGET,
            scale=1e3,
        )
        for p in ours_points
    ]
    flat = single(last["seconds"]["median"] / first["seconds"]["median"])
    rows.append(row(f"ours at {count(last['position'])} / at {count(first['position'])}", flat, "ratio", FLAT_TARGET))
    rows += [
        row(f"{THEIRS} / ours at {count(p['position'])} of {count(p['n'])}", p["ratios"][THEIRS], "ratio")
        for p in stateful
    ]
    result = {"n": cfg.resume_n, "batch_size": BATCH, "ours": ours_points, "stateful": stateful, "stopped": stopped}
    if stateful:
        top = stateful[-1]
        per_position = top["values"][THEIRS]["median"] / top["position"]
        result["stateful_extrapolated_s"] = {
            "note": f"linear extrapolation from its measured point at {count(top['position'])}, not a measurement; "
            "its measured growth is steeper than linear, so this likely underestimates it",
            "position": last["position"],
            "seconds": per_position * last["position"],
        }
        rows.append(
            row(
                f"{THEIRS} at {count(last['position'])} (extrapolated, not measured)",
                single(per_position * last["position"]),
                "s",
            )
        )
    return {**result, "rows": rows}
