"""Headline rows: what each section claims, as a median with its spread and the target it is read against.

Targets are reported (met or missed), never asserted: a benchmark measures, it does not pass or fail.
"""

from __future__ import annotations

import operator

from benchmarks.timing import summary

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def row(what: str, stats: dict, unit: str, target: str | None = None, scale: float = 1.0) -> dict:
    """One headline: `stats` (a timing.summary) shown in `unit` after multiplying by `scale`; `target` such as
    ">= 0.99" is checked against the median, unless the rounds' quartiles straddle its bound: then the rounds do
    not resolve it, and `met` is None with `resolved` False."""
    shown = {key: stats[key] * scale for key in ("median", "min", "max")}
    shown.update(q1=stats.get("q1", stats["min"]) * scale, q3=stats.get("q3", stats["max"]) * scale)
    met = None
    if target is not None:
        op, bound = target.split()
        if not resolves({**shown, "n": stats.get("n", 1)}, float(bound)):
            return {"what": what, "unit": unit, **shown, "target": target, "met": None, "resolved": False}
        met = bool(_OPS[op](shown["median"], float(bound)))
    return {"what": what, "unit": unit, **shown, "target": target, "met": met}


def resolves(stats: dict, bound: float) -> bool:
    """Whether repeated rounds place a measurement on one side of `bound`: their quartiles (the middle half of the
    rounds) do not straddle it. One round resolves nothing of the kind, and is not asked (smoke runs)."""
    return stats["n"] < 2 or not stats["q1"] <= bound <= stats["q3"]


def single(value: float) -> dict:
    """A one-off value (a size in bytes, a plan) in the shape of a summary, so it fits a row."""
    return summary([value])


def count(n: int) -> str:
    """Sample counts for labels: 500000000 -> 5e8, 1500000 -> 1.5e6, below 1000 as they are."""
    if n < 1000:
        return str(n)
    mantissa, exponent = f"{n:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
