"""PNG plots of the sections (matplotlib, optional: without it the plots are skipped and the record says why)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.rows import count

DPI = 100  # small files: they sit in the repository


def _ratio_bars(ax, section: dict) -> None:
    """Horizontal bars of the ratio rows, min-max whiskers, and the line at 1."""
    rows = [r for r in section["rows"] if r["unit"] == "ratio"]
    medians = [r["median"] for r in rows]
    whiskers = [[m - r["min"] for m, r in zip(medians, rows)], [r["max"] - m for m, r in zip(medians, rows)]]
    ax.barh(range(len(rows)), medians, xerr=whiskers, color="tab:blue", alpha=0.7)
    ax.set_yticks(range(len(rows)), [r["what"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio (median, min-max)")


def _lines(ax, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, xscale: str = "log") -> None:
    for label, (x, y) in series.items():
        ax.plot(x, y, marker="o", label=label)
    ax.set_xscale(xscale)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)


def _latencies(cases: list[dict], key: str) -> dict[str, tuple[list, list]]:
    return {
        f"{name} (us)": ([c[key] for c in cases], [c[field]["median"] * 1e6 for c in cases])
        for name, field in (("state_dict()", "state_dict_s"), ("merge_states()", "merge_states_s"))
    }


def _checkpoint(figure, section: dict) -> None:
    left, right = figure.subplots(1, 2)
    lockstep = [c for c in section["lockstep"] if c["position"]]
    _lines(left, _latencies(lockstep, "n"), "N (lockstep, position N/2)", "latency")
    _lines(right, _latencies(section["uneven"], "ahead"), "micro-batches rank 0 is ahead", "latency", "symlog")


def _resume(figure, section: dict) -> None:
    ax = figure.subplots()
    ours = section["ours"]
    series = {f"ours, N={count(section['n'])}": ([p["position"] for p in ours], [p["seconds"]["median"] for p in ours])}
    theirs = section["stateful"]
    series["StatefulDataLoader, N=2*position"] = (
        [p["position"] for p in theirs],
        [p["values"]["StatefulDataLoader"]["median"] for p in theirs],
    )
    _lines(ax, series, "resumed position", "load_state_dict -> first batch (s)", "symlog")
    ax.axhline(0.01, color="gray", linestyle="--", linewidth=0.8)


def _memory(figure, section: dict) -> None:
    ax = figure.subplots()
    series = {
        kind: (
            [p["n"] for p in points if "added_bytes" in p],
            [p["added_bytes"] / 1e6 for p in points if "added_bytes" in p],
        )
        for kind, points in section["points"].items()
    }
    _lines(ax, series, "N (samples in the epoch)", "peak RSS added (MB)")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)


def _bars(figure, section: dict) -> None:
    _ratio_bars(figure.subplots(), section)


def _peers_resume(ax, section: dict) -> None:
    """Resume time against N, a line per system, up to where its budget stopped it."""
    resume = {
        key: (
            [p["n"] for p in section["resume"]["points"] if key in p["values"]],
            [p["values"][key]["median"] for p in section["resume"]["points"] if key in p["values"]],
        )
        for key in section["exactly_once"]
    }
    _lines(ax, resume, "N (resumed at N/2)", "build + load -> first batch (s)")


def _peers(figure, section: dict) -> None:
    """Resume time and memory against N per system, and each system's throughput ratios."""
    figure.set_size_inches(12, 4.5)
    left, middle, right = figure.subplots(1, 3)
    keys = list(section["exactly_once"])
    _peers_resume(left, section)
    memory = {
        key: (
            [p["n"] for p in points if "added_bytes" in p],
            [max(p["added_bytes"], 1e3) / 1e6 for p in points if "added_bytes" in p],
        )
        for key, points in section["memory"].get("points", {}).items()
    }
    _lines(middle, memory, "N (resumed at N/2)", "peak RSS added (MB, floor 1 kB)")
    cases = section["throughput"]
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        medians = [case["ratios"].get(key, {}).get("median", 0.0) for case in cases]
        right.bar([c + i * width for c in range(len(cases))], medians, width, label=key)
    right.set_xticks(
        [c + 0.4 - width / 2 for c in range(len(cases))],
        [f"{case['kind']}\nworkers={case['num_workers']}" for case in cases],
        fontsize=7,
    )
    right.set_yscale("log")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_ylabel("throughput / DataLoader")


def _scale_seconds(ax, section: dict) -> None:
    points = section["points"]
    worlds = [p["world"] for p in points]
    times = {
        name: (worlds, [p[key]["median"] for p in points])
        for name, key in (
            ("merge_states, lockstep", "merge_lockstep_s"),
            ("merge_states, uneven", "merge_uneven_s"),
            ("validation of the merged state", "validate_s"),
            ("load + first batch, one rank", "load_s"),
        )
    }
    _lines(ax, times, "world size W (ranks simulated)", "seconds (median)")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)


def _scale_bytes(ax, section: dict) -> None:
    points = section["points"]
    worlds = [p["world"] for p in points]
    sizes = {
        "gather, one rank (detached)": (worlds, [p["gather_bytes_per_rank"] for p in points]),
        "gather, all ranks": (worlds, [p["gather_bytes_per_rank"] * p["world"] for p in points]),
        "merged state, lockstep": (worlds, [p["merged_bytes"]["lockstep"] for p in points]),
        "merged state, uneven": (worlds, [p["merged_bytes"]["uneven"] for p in points]),
    }
    _lines(ax, sizes, "world size W", "bytes (JSON)")


def _scale(figure, section: dict) -> None:
    """Seconds and bytes against the world size, and the lockstep store's cost under each protocol."""
    figure.set_size_inches(13, 4.5)
    left, middle, right = figure.subplots(1, 3)
    _scale_seconds(left, section)
    _scale_bytes(middle, section)
    store = section["store"]
    ranks = [p["ranks"] for p in store["points"]]
    costs = {}
    for protocol in ("every rank, every update", "turns"):
        costs[f"requests per step, {protocol}"] = (
            ranks,
            [p[protocol]["requests_per_step"]["median"] for p in store["points"]],
        )
        costs[f"step (ms), {protocol}"] = (ranks, [p[protocol]["step_s"]["median"] * 1e3 for p in store["points"]])
    costs["step (ms), the harness alone"] = (
        ranks,
        [p["none (the harness alone)"]["step_s"]["median"] * 1e3 for p in store["points"]],
    )
    _lines(right, costs, f"ranks simulated on {store['clients']:,} TCPStore clients", "lockstep check, per step")


def _holes(ax, section: dict) -> None:
    """State bytes against the holes a rank ahead leaves (section 3: two ranks, rank 0 ahead by k)."""
    cases = section["uneven"]
    holes = [max(1, c["intervals"]) for c in cases]
    _lines(
        ax,
        {
            "a rank's state after resuming (JSON)": (holes, [c["state_bytes"]["json"] for c in cases]),
            "merged state (JSON)": (holes, [c["merged_bytes"]["json"] for c in cases]),
        },
        "holes (intervals) in the committed progress",
        "bytes",
    )


_DRAW: dict[str, Callable] = {
    "throughput": _bars,
    "training": _bars,
    "checkpoint": _checkpoint,
    "resume": _resume,
    "memory": _memory,
    "webdataset": _bars,
    "tokens": _bars,
    "remote": _bars,
    "peers": _peers,
    "scale": _scale,
}
# One curve per plot as well, <stem>-<section>-<curve>.png: what a reader checks first, on a log axis.
_CURVES: dict[str, dict[str, Callable]] = {
    "peers": {"resume-vs-n": _peers_resume},
    "scale": {"merge-vs-world": _scale_seconds, "state-bytes-vs-world": _scale_bytes},
    "checkpoint": {"state-bytes-vs-holes": _holes},
}


def write(results: dict, out: Path, stem: str) -> dict:
    """One PNG per section that has data; sets section["plot"] to its file name. Returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as err:
        reason = f"matplotlib is not importable ({err}); pip install matplotlib for plots"
        print(f"benchmarks: plots skipped: {reason}", file=sys.stderr)
        return {"skipped": reason}
    files = []
    for key, section in results["sections"].items():
        if key not in _DRAW or "skipped" in section:
            continue
        bars = sum(r["unit"] == "ratio" for r in section.get("rows", [])) if _DRAW[key] is _bars else 0
        figure = pyplot.figure(figsize=(9, max(3.5, 1.0 + 0.16 * bars)), layout="constrained")  # a line a bar
        figure.suptitle(section["title"], fontsize=10)
        _DRAW[key](figure, section)
        base = stem if stem.endswith(f"-{key}") else f"{stem}-{key}"
        files.append(_save(pyplot, figure, out / f"{base}.png"))
        section["plot"] = files[-1]
        for curve, draw in _CURVES.get(key, {}).items():
            figure = pyplot.figure(figsize=(6, 4), layout="constrained")
            title = section["title"].split(" (")[0].split(":")[0]  # "11. Data parallelism at scale"
            figure.suptitle(f"{title}: {curve.replace('-', ' ')}", fontsize=9)
            draw(figure.subplots(), section)
            files.append(_save(pyplot, figure, out / f"{base}-{curve}.png"))
    return {"files": files}


def _save(pyplot, figure, path: Path) -> str:
    figure.savefig(path, dpi=DPI)
    pyplot.close(figure)
    return path.name


if __name__ == "__main__":  # python -m benchmarks.plots RESULTS.json: redraw a run's plots beside it
    import json

    path = Path(sys.argv[1])
    print(write(json.loads(path.read_text()), path.parent, path.stem))
