"""Interleaved repetitions and their statistics: the claims are paired ratios, not absolute times.

Candidates run interleaved in one process after warm-up rounds, each round in a new order (seeded, so a rerun
repeats it), so whatever drifts on the machine (clock frequency, caches, other load) hits every candidate alike,
and none always runs first or right after the same other (a plain rotation A B C, B C A, ... keeps every
candidate's predecessor, and with it whatever state that one leaves behind). The
cyclic garbage collector is paused during each measurement, as timeit does. Ratios are taken per round (paired),
then summarised by their median and spread (min, max, quartiles).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from benchmarks.progress import progress_bar, say

ORDER_SEED = 0  # the rounds' candidate orders: random, and the same in every run
Measure = Callable[[], float]  # runs one repetition and returns its measurement (seconds, samples/s, ...)
Measures = Callable[[], dict[str, float]]  # one repetition measuring several things at once (wall rate, CPU rate)


def sync(device: str) -> None:
    """Wait for queued device work, so a timer stops when the work is done, not when it was queued."""
    if device == "cuda":
        torch.cuda.synchronize()


def per_call(fn: Callable[[], object], min_seconds: float) -> float:
    """Mean seconds per call of fn, calling it in doubling batches until one batch lasts `min_seconds`: calls of a
    few microseconds cannot be timed one by one."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / number
        number *= 2


def summary(values: Sequence[float]) -> dict:
    """Median and spread of a list of measurements."""
    data = np.asarray(values, dtype=float)
    q1, median, q3 = np.percentile(data, [25, 50, 75])
    return {
        "median": float(median),
        "min": float(data.min()),
        "max": float(data.max()),
        "q1": float(q1),
        "q3": float(q3),
        "n": int(data.size),
    }


def _without_gc(fn: Measure) -> float:
    """fn() with the cyclic garbage collector paused, as timeit does: a collection set off by one candidate's
    garbage would otherwise land, at random, in whichever candidate runs next."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return fn()
    finally:
        if was_enabled:
            gc.enable()


def interleave(
    candidates: Mapping[str, Measure | Measures], reps: int, warmup: int, section: str, unit: str
) -> dict[str, list]:
    """Each candidate's measurements from `reps` rounds A B C, B C A, ... after `warmup` discarded rounds."""
    names = list(candidates)
    samples: dict[str, list[float]] = {name: [] for name in names}
    order = np.random.default_rng(ORDER_SEED)
    done, total = 0, (warmup + reps) * len(names)
    with progress_bar(section, total) as bar:
        for round_ in range(warmup + reps):
            tag = "warm-up" if round_ < warmup else f"rep {round_ - warmup + 1}/{reps}"
            for name in order.permutation(names).tolist():
                value = _without_gc(candidates[name])
                done += 1
                bar.update()
                shown = (
                    ", ".join(f"{k} {v:.4g}" for k, v in value.items()) if isinstance(value, dict) else f"{value:.4g}"
                )
                say(section, f"{name} {tag}: {shown} {unit} ({done}/{total})")
                if round_ >= warmup:
                    samples[name].append(value)
    return samples


def measure(name: str, fn: Measure, reps: int, warmup: int, section: str, unit: str) -> dict:
    """Summary of one candidate's repetitions, for points that have no baseline to interleave with."""
    return summary(interleave({name: fn}, reps, warmup, section, unit)[name])


def ratio_of(result: dict, numerator: str, denominator: str) -> dict:
    """Summary of the per-round ratio numerator / denominator of two candidates of one `compare` result."""
    samples = result["samples"]
    return summary([a / b for a, b in zip(samples[numerator], samples[denominator])])


def compare(candidates: Mapping[str, Measure], baseline: str, reps: int, warmup: int, section: str, unit: str) -> dict:
    """Interleave the candidates; summarise each one and its per-round ratio to the baseline (candidate / baseline)."""
    return result_of(interleave(candidates, reps, warmup, section, unit), baseline, unit)


def compare_each(
    candidates: Mapping[str, Measures], baseline: str, reps: int, warmup: int, section: str, units: Mapping[str, str]
) -> dict[str, dict]:
    """`compare` of candidates that measure several things in one run (`units`: each one's unit): one result per
    measurement, all from the same interleaved rounds, so their per-round ratios pair up."""
    samples = interleave(candidates, reps, warmup, section, "; ".join(units.values()))
    return {
        key: result_of({name: [one[key] for one in values] for name, values in samples.items()}, baseline, unit)
        for key, unit in units.items()
    }


def result_of(samples: dict[str, list[float]], baseline: str, unit: str) -> dict:
    """Each candidate's summary and its per-round ratio to the baseline, from `interleave`'s samples."""
    result = {
        "unit": unit,
        "baseline": baseline,
        "samples": samples,
        "values": {name: summary(values) for name, values in samples.items()},
    }
    result["ratios"] = {name: ratio_of(result, name, baseline) for name in samples if name != baseline}
    return result
