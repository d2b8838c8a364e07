"""The peers section: the exactly-once table, then the costs, every system in one run; its rows and tables."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.config import Config
from benchmarks.environment import usable_cpus
from benchmarks.peers import capabilities, memory, resume, throughput
from benchmarks.peers.config import PeersConfig, peers_config
from benchmarks.peers.faults import GLOBAL_BATCH, Fault, cell, exactly_once
from benchmarks.peers.store import Store
from benchmarks.peers.systems import SYSTEMS, System, load_all, versions
from benchmarks.peers.throughput import BASELINE
from benchmarks.progress import say
from benchmarks.rows import count, resolves, row, single


def _system(key: str) -> System:
    return next(s for s in SYSTEMS if s.key == key)


def _name(key: str) -> str:
    return _system(key).name


def exactly_once_table(section: dict) -> list[str]:
    """A row per system: what it drops by design (so a reader tells its tail from a resume's loss), then a cell per
    fault; a system that is not installed has its error instead."""
    faults = list(next(iter(section["exactly_once"].values()), {}))
    lines = [
        "| system (state saved under DP) | drops by design in an uninterrupted epoch | " + " | ".join(faults) + " |",
        "|---" * (len(faults) + 2) + "|",
    ]
    for key, results in section["exactly_once"].items():
        lines.append(f"| {_name(key)} | {_system(key).drops} | " + " | ".join(cell(results[f]) for f in faults) + " |")
    for key, error in section["not_run"].items():
        lines.append(f"| {_name(key)} | {_system(key).drops} | not run: {error} |" + " |" * (len(faults) - 1))
    return lines


def _resume_ms(section: dict, key: str) -> list[str]:
    cells = []
    for point in section["resume"]["points"]:
        value = point["values"].get(key)
        cells.append(f"{value['median'] * 1e3:.3g}" if value else "—")
    return cells


def _memory_mb(section: dict, key: str) -> list[str]:
    points = {p["n"]: p for p in section["memory"].get("points", {}).get(key, [])}
    return [
        _mb(points[n]["added_bytes"]) if "added_bytes" in points.get(n, {}) else "—" for n in section["memory_sizes"]
    ]


def _mb(added: int) -> str:
    """Megabytes; under 0.1 MB (page-granular readings, one of them below zero) as "< 0.1"."""
    return f"{added / 1e6:.3g}" if added >= 1e5 else "< 0.1"


def _ratio(stats: dict) -> str:
    """A throughput ratio to DataLoader, or "not resolved" where the rounds' quartiles straddle 1 (parity)."""
    if not resolves(stats, 1.0):
        return f"not resolved ({stats['q1']:.2f}-{stats['q3']:.2f})"
    return f"{stats['median']:.2g}" if stats["median"] < 0.1 else f"{stats['median']:.2f}"


def _ratios(section: dict, key: str) -> list[str]:
    return [
        f"{_ratio(case['ratios'][key])}; CPU {_ratio(case['cpu']['ratios'][key])}" if key in case["ratios"] else "—"
        for case in section["throughput"]
    ]


def costs_table(section: dict) -> list[str]:
    resume_n = [count(p["n"]) for p in section["resume"]["points"]]
    memory_n = [count(n) for n in section["memory_sizes"]]
    header = (
        ["system", "state saved at 4 ranks (B)"]
        + [f"resume ms, N={n}" for n in resume_n]
        + [f"memory MB, N={n}" for n in memory_n]
        + [f"throughput / DataLoader, {case['label']}: wall; CPU" for case in section["throughput"]]
    )
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for key, results in section["exactly_once"].items():
        state = next((r["state_bytes"] for r in results.values() if "state_bytes" in r), None)
        cells = [_name(key), f"{state:,}" if state is not None else "—"]
        cells += _resume_ms(section, key) + _memory_mb(section, key) + _ratios(section, key)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def not_measured(section: dict) -> list[str]:
    """Why a cost cell is "—": each stop of the resume sweep and each memory point not taken."""
    lines = [
        f"- {_name(key)}: resume from N={count(stop['n'])} on: {stop['why']}"
        for key, stop in section["resume"]["stopped"].items()
    ]
    lines += [
        f"- {_name(key)}: memory at N={count(p['n'])}: {p.get('error') or 'ran past ' + str(p['timed_out_s']) + ' s'}"
        for key, points in section["memory"].get("points", {}).items()
        for p in points
        if "added_bytes" not in p
    ]
    return ["", 'Not measured ("—"):', ""] + lines if lines else []


def saves_table(section: dict) -> list[str]:
    lines = ["| system | version | how it saves state under data parallelism | as measured |", "|---|---|---|---|"]
    for system in SYSTEMS:
        version = section["versions"][system.distribution]
        how = section["saves"].get(system.key, "not run: " + section["not_run"].get(system.key, ""))
        lines.append(f"| {system.name} | {system.distribution} {version} | {how} | {system.note} |")
    return lines


def throughput_note(section: dict) -> list[str]:
    """How the throughput cells were measured: rounds, load, the verdict, what the baseline pays."""
    loads = [load for case in section["throughput"] for load in case["load_average"]]
    rounds = section["throughput"][0]["values"][BASELINE]["n"] if section["throughput"] else 0
    return [
        "",
        f"Throughput: {rounds} interleaved rounds per case at a load average of {min(loads, default=0):.1f}-"
        f"{max(loads, default=0):.1f} (1-minute, before and after each case) on {usable_cpus()} usable CPUs. Each "
        "cell is the median per-round ratio to DataLoader in samples per wall-clock second, then in samples per "
        "CPU second (this process and its worker processes: what the loader costs, whatever else runs); "
        '"not resolved (q1-q3)" where the quartiles of the rounds straddle 1, so the rounds do not say '
        "which is faster. Timing runs from every worker's first batch to the last batch: start-up and the end "
        "of the pass are left out for every system (DataLoader's `RandomSampler` draws the next pass's whole "
        "permutation when a pass ends, which a timed end of pass would charge to the baseline alone).",
    ]


def _script(pc: PeersConfig) -> str:
    return (
        f"N = {pc.n:,} samples whose item is its index, shuffled, global batch {GLOBAL_BATCH} at every world size "
        f"(micro-batch 48 / (W x grad_accum)); 4 ranks stop after {pc.stop_updates} optimizer updates "
        f"({pc.stop_updates * GLOBAL_BATCH:,} samples), save as the system documents, and a new launch at W "
        "ranks runs to the end of the epoch. Uneven: rank 1 one micro-batch ahead of rank 0 and rank 2 one "
        "behind at the stop (DDP Join, uneven inputs). Global batch 48→96: the restart runs at a global batch of "
        f"96 after {Fault(4, 4, batch_after=96).updates(pc.stop_updates)} updates of 48 (an odd count: a batch-size "
        "ramp's step; ours is given the "
        "schedule as a BatchPolicy ramp, every other system the new batch size at the restart). A cell is "
        'skipped / duplicated samples over the whole epoch, counted by identity; "no restart" is the epoch '
        "run uninterrupted (the system's own tail handling: padding with repeats, or drops; the second column "
        "says which), so a resume's own loss is a cell's skips beyond its \"no restart\" ones."
    )


def errors(section: dict) -> list[str]:
    """The full error behind each "cannot resume" or "error" cell, once per system and message."""
    seen = {
        (key, r.get("cannot_resume") or r.get("error"))
        for key, results in section["exactly_once"].items()
        for r in results.values()
        if "cannot_resume" in r or "error" in r
    }
    return ["", "Errors:", ""] + [f"- {_name(key)}: {message}" for key, message in sorted(seen)] if seen else []


def tables(section: dict, script: str) -> list[str]:
    """The section's Markdown: the exactly-once table, the costs (where measured), how each system saves, the
    versions."""
    versions = ", ".join(f"{name} {v}" for name, v in section["versions"].items())
    costs = (
        (
            ["", "### Costs (one rank; resume and memory at N/2; medians; every measurement's spread is below)", ""]
            + costs_table(section)
            + throughput_note(section)
            + not_measured(section)
        )
        if "resume" in section
        else []
    )
    return (
        ["### Exactly once: skipped / duplicated samples, by identity", "", script, ""]
        + exactly_once_table(section)
        + errors(section)
        + [
            "",
            "### The capabilities of issue 30: filter, packing, mixture",
            "",
            capabilities.script(section["capabilities"]),
            "",
        ]
        + capabilities.table(section["capabilities"])
        + costs
        + ["", "### How each system saves its state", ""]
        + saves_table(section)
        + ["", f"Versions: {versions}."]
    )


def _rows(section: dict) -> list[dict]:
    rows = []
    for key, results in section["exactly_once"].items():
        state = next((r["state_bytes"] for r in results.values() if "state_bytes" in r), None)
        if state is not None:
            rows.append(row(f"{_name(key)}: state saved at 4 ranks", single(state), "bytes"))
    if "resume" not in section:  # the counts alone (`--sections peers-exact`): no timings
        return rows
    for point in section["resume"]["points"]:
        rows += [
            row(f"{_name(key)}: resume at N/2, N={count(point['n'])}", stats, "ms", scale=1e3)
            for key, stats in point["values"].items()
        ]
    for key, points in section["memory"].get("points", {}).items():
        rows += [
            row(f"{_name(key)}: memory at N={count(p['n'])}", single(p["added_bytes"]), "MB", scale=1e-6)
            for p in points
            if "added_bytes" in p
        ]
    for case in section["throughput"]:
        rows += [
            row(f"{case['label']}: {_name(key)} / DataLoader", ratio, "ratio") for key, ratio in case["ratios"].items()
        ]
        rows += [
            row(f"{case['label']}: {_name(key)} / DataLoader, per CPU second", ratio, "ratio")
            for key, ratio in case["cpu"]["ratios"].items()
        ]
    return rows


def _exactly_once(pc: PeersConfig) -> dict:
    """The exactly-once table of every installed system, and why the others were not run."""
    peers, not_run = load_all()
    for key, error in not_run.items():
        say("peers", f"{_name(key)} not run: {error}")
    section = {
        "versions": versions(),
        "saves": {key: peer.saves for key, peer in peers.items()},
        "not_run": not_run,
        "n": pc.n,
        "global_batch": GLOBAL_BATCH,
        "stop_updates": pc.stop_updates,
        "memory_sizes": list(pc.memory_sizes),
        "exactly_once": {},
        "seconds": {},
    }
    for key, peer in peers.items():
        start = time.perf_counter()
        say("peers", f"exactly-once: {_name(key)}")
        section["exactly_once"][key] = exactly_once(
            peer, _system(key).module, pc.n, pc.stop_updates, pc.faults, pc.launch_timeout_s
        )
        section["seconds"][f"exactly_once {key}"] = time.perf_counter() - start
    section["capabilities"] = capabilities.run(pc)
    return section


def run_exact(cfg: Config) -> dict:
    """The counts alone, no timings (`--sections peers-exact`): exact on any machine, whatever its load."""
    pc = peers_config(cfg.mode)
    section = _exactly_once(pc)
    section["rows"] = _rows(section)
    section["tables"] = tables(section, _script(pc))
    return section


def run(cfg: Config) -> dict:
    pc: PeersConfig = peers_config(cfg.mode)
    section = _exactly_once(pc)
    peers = {key: _system(key).load() for key in section["exactly_once"]}
    with tempfile.TemporaryDirectory(prefix="loader-peers-costs-") as directory:
        store = Store(Path(directory), pc.write_budget_s)
        section["resume"] = resume.run(pc, peers, store, cfg.reps, cfg.warmup)
        section["memory"] = memory.run(pc, peers, store)
        section["throughput"] = throughput.run(pc, peers, store, pc.throughput_reps, cfg.warmup)
    section["rows"] = _rows(section)
    section["tables"] = tables(section, _script(pc))
    return section
