"""`python -m loader audit RUN_DIR --plot out.png`: the run's epochs in one picture, read at a glance.

Top: each launch's position in the epoch (samples consumed by all ranks) after every optimizer step, from the identity
ledger; a new launch starts at a dashed line, labelled with its world size, from the position its checkpoint committed;
steps that a later launch replayed are hollow and do not count; batches that failed to load and deliveries of a
duplicated sample are marked on the step that delivered them. Bottom: each epoch's dataset indices, coloured by what the
audit found: seen once, skipped, duplicated, failed to load, dropped by policy, filtered by policy (the loader's
`filter=`), skipped on request (`dl.skip`), or not yet seen (an epoch in progress). The drawn categories are returned
(`Picture`) so a test can hold them against the audit's counts. matplotlib (the `bench` extra) is imported only here."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loader.checkpoint.audit import EpochAudit, EpochTally, audit_records, read_indexed, tally
from loader.checkpoint.ledger import Generation, Record

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# what an index of an epoch was, by severity: a bin of many indices shows the most severe one it holds
ONCE, NOT_YET, DROPPED, FILTERED, REQUESTED, FAILED, SKIPPED, DUPLICATED = range(8)
CATEGORIES = (
    "seen once",
    "not yet seen",
    "dropped by policy",
    "filtered by policy",
    "skipped on request",
    "failed to load",
    "skipped",
    "duplicated",
)
COLOURS = ("#b8e186", "#eeeeee", "#969696", "#c2a5cf", "#4393c3", "#7b3294", "#ff9d00", "#d7191c")
MAX_COLUMNS = 800  # bins of a strip: one per index up to this many indices
MAX_STRIPS = 12  # epochs drawn as strips: the unclean ones first, then the latest
MARKED_STEPS = 2000  # beyond this many steps a launch's line has no per-step markers


@dataclass(frozen=True)
class Line:
    """One launch's positions in one epoch, after each of its steps; `counted` False: replayed by a later launch."""

    generation: int
    epoch: int
    steps: np.ndarray
    positions: np.ndarray
    counted: np.ndarray


@dataclass(frozen=True)
class Picture:
    """What `plot` drew: the launches, their lines, the marked steps, and per epoch the count of indices drawn in
    each category (keys of CATEGORIES)."""

    launches: list[Generation]
    ranks: dict[int, int]  # per launch: its world size (or the ranks that wrote to its ledger, if more)
    lines: list[Line]
    failed_at: list[tuple[int, int]]  # (step, position) of each counted batch that failed to load
    duplicated_at: list[tuple[int, int]]  # (step, position) of each counted delivery of a duplicated sample
    categories: dict[int, dict[str, int]] = field(default_factory=dict)


def categories_of(
    t: EpochTally, dropped: np.ndarray | None, requested: np.ndarray, num_samples: int, columns: int
) -> tuple[np.ndarray, np.ndarray]:
    """How many indices of the epoch fall in each category (codes above), and its strip: `columns` bins of
    near-equal width, each the most severe category among its indices. From the tally's distinct indices and the
    rest as what none of them covers (O(indices recorded + columns) memory, never O(N)). An index is duplicated
    when consumed twice or more (trained or filtered: see `EpochTally`); else failed when its batch failed; else
    seen once when trained, filtered by policy when the loader's filter dropped it; else skipped on request,
    dropped by policy (`dropped`: None when the epoch is unfinished), or what is left: skipped, or not yet seen in
    an unfinished epoch. One served or filtered although skipped on request is drawn as it was consumed, as the
    audit counts it."""
    empty = np.zeros(0, np.int64)
    failed = np.setdiff1d(t.failed, t.duplicated, assume_unique=True)
    once = np.setdiff1d(t.once, failed, assume_unique=True)
    filtered = np.setdiff1d(t.filtered_once, failed, assume_unique=True)
    consumed = np.union1d(np.union1d(t.delivered, t.filtered), t.failed)
    asked = np.setdiff1d(requested, consumed, assume_unique=True)
    lost = empty if dropped is None else np.setdiff1d(np.unique(dropped), consumed)
    lost = np.setdiff1d(lost, asked, assume_unique=True)
    members = {
        ONCE: once,
        DROPPED: lost,
        FILTERED: filtered,
        REQUESTED: asked,
        FAILED: failed,
        DUPLICATED: t.duplicated,
    }
    accounted = np.concatenate(list(members.values()))
    rest = SKIPPED if dropped is not None else NOT_YET
    counts = np.zeros(len(CATEGORIES), np.int64)
    for code, indices in members.items():
        counts[code] = len(indices)
    counts[rest] = num_samples - len(accounted)
    edges = np.linspace(0, num_samples, columns + 1).astype(np.int64)
    strip = np.full(columns, ONCE, np.int8)
    for code, indices in sorted(members.items()):
        np.maximum.at(strip, np.searchsorted(edges, indices, side="right") - 1, code)
    covered = np.bincount(np.searchsorted(edges, accounted, side="right") - 1, minlength=columns)
    strip[covered < np.diff(edges)] = np.maximum(strip[covered < np.diff(edges)], rest)
    return counts, strip


def _lines(generations: list[Generation], records: list[Record]) -> list[Line]:
    """Per launch and epoch: the samples each step consumed (delivered or failed, all ranks), accumulated from the
    position that launch's checkpoint committed in that epoch."""
    committed: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # epoch -> step -> samples
    handed: dict[tuple[int, int], dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [0, True]))
    for r in records:
        if r.counted:
            committed[r.epoch][r.step] += len(r.indices)
        step = handed[r.generation, r.epoch][r.step]
        step[0] += len(r.indices)
        step[1] &= r.counted
    resumed = {g.number: g.resumed_step for g in generations}
    lines = []
    for (generation, epoch), by_step in sorted(handed.items()):
        steps = np.array(sorted(by_step), dtype=np.int64)
        start = sum(n for s, n in committed[epoch].items() if s <= resumed[generation])
        positions = start + np.cumsum([by_step[s][0] for s in steps.tolist()], dtype=np.int64)
        counted = np.array([by_step[s][1] for s in steps.tolist()], dtype=bool)
        lines.append(Line(generation, epoch, steps, positions, counted))
    return lines


def _marks(lines: list[Line], records: list[Record], report: list[EpochAudit]) -> tuple[list, list]:
    """(step, position) of the failed batches and of the deliveries of duplicated samples among the counted
    `records`."""
    where = {
        (line.epoch, int(s)): int(p) for line in lines for s, p, c in zip(line.steps, line.positions, line.counted) if c
    }
    duplicated = {e.epoch: e.duplicated for e in report}
    failed_at, duplicated_at = [], []
    for r in records:
        if r.failed:
            failed_at.append((r.step, where[r.epoch, r.step]))
        elif np.isin(r.indices, duplicated.get(r.epoch, ()), assume_unique=False).any():
            duplicated_at.append((r.step, where[r.epoch, r.step]))
    return sorted(set(failed_at)), sorted(set(duplicated_at))


def _shown(report: list[EpochAudit]) -> list[EpochAudit]:
    """The epochs drawn as strips: all, or the unclean ones (in order) and then the latest, MAX_STRIPS at most."""
    if len(report) <= MAX_STRIPS:
        return report
    unclean = [e for e in report if not e.clean or len(e.failed)]
    chosen = {e.epoch for e in unclean[:MAX_STRIPS]}
    for e in reversed(report):
        if len(chosen) >= MAX_STRIPS:
            break
        chosen.add(e.epoch)
    return [e for e in report if e.epoch in chosen]


def require_matplotlib() -> None:
    """Raise ImportError, saying what to install, where matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "audit --plot draws with matplotlib, which is not installed: pip install 'loader[bench]' "
            "(or pip install matplotlib)"
        ) from err


def _figure(width: float, height: float) -> Figure:
    """A figure of its own, outside pyplot's global state (no backend switched, nothing left open)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot(run_dir: str | os.PathLike, out: str | os.PathLike) -> Picture:
    """Draw the run's picture (see the module docstring) into the PNG `out`; returns what was drawn."""
    require_matplotlib()
    run = read_indexed(run_dir)
    generations, records, dropped, requested = run.generations, run.records, run.dropped, run.requested
    counted = [r for r in records if r.counted]
    num_samples = run.num_samples
    report = audit_records(counted, dropped, num_samples, requested=requested)
    finished = {e.epoch for e in report if e.finished}
    lines = _lines(generations, records)
    failed_at, duplicated_at = _marks(lines, counted, report)
    strips, categories = {}, {}
    for t in tally(counted, set(dropped) | set(requested)):
        found, strips[t.epoch] = categories_of(
            t,
            dropped.get(t.epoch, np.zeros(0, np.int64)) if t.epoch in finished else None,
            np.unique(requested.get(t.epoch, np.zeros(0, np.int64))),
            num_samples,
            min(num_samples, MAX_COLUMNS),
        )
        categories[t.epoch] = {name: int(n) for name, n in zip(CATEGORIES, found)}
    wrote = defaultdict(set)
    for r in records:
        wrote[r.generation].add(r.rank)
    ranks = {g.number: max(g.world_size, len(wrote[g.number])) for g in generations}
    picture = Picture(generations, ranks, lines, failed_at, duplicated_at, categories)
    _draw(picture, report, strips, num_samples, run_dir, out)
    return picture


def _draw(
    picture: Picture,
    report: list[EpochAudit],
    strips: dict,
    num_samples: int,
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
) -> None:
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    shown = _shown(report)
    figure = _figure(12, 4.6 + 0.42 * len(shown))
    top, bottom = figure.subplots(2, 1, height_ratios=[4.6, 0.42 * len(shown) + 0.5])
    colours = {g.number: f"C{i % 10}" for i, g in enumerate(picture.launches)}  # a launch without records: none
    for line in picture.lines:
        colour, marked = colours[line.generation], len(line.steps) <= MARKED_STEPS
        kept, replayed = line.counted, ~line.counted
        top.plot(line.steps[kept], line.positions[kept], color=colour, lw=1.6)
        if replayed.any():  # drawn on top, dashed and hollow: the steps a later launch did again
            tail = slice(max(int(np.argmax(replayed)) - 1, 0), None)
            top.plot(line.steps[tail], line.positions[tail], color=colour, lw=1.2, ls="--", zorder=4)
        if marked:
            top.scatter(line.steps[kept], line.positions[kept], s=14, color=colour, zorder=3)
            top.scatter(
                line.steps[replayed],
                line.positions[replayed],
                s=46,
                facecolors="none",
                edgecolors=colour,
                linewidths=1.4,
                zorder=5,
            )
    ymax = max([int(line.positions.max()) for line in picture.lines] + [num_samples])
    last_step = {g: max(int(line.steps.max()) for line in picture.lines if line.generation == g) for g in colours}
    for i, g in enumerate(picture.launches):
        x = g.resumed_step + 0.5
        if i:
            top.axvline(x, color=colours[g.number], ls="--", lw=1)
            earlier = picture.launches[i - 1].number
            if last_step.get(earlier, 0) > g.resumed_step:  # the earlier launch's steps this one replays
                top.axvspan(x, last_step[earlier] + 0.5, color=colours[earlier], alpha=0.08, lw=0)
        ranks = picture.ranks[g.number]
        top.text(
            x,
            ymax * (1.02 + 0.045 * (i % 2)),
            f" launch {g.number}: {ranks} rank{'s' * (ranks != 1)}",
            color=colours[g.number],
            fontsize=9,
            va="bottom",
        )
    for epoch in sorted({line.epoch for line in picture.lines})[1:]:
        first = min(int(line.steps.min()) for line in picture.lines if line.epoch == epoch)
        top.axvline(first - 0.5, color="0.6", ls=":", lw=1)
        top.text(first - 0.5, ymax * 0.95, f" epoch {epoch}", color="0.4", fontsize=8, va="top")
    for points, colour, marker, label in (
        (picture.failed_at, COLOURS[FAILED], "X", "failed to load"),
        (picture.duplicated_at, COLOURS[DUPLICATED], "D", "delivered a duplicate"),
    ):
        if points:
            xs, ys = zip(*points)
            top.scatter(xs, ys, marker=marker, s=60, color=colour, zorder=4, label=f"{label} ({len(points):,} steps)")
    if any((~line.counted).any() for line in picture.lines):
        top.scatter(
            [],
            [],
            s=46,
            facecolors="none",
            edgecolors="black",
            linewidths=1.4,
            label="replayed by a later launch (not counted)",
        )
    top.set_ylim(0, ymax * 1.14)
    top.set_xlim(left=min(g.resumed_step for g in picture.launches))
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_xlabel("optimizer step")
    top.set_ylabel("position in the epoch\n(samples consumed, all ranks)")
    if top.get_legend_handles_labels()[0]:
        top.legend(loc="upper left", bbox_to_anchor=(0, 0.88), fontsize=8, framealpha=0.9)
    top.grid(alpha=0.25)
    verdict = (
        "every sample exactly once"
        if all(e.clean and e.finished for e in report)
        else "SKIPPED OR DUPLICATED SAMPLES"
        if not all(e.clean for e in report)
        else "unfinished, nothing duplicated"
    )
    omitted = f" ({len(report) - len(shown)} clean epochs not drawn)" if len(shown) < len(report) else ""
    top.set_title(f"{Path(run_dir).name}: {len(picture.launches)} launch(es), audit: {verdict}{omitted}", fontsize=11)

    image = np.full((len(shown), MAX_COLUMNS if num_samples > MAX_COLUMNS else num_samples), ONCE, dtype=np.int8)
    for row, e in enumerate(shown):
        image[row, : len(strips[e.epoch])] = strips[e.epoch]
    bottom.imshow(
        image,
        aspect="auto",
        interpolation="nearest",
        cmap=ListedColormap(COLOURS),
        vmin=0,
        vmax=len(COLOURS) - 1,
        extent=(0, num_samples, len(shown) - 0.5, -0.5),
    )
    bottom.set_yticks(range(len(shown)))
    bottom.set_yticklabels([_row_label(e, picture.categories[e.epoch]) for e in shown], fontsize=8)
    bottom.set_xlabel(
        "dataset index"
        + (f" ({num_samples // MAX_COLUMNS}+ per column: its most severe)" if num_samples > MAX_COLUMNS else "")
    )
    totals = {name: sum(c[name] for c in picture.categories.values()) for name in CATEGORIES}
    figure.legend(
        handles=[
            Patch(color=c, label=f"{name} ({totals[name]:,})")
            for name, c in zip(CATEGORIES, COLOURS)
            if totals[name] or name in ("seen once", "skipped", "duplicated")
        ],
        loc="outside lower center",
        ncol=len(CATEGORIES),
        fontsize=8,
        frameon=False,
    )
    figure.savefig(out)


def _row_label(e: EpochAudit, drawn: dict[str, int]) -> str:
    problems = [
        f"{drawn[name]:,} {name}"
        for name in ("skipped", "duplicated", "failed to load", "skipped on request")
        if drawn[name]
    ]
    state = "" if e.finished else ", in progress"
    return f"epoch {e.epoch}{state}: " + (", ".join(problems) if problems else "clean")
