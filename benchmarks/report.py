"""The results as files: the full JSON (every sample, for re-analysis) and a Markdown table of the headline rows."""

from __future__ import annotations

import json
from pathlib import Path


def number(value: float) -> str:
    """Three significant digits, or a whole number with separators once it has four digits or more."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _verdict(r: dict) -> str:
    if r.get("resolved") is False:
        return f"not resolved (quartiles {number(r['q1'])} - {number(r['q3'])})"
    return "" if r["met"] is None else "yes" if r["met"] else "**no**"


def _table(rows: list[dict], graded: bool) -> list[str]:
    """The rows; without the `met` column when the run is not graded (smoke)."""
    lines = [
        "| measurement | median | spread (min - max) | unit | target |" + (" met |" if graded else ""),
        "| --- | ---: | --- | --- | --- |" + (" --- |" if graded else ""),
    ]
    for r in rows:
        spread = "" if r["min"] == r["max"] else f"{number(r['min'])} - {number(r['max'])}"
        target = r["target"] or ""
        met = f" {_verdict(r)} |" if graded else ""
        lines.append(f"| {r['what']} | {number(r['median'])} | {spread} | {r['unit']} | {target} |{met}")
    return lines


def _header(results: dict) -> list[str]:
    env, cfg = results["environment"], results["config"]
    commit = (env["git_commit"] or "unknown")[:12] + (" (uncommitted changes)" if env["git_dirty"] else "")
    load = env["load_average_at_start"]
    return [
        f"# loader benchmarks: {results['mode']} mode, {env['device']} ({env['device_name']})",
        "",
        f"torch {env['torch']}, numpy {env['numpy']}, torchdata {env['torchdata']}, webdataset {env['webdataset']}, "
        f"Python {env['python']}; {env['cpus_usable']} usable CPUs; commit {commit}"
        + (f"; load average at start {load[0]:.2f}" if load else "")
        + (f", at end {end[0]:.2f}" if (end := env.get("load_average_at_end")) else "")
        + ".",
        "",
        f"Ratios are medians of per-round ratios of candidates run interleaved in one process ({cfg['reps']} rounds "
        f"after {cfg['warmup']} warm-up); the spread is their min - max. Targets are read, not asserted: where the "
        'rounds\' quartiles straddle a target, it reads "not resolved".'
        + (
            " A smoke run (one repetition, tiny sizes) shows that the suite runs: its figures are not graded against "
            "the targets."
            if results["mode"] == "smoke"
            else ""
        ),
    ] + (["", f"Note on this run: {note}"] if (note := results.get("note")) else [])


def markdown(results: dict) -> str:
    lines = _header(results)
    for section in results["sections"].values():
        lines += ["", f"## {section['title']}", ""]
        if "skipped" in section:
            lines.append(f"Skipped: {section['skipped']}")
            continue
        lines += [f"Note: {note}" for note in section.get("notes", ())] + ([""] if section.get("notes") else [])
        if section.get("tables"):
            lines += section["tables"] + ["", "### Every measurement", ""]
        lines += _table(section["rows"], graded=results["mode"] != "smoke")
        if section.get("plot"):
            lines += ["", f"![{section['title']}]({section['plot']})"]
    plots = results["plots"]
    if "skipped" in plots:
        lines += ["", f"Plots skipped: {plots['skipped']}"]
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path, stem: str) -> list[Path]:
    """Write <out>/<stem>.json and <out>/<stem>.md; return their paths."""
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(markdown(results))
    return [json_path, md_path]
