"""13. The capabilities of issue 30, each against the same loader without it: filters (`filter=`), batch-size ramps
(`BatchPolicy(global_batch=[(0, G1), (s, G2)])`) and token-budget batches (`TokenBudgetBatches`).

Cost per batch: the two loaders run interleaved (`timing.compare_each`), one pass each a round with num_workers=0
over nearly free samples, so the loader's own per-batch cost shows; each pass gives batches per wall-clock and per
CPU second (`throughput.timed_pass`), and the row is the per-round ratio of the costs per batch (with / without:
above 1 costs more). The issue states no bound for them: a ratio whose rounds' quartiles straddle 1 reads "not
resolved". The loaders without the feature: no filter (its batches are the filter's before it drops members); a
fixed global batch of G1 (`grad_accum`); fixed-size batches of the same samples' indices, of the budget's mean
count (what a token-budget batch holds with `dataset=None`). State bytes: `len(json.dumps(...))` of one rank's
`state_dict()` after a few batches and of the merged state of 4 ranks that consumed unequal amounts. Padding of
the token budget against an unbounded-buffer best fit and a sorted buffer (`benchmarks.budget`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks import budget
from benchmarks.checkpoint import advance, serialized_bytes
from benchmarks.config import Config
from benchmarks.datasets import FeatureDataset, IndexDataset
from benchmarks.loaders import ours
from benchmarks.report import number
from benchmarks.rows import resolves, row, single
from benchmarks.throughput import timed_pass
from benchmarks.timing import compare_each, ratio_of, summary
from loader import ResumableDataLoader, merge_states
from loader.core.batch_policy import BatchPolicy
from loader.sources.budget import TokenBudgetBatches

BATCH, FEATURES = 64, 64  # the micro-batch and the nearly free sample of throughput's cheap rows
RAMP = (4 * BATCH, 8 * BATCH)  # G1 -> G2 at 1 and 4 ranks: K = 4 -> 8 at one rank
UNEVEN = (5, 2, 4, 0)  # micro-batches each of 4 ranks delivered before their states are merged
STATE_BATCHES = 64  # the states' loaders: datasets of about this many batches
SFT = "sft log-normal (median 256)"
PER_BUDGET = 34  # SFT samples a 16384-token batch holds, about: sizes the budget's dataset in batches
RATES = {"wall": "batches/s", "cpu": "batches per CPU second"}
REPORTED = "reported"  # the issue asks for these figures, with no bound
WITH, WITHOUT = "with", "without"


def keep(index: int, sample: Any) -> bool:
    """The benchmark's filter: drops every tenth index (a function of metadata, as a length or quality filter)."""
    return index % 10 != 0


Make = Callable[[int, int], ResumableDataLoader]  # (rank, world_size) -> a loader


@dataclass(frozen=True)
class Capability:
    name: str
    feature: Make  # the loader with the capability
    plain: Make  # the same loader without it
    without: str  # what the plain loader is, for the table


def filters(batches: int) -> Capability:
    dataset = FeatureDataset(batches * BATCH, FEATURES)
    make = partial(_loader, dataset, batch_size=BATCH, shuffle=True)
    return Capability("filter (drops 1 in 10)", partial(make, filter=keep), make, "no filter")


def ramp(batches: int) -> Capability:
    """G1 for the first half of the epoch's updates, then G2; against G1 throughout."""
    dataset, g1, g2 = FeatureDataset(batches * BATCH, FEATURES), *RAMP
    policy = BatchPolicy(global_batch=[(0, g1), (max(1, batches * BATCH // (2 * g1)), g2)], micro_batch=BATCH)
    make = partial(_loader, dataset, batch_size=BATCH, shuffle=True)

    def plain(rank: int, world_size: int) -> ResumableDataLoader:
        return make(rank, world_size, grad_accum=g1 // (world_size * BATCH))

    return Capability(
        f"batch-size ramp {g1} -> {g2}",
        partial(make, batch_policy=policy),
        plain,
        f"a fixed global batch of {g1} (grad_accum)",
    )


def token_budget(batches: int) -> Capability:
    lengths = budget.distributions(batches * PER_BUDGET)[SFT]
    batched = TokenBudgetBatches(lengths, budget.MAX_TOKENS)
    size = max(1, round(len(lengths) / len(batched)))
    return Capability(
        f"token budget {budget.MAX_TOKENS} ({SFT})",
        partial(_loader, batched, batch_size=None, shuffle=True),
        partial(_loader, IndexDataset(len(lengths)), batch_size=size, shuffle=True),
        f"batches of {size} indices (the budget's mean)",
    )


CAPABILITIES = (filters, ramp, token_budget)


def _loader(dataset, rank: int, world_size: int, **kwargs: Any) -> ResumableDataLoader:
    return ours(dataset, rank=rank, world_size=world_size, **kwargs)


def _one(batch: Any) -> int:
    return 1


def _pass(make: Make) -> dict[str, float]:
    """Batches per wall-clock and CPU second of one pass of one rank of one."""
    return timed_pass(iter(make(0, 1)), 0, "features", count=_one)


def costs(cfg: Config, capability: Capability) -> dict:
    """The two loaders interleaved; per clock, each one's µs per batch and the per-round cost ratio with / without."""
    measured = compare_each(
        {WITH: partial(_pass, capability.feature), WITHOUT: partial(_pass, capability.plain)},
        WITHOUT,
        cfg.reps,
        cfg.warmup,
        f"features {capability.name}",
        RATES,
    )
    return {
        clock: {
            "us_per_batch": {
                name: summary([1e6 / rate for rate in rates]) for name, rates in result["samples"].items()
            },
            "cost_ratio": ratio_of(result, WITHOUT, WITH),
            "rates": result,
        }
        for clock, result in measured.items()
    }


def state_bytes(make: Make) -> dict[str, int]:
    """JSON bytes of one rank's state after a few batches, and of the merged state of 4 ranks that delivered
    `UNEVEN` micro-batches."""
    one = advance(make(0, 1), UNEVEN[0]).state_dict()
    ranks = [advance(make(rank, len(UNEVEN)), stop) for rank, stop in enumerate(UNEVEN)]
    merged = merge_states([dl.state_dict() for dl in ranks], uneven=True)
    return {"one rank": serialized_bytes(one)["json"], "merged, 4 ranks uneven": serialized_bytes(merged)["json"]}


def padding(samples: int) -> dict[str, list]:
    """Per length distribution, each batcher's batches, padding and fill (`benchmarks.budget.table`)."""
    return {
        name: [{"batcher": what, **measures} for what, measures in budget.table(lengths)]
        for name, lengths in budget.distributions(samples).items()
    }


def _ratio_row(what: str, stats: dict) -> dict:
    """A cost ratio, read against 1 as a target would be: "not resolved" where its quartiles straddle 1."""
    shown = row(what, stats, "ratio")
    return {**shown, "target": REPORTED, **({} if resolves({**shown, "n": stats["n"]}, 1.0) else {"resolved": False})}


def _shown(stats: dict) -> str:
    if not resolves(stats, 1.0):
        return f"n.r. ({number(stats['q1'])} - {number(stats['q3'])})"
    return f"{number(stats['median'])} ({number(stats['min'])} - {number(stats['max'])})"


def _rows(case: dict) -> list[dict]:
    name, measured = case["capability"], case["costs"]
    rows = [
        _ratio_row(f"{name}: cost per batch with / without, {clock}", measured[clock]["cost_ratio"])
        for clock in ("wall", "cpu")
    ]
    rows += [
        row(f"{name}: CPU µs per batch, {which}", measured["cpu"]["us_per_batch"][which], "µs")
        for which in (WITH, WITHOUT)
    ]
    rows += [
        {
            **row(f"{name}: state bytes, {kind}, {which}", single(case["state_bytes"][which][kind]), "B"),
            "target": REPORTED if which == WITH else None,
        }
        for kind in case["state_bytes"][WITH]
        for which in (WITH, WITHOUT)
    ]
    return rows


def _padding_rows(tables: dict[str, list]) -> list[dict]:
    rows = []
    for name, batchers in tables.items():
        best = batchers[0]
        for entry in batchers:
            ours_ = entry["batcher"].startswith("ours")
            rows.append(
                {
                    **row(
                        f"token budget, {name}: padding, {entry['batcher']}", single(entry["padding"]), "%", scale=100
                    ),
                    "target": REPORTED if ours_ else None,
                }
            )
            if entry is not best:
                rows.append(
                    {
                        **row(
                            f"token budget, {name}: batches / best fit's, {entry['batcher']}",
                            single(entry["batches"] / best["batches"]),
                            "ratio",
                        ),
                        "target": REPORTED if ours_ else None,
                    }
                )
    return rows


def _table(cases: list[dict], tables: dict[str, list]) -> list[str]:
    """One row per capability: its cost, state bytes and (the token budget) padding against the best fit."""
    lines = [
        "| capability | against | cost per batch, with / without: wall; CPU | CPU µs per batch, with; without "
        "| state bytes, one rank; merged 4 ranks uneven (without) | padding; batches against the best fit |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in cases:
        cpu, states = case["costs"]["cpu"], case["state_bytes"]
        per_batch = "; ".join(number(cpu["us_per_batch"][w]["median"]) for w in (WITH, WITHOUT))
        state = "; ".join(f"{states[WITH][kind]:,} ({states[WITHOUT][kind]:,})" for kind in states[WITH])
        pad = ""
        if case["capability"].startswith("token budget"):
            default = next(b for b in tables[SFT] if b["batcher"] == "ours, buckets=1.1")
            best = tables[SFT][0]
            pad = (
                f"{default['padding']:.2%} (best fit {best['padding']:.2%}); "
                f"{default['batches'] / best['batches']:.3f}× ({SFT})"
            )
        ratios = "; ".join(_shown(case["costs"][clock]["cost_ratio"]) for clock in ("wall", "cpu"))
        lines.append(f"| {case['capability']} | {case['without']} | {ratios} | {per_batch} | {state} | {pad} |")
    return lines


def run(cfg: Config) -> dict:
    cases = []
    for capability_of in CAPABILITIES:
        small, timed = capability_of(STATE_BATCHES), capability_of(cfg.feature_batches)
        cases.append(
            {
                "capability": timed.name,
                "without": timed.without,
                "costs": costs(cfg, timed),
                "state_bytes": {WITH: state_bytes(small.feature), WITHOUT: state_bytes(small.plain)},
            }
        )
    tables = padding(cfg.budget_samples)
    rows = [r for case in cases for r in _rows(case)] + _padding_rows(tables)
    return {
        "cases": cases,
        "padding": tables,
        "tables": _table(cases, tables),
        "notes": [
            'Targets: issue 30 states none for these figures ("reported"); a cost ratio whose rounds\' '
            'quartiles straddle 1 reads "not resolved".'
        ],
        "rows": rows,
    }
