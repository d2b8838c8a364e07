"""13. The capabilities of issue 30, each against the same loader without it: filters (`filter=`), batch-size ramps
(`BatchPolicy(global_batch=[(0, G1), (s, G2)])`), token-budget batches (`TokenBudgetBatches`) and a Mixture's
weights changed online (`dl.change_mixture`).

Cost per batch: the two loaders run interleaved (`timing.compare_each`), one pass each a round with num_workers=0
over nearly free samples, so the loader's own per-batch cost shows; each pass gives batches per wall-clock and per
CPU second (`throughput.timed_pass`), and the row is the per-round ratio of the costs per batch (with / without:
above 1 costs more). The issue states no bound for them: a ratio whose rounds' quartiles straddle 1 reads "not
resolved". The loaders without the feature: no filter (its batches are the filter's before it drops members); a
fixed global batch of G1 (`grad_accum`); fixed-size batches of the same samples' indices, of the budget's mean
count (what a token-budget batch holds with `dataset=None`); the same Mixture whose weights never changed, so no
plan rides on its batches (2 workers on both sides: the plan is pickled to the workers with each batch's indices).
State bytes: `len(json.dumps(...))` of one rank's `state_dict()` after a few batches and of the merged state of 4
ranks that consumed unequal amounts, plus the plan a checkpoint records once the weights changed online (its
manifest's `mixture_plan`), also after 1, 10 and 100 changes. Padding of the token budget against an
unbounded-buffer best fit and a sorted buffer (`benchmarks.budget`).
"""

from __future__ import annotations

import json
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
from loader.sources import Mixture
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
MIX_WORKERS, MIX_WINDOW = 2, 100  # the mixture's loaders: its plan rides to the workers; slots per window
MIX_BATCHES = 200  # at most, a timed pass of the mixture's (2 workers on 2 shared cores: ~50 ms a batch here)
CHANGES = (1, 10, 100)  # online changes before the plan's bytes are read


def keep(index: int, sample: Any) -> bool:
    """The benchmark's filter: drops every tenth index (a function of metadata, as a length or quality filter)."""
    return index % 10 != 0


Make = Callable[..., ResumableDataLoader]  # (rank, world_size, **loader options) -> a loader


@dataclass(frozen=True)
class Capability:
    name: str
    feature: Make  # the loader with the capability
    plain: Make  # the same loader without it
    without: str  # what the plain loader is, for the table
    workers: int = 0


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


def _mixture(batches: int, rank: int, world_size: int, changed: bool = False, **kwargs: Any) -> ResumableDataLoader:
    """A loader over a Mixture of two sources of `batches` batches each, its weights changed online at step 0
    (`changed`: from then on its plan rides on every batch) or never."""
    half = batches * BATCH
    sources = [FeatureDataset(half, FEATURES, seed=s) for s in range(2)]
    mix = Mixture(sources, [0.5, 0.5], 2 * half, names=["a", "b"], window=MIX_WINDOW)
    dl = _loader(mix, rank, world_size, batch_size=BATCH, shuffle=True, **kwargs)
    dl.step = 0
    if changed:
        dl.change_mixture([1, 2])
    return dl


def online_mixture(batches: int) -> Capability:
    make = partial(_mixture, min(batches, MIX_BATCHES))
    return Capability(
        "mixture weights changed online (once, at step 0)",
        partial(make, changed=True),
        make,
        f"the same Mixture, weights never changed (no plan rides on its batches; {MIX_WORKERS} workers both)",
        MIX_WORKERS,
    )


CAPABILITIES = (filters, ramp, token_budget, online_mixture)


def _loader(dataset, rank: int, world_size: int, **kwargs: Any) -> ResumableDataLoader:
    return ours(dataset, rank=rank, world_size=world_size, **kwargs)


def _one(batch: Any) -> int:
    return 1


def _pass(make: Make, workers: int) -> dict[str, float]:
    """Batches per wall-clock and CPU second of one pass of one rank of one, with `workers` worker processes."""
    return timed_pass(
        iter(make(0, 1, **({"num_workers": workers} if workers else {}))), workers, "features", count=_one
    )


def costs(cfg: Config, capability: Capability) -> dict:
    """The two loaders interleaved; per clock, each one's µs per batch and the per-round cost ratio with / without."""
    measured = compare_each(
        {
            WITH: partial(_pass, capability.feature, capability.workers),
            WITHOUT: partial(_pass, capability.plain, capability.workers),
        },
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


def plan_bytes(dl: ResumableDataLoader) -> int:
    """JSON bytes of the plan a checkpoint records beside the state once a Mixture's weights changed online (its
    manifest's `mixture_plan`); 0 for any other loader."""
    carried = getattr(dl.dataset, "carried_plan", None)
    plan = carried() if callable(carried) else None
    return 0 if plan is None else len(json.dumps({"mixture_plan": plan.to_dict()}).encode())


def state_bytes(make: Make) -> dict[str, int]:
    """JSON bytes of one rank's state after a few batches, and of the merged state of 4 ranks that delivered
    `UNEVEN` micro-batches, each with the plan a checkpoint records (`plan_bytes`)."""
    one = advance(make(0, 1), UNEVEN[0])
    ranks = [advance(make(rank, len(UNEVEN)), stop) for rank, stop in enumerate(UNEVEN)]
    merged = merge_states([dl.state_dict() for dl in ranks], uneven=True)
    return {
        "one rank": serialized_bytes(one.state_dict())["json"] + plan_bytes(one),
        "merged, 4 ranks uneven": serialized_bytes(merged)["json"] + plan_bytes(ranks[0]),
    }


def changes_bytes() -> dict[int, int]:
    """One rank's state and recorded plan, in JSON bytes, after each count of online changes in `CHANGES`: a change
    after every update (one micro-batch each) from step 0 on."""
    dl, counts = _mixture(max(CHANGES), 0, 1), {}
    batches = iter(dl)
    for change in range(1, max(CHANGES) + 1):
        dl.change_mixture([1 + change % 3, 2])
        if change in CHANGES:
            counts[change] = serialized_bytes(dl.state_dict())["json"] + plan_bytes(dl)
        next(batches)
    return counts


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
    tables, changed = padding(cfg.budget_samples), changes_bytes()
    rows = [r for case in cases for r in _rows(case)] + _padding_rows(tables)
    rows += [
        {
            **row(f"mixture: state + plan bytes, one rank, after {n} online change(s)", single(b), "B"),
            "target": REPORTED,
        }
        for n, b in changed.items()
    ]
    return {
        "cases": cases,
        "padding": tables,
        "changes_bytes": changed,
        "tables": _table(cases, tables),
        "notes": [
            'Targets: issue 30 states none for these figures ("reported"); a cost ratio whose rounds\' '
            'quartiles straddle 1 reads "not resolved".',
            "A Mixture's state and recorded plan (JSON bytes, one rank) after "
            + ", ".join(f"{n} online change{'s' * (n > 1)}: {b:,}" for n, b in changed.items())
            + ".",
        ],
        "rows": rows,
    }
