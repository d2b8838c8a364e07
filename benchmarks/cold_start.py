"""14. Cold start after a restart (`--sections cold-start`): seconds from starting a process to its first batch
(the interpreter, the imports, building the loader, reading and loading the state file, the first batch, workers
included), every run a fresh process (`python -m benchmarks.first_batch`), against torch's DataLoader's own cold
start of the same pipeline (which has no resume: it starts the epoch).

Pipelines: a map-style dataset (an index per sample, N = `cold_samples`, shuffled); a packed token source
(`PackedSource` best fit over EOS-terminated documents, shuffled: each row packs its window, under either loader);
WebDataset shards in moto's S3 server on loopback (section 8), read through the node cache, warm (every copy and
index already in it, as after a restart on the same node) and cold (the cache directory emptied before each run, a
new node: the indexes are read from next to the shards, where `python -m loader index` put them, and the first
batch's shard is downloaded); torch's DataLoader reads the shards in order there (one shard for its first batch, as
ours with `shuffle_blocks`). Ours resumes at the start, the middle and near the end of the epoch (two batches
left); with 2 and 8 workers at all three on the map-style pipeline, at the middle on the others. Peers resume at
the middle through their adapters (`benchmarks/peers/`, num_workers=0, what their adapters' `first_batch` runs):
Grain and LitData on the map-style case, OLMo-core (fixed-length instances of one token file, its own packing-free
pipeline) on the packed one. All candidates of a pipeline and a worker count run
interleaved, a new order each round; each run gives wall seconds (the parent's clock before the process started to
the child's at its first batch: Linux's monotonic clock is system-wide) and CPU seconds (the process and its
workers at the first batch), and the split of the wall time (start -> imports done, build, state load, first batch).
The project's modules are compiled to bytecode first, as `pip install` does: where bytecode is not written
(PYTHONDONTWRITEBYTECODE, as on this VM) every start would compile `loader` from source again (`import loader` after
torch: 63-67 ms of CPU against 16-18 ms from bytecode, torch's own import 1.2-1.4 s), which no installed copy pays.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from benchmarks.config import FULL, Config
from benchmarks.environment import environment
from benchmarks.first_batch import loader_of
from benchmarks.memory import in_child
from benchmarks.progress import say
from benchmarks.rows import count, row
from benchmarks.states import global_state_at
from benchmarks.timing import interleave, result_of, summary

BASELINE = "DataLoader"
CONTROL = "DataLoader again"  # an A/A candidate (`Config.cold_control`)
TARGET = "<= 1.1"  # ours / DataLoader's cold start, at every position (issue 32)
BATCH = 64
PACKED = {"seq_len": 512, "rows": 64, "fill": 0.99, "eos": 0}
PARTS = ("start -> imports", "build", "state load", "first batch")  # the wall time's split
PEERS = {"map": ("grain_index", "lit"), "packed": ("olmo",)}
CLOCKS = {"wall": "s", "cpu": "CPU s"}
RECHECKED = ("map", "packed", "webdataset-cold", "webdataset-warm")  # what `recheck` runs alone
EVERY_POSITION = ("map",)  # ours at every position with every worker count; elsewhere with 0 workers (the middle
# with more): each run is a fresh process of seconds on a 2-core VM


def positions(n: int, batch: int) -> dict[str, int]:
    """Where ours resumes: the epoch's start, its middle and two batches before its end (batch multiples)."""
    batches = n // batch
    return {"start": 0, "middle": batches // 2 * batch, "end": max(0, batches - 2) * batch}


def cold_start(spec_path: Path, timeout_s: float, before: Callable[[], None] | None = None) -> dict[str, float]:
    """One fresh process to its first batch: wall and CPU seconds and the wall time's parts (`PARTS`); `before`
    runs first, untimed (emptying a cache). A child that fails is run once more, said (OLMo-core's aborted once in
    hundreds at its interpreter's exit: "terminate called without an active exception"); a second failure raises."""
    for attempt in (1, 2):
        if before is not None:
            before()
        start = time.monotonic()
        try:
            out = in_child("benchmarks.first_batch", [str(spec_path)], timeout_s)
            break
        except RuntimeError as exn:
            if attempt == 2:
                raise
            say("cold-start", f"{spec_path.name} failed, run again: {str(exn)[-300:]}")
    if "timed_out_s" in out:
        raise RuntimeError(f"{spec_path.name}: no first batch within {timeout_s:.0f} s")
    s = out["stamps"]
    built, loaded = s.get("built", s["imported"]), s.get("loaded", s["imported"])
    parts = (s["imported"] - start, built - s["imported"], loaded - built, s["first"] - loaded)
    return {"wall": s["first"] - start, "cpu": out["cpu_s"], **dict(zip(PARTS, parts))}


def _write(directory: Path, name: str, spec: dict, state=None) -> Path:
    """The spec (and its state file, JSON; a peer's bytes state as {"bytes": text}) of one candidate."""
    if state is not None:
        state_path = directory / f"{name}.state.json"
        state_path.write_text(json.dumps({"bytes": state.decode()} if isinstance(state, bytes) else state))
        spec = {**spec, "state": str(state_path)}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(spec))
    return path


def _ours_state(spec: dict, position: int) -> dict:
    dataset = loader_of(spec).dataset
    blocks = {"shuffle_blocks": dataset.shard_sizes} if spec["pipeline"] == "webdataset" else {}
    return global_state_at(dataset, spec["batch_size"], position, **blocks)


def _peer_specs(cfg: Config, directory: Path, pipeline: str, n: int, spec: dict) -> tuple[dict[str, Path], list]:
    """Each peer's spec at the middle of its own copy of the data (num_workers=0), or why it is not measured."""
    from benchmarks.peers.systems import SYSTEMS

    specs, notes = {}, []
    for key in PEERS.get(pipeline, ()):
        system = next(s for s in SYSTEMS if s.key == key)
        try:
            peer, data = system.load(), directory / f"{key}-data"
            if not data.exists():
                peer.prepare(n, data)
            state = peer.state_at(n, data, BATCH, positions(n, BATCH)["middle"])
        except Exception as err:  # a peer that is not installed or refuses is reported, never raised
            notes.append(f"{system.name} not measured on {pipeline}: {type(err).__name__}: {str(err)[:200]}")
            continue
        peer_spec = {**spec, "system": key, "n": n, "data": str(data), "num_workers": 0}
        specs[f"{system.name} at middle"] = _write(directory, f"{pipeline}-{key}", peer_spec, state)
    return specs, notes


def candidate_specs(directory: Path, label: str, spec: dict, n: int) -> dict[str, Path]:
    """The spec files of DataLoader and ours (at every position with 0 workers or map-style, the middle
    otherwise) for one pipeline at one worker count."""
    workers = spec["num_workers"]
    tag = f"{label}-w{workers}"
    specs = {BASELINE: _write(directory, f"{tag}-torch", {**spec, "system": "torch"})}
    every = workers == 0 or label in EVERY_POSITION
    for where, position in positions(n, BATCH).items() if every else [("middle", positions(n, BATCH)["middle"])]:
        ours = {**spec, "system": "ours"}
        specs[f"ours at {where}"] = _write(directory, f"{tag}-ours-{where}", ours, _ours_state(ours, position))
    return specs


def _case(cfg: Config, directory: Path, label: str, spec: dict, n: int, peers: dict, before=None) -> dict:
    """Every candidate of one pipeline at one worker count, interleaved."""
    workers = spec["num_workers"]
    specs = candidate_specs(directory, label, spec, n)
    if workers == 0:
        specs |= peers
    if cfg.cold_control:
        specs[CONTROL] = specs[BASELINE]
    candidates = {name: partial(cold_start, path, cfg.cold_timeout_s, before) for name, path in specs.items()}
    load = os.getloadavg()[0]
    samples = interleave(candidates, cfg.cold_reps, cfg.warmup, f"cold start {label} workers={workers}", "s")
    per_key = {key: {name: [one[key] for one in values] for name, values in samples.items()} for key in CLOCKS}
    return {
        "pipeline": label,
        "num_workers": workers,
        "n": n,
        "load_average": [load, os.getloadavg()[0]],
        **{clock: result_of(per_key[clock], BASELINE, unit) for clock, unit in CLOCKS.items()},
        "parts": {name: {p: summary([one[p] for one in values]) for p in PARTS} for name, values in samples.items()},
    }


def _rows(case: dict) -> list[dict]:
    label = f"{case['pipeline']}, workers={case['num_workers']}"
    baseline = case["wall"]["values"][BASELINE]
    rows = [row(f"{label}: DataLoader cold start (process start -> first batch)", baseline, "s")]
    for clock in CLOCKS:
        for name, ratio in case[clock]["ratios"].items():
            target = TARGET if name.startswith("ours") else None
            rows.append(row(f"{label}: {name} / DataLoader cold start, {clock}", ratio, "ratio", target))
    return rows


def _table(cases: list[dict]) -> list[str]:
    """The wall time's split, medians in ms: ours at the middle against DataLoader, per pipeline and workers."""
    lines = [
        "Where the time goes (medians, ms): " + ", ".join(PARTS) + "; DataLoader / ours at the middle.",
        "",
        "| pipeline | workers | " + " | ".join(PARTS) + " | total |",
        "| --- | ---: |" + " ---: |" * (len(PARTS) + 1),
    ]
    for case in cases:
        torch_parts, ours_parts = case["parts"][BASELINE], case["parts"]["ours at middle"]
        cells = [f"{torch_parts[p]['median'] * 1e3:.0f} / {ours_parts[p]['median'] * 1e3:.0f}" for p in PARTS]
        total = f"{case['wall']['values'][BASELINE]['median'] * 1e3:.0f} / "
        total += f"{case['wall']['values']['ours at middle']['median'] * 1e3:.0f}"
        lines.append(f"| {case['pipeline']} | {case['num_workers']} | " + " | ".join(cells) + f" | {total} |")
    return lines


def local_specs(cfg: Config, directory: Path, pipelines: tuple[str, ...]) -> dict[str, dict]:
    """The map-style and packed pipelines' specs at 0 workers (the packed one's token file written)."""
    from benchmarks.packing import write_documents

    tokens = directory / "documents.bin"
    if "packed" in pipelines:
        write_documents(tokens, cfg.cold_tokens, PACKED["seq_len"])
    specs = {
        "map": {"pipeline": "map", "n": cfg.cold_samples, "torch_shuffle": True},
        "packed": {"pipeline": "packed", "data": str(tokens), "torch_shuffle": True, **PACKED},
    }
    return {label: {**specs[label], "batch_size": BATCH, "num_workers": 0} for label in pipelines}


def _local(
    cfg: Config, directory: Path, pipelines: tuple[str, ...] = ("map", "packed"), peers: bool = True
) -> tuple[list[dict], list[str]]:
    """The map-style and packed pipelines, every worker count; `peers=False`: ours and DataLoader only."""
    cases, notes = [], []
    for label, spec in local_specs(cfg, directory, pipelines).items():
        n = len(loader_of(spec).dataset)
        resumed, missing = _peer_specs(cfg, directory, label, n, spec) if peers else ({}, [])
        notes += missing
        say("cold-start", f"{label}: N={count(n)}, peers {', '.join(resumed) or 'none'}")
        cases += [_case(cfg, directory, label, {**spec, "num_workers": w}, n, resumed) for w in cfg.cold_workers]
    return cases, notes


def _remote(cfg: Config, directory: Path, warmths: tuple[str, ...] = ("warm", "cold")) -> tuple[list[dict], list[str]]:
    """The WebDataset pipeline through the node cache, warm and cold, every worker count (moto's S3 server)."""
    from benchmarks.wds import KEYS, write_shards
    from benchmarks.wds_remote import _missing

    if (missing := _missing()) is not None:
        return [], [f"webdataset not measured: {missing}"]
    import fsspec

    from loader.sources.webdataset import prepare_indexes
    from tests.servers import moto_server, s3_options, upload

    cases = []
    with moto_server() as endpoint:
        shards = directory / "shards"
        shards.mkdir()
        local = write_shards(str(shards), cfg.shards, cfg.samples_per_shard, cfg.sample_bytes)
        options = s3_options(endpoint)
        upload(fsspec.url_to_fs("s3://cold", **options)[0], str(shards), "cold")
        urls = [f"s3://cold/{os.path.basename(u)}" for u in local]
        prepare_indexes(urls, storage_options=options)  # next to the shards: what a cold node reads
        # every copy fits (a warm cache holds them all), and what the most workers keep open besides
        limit = (len(local) + 2 * max(cfg.cold_workers) + 4) * (max(map(os.path.getsize, local)) + 8192)
        for warmth in warmths:
            cache = directory / f"cache-{warmth}"
            spec = {
                "pipeline": "webdataset",
                "urls": urls,
                "keys": list(KEYS),
                "storage_options": options,
                "cache_dir": str(cache),
                "cache_limit": limit,
                "batch_size": BATCH,
                "torch_shuffle": False,
            }
            source = loader_of({**spec, "num_workers": 0}).dataset
            for first in range(0, len(source), cfg.samples_per_shard):
                source[first]  # every shard's copy in the cache: warm (the cold one is emptied before each run)
            before = None if warmth == "warm" else partial(shutil.rmtree, cache, True)
            label = f"webdataset, {warmth} node cache"
            cases += [
                _case(cfg, directory, label, {**spec, "num_workers": w}, len(source), {}, before)
                for w in cfg.cold_workers
            ]
    return cases, ["webdataset: no peer measured (Grain, LitData and OLMo-core read their own formats, not tar shards)"]


def _compile() -> None:
    """The project to bytecode, as `pip install` leaves it (see the module's docstring)."""
    for package in ("loader", "benchmarks"):
        compileall.compile_dir(Path(__file__).resolve().parent.parent / package, quiet=1)


def run(cfg: Config) -> dict:
    _compile()
    with tempfile.TemporaryDirectory(prefix="loader-bench-cold-") as name:
        local, local_notes = _local(cfg, Path(name))
        remote, remote_notes = _remote(cfg, Path(name))
    cases = local + remote
    return {
        "batch_size": BATCH,
        "packed": PACKED,
        "cases": cases,
        "notes": [f"{cfg.cold_reps} rounds after {cfg.warmup} warm-up here (the header's count is the other sections')"]
        + local_notes
        + remote_notes,
        "tables": _table(cases),
        "rows": [r for case in cases for r in _rows(case)],
    }


def recheck(
    reps: int, out: Path, pipeline: str = "map", workers: tuple[int, ...] = (0,), control: bool = False
) -> dict:
    """One pipeline alone, DataLoader and ours (at the three positions with 0 workers or map-style, the middle
    otherwise), `reps` rounds: more rounds for a row that the section's few leave open, in minutes instead of the
    section's half hour. `pipeline`: map or packed, or webdataset-cold / webdataset-warm, at full mode's sizes.
    `control`: DataLoader against itself as well, the spread of a ratio of equals here (more rounds narrow the
    median's uncertainty, not the rounds' quartiles that "not resolved" reads)."""
    _compile()
    cfg = replace(FULL, cold_reps=reps, cold_workers=workers, cold_control=control)
    with tempfile.TemporaryDirectory(prefix="loader-bench-cold-") as name:
        if pipeline.startswith("webdataset-"):
            cases, _ = _remote(cfg, Path(name), warmths=(pipeline.removeprefix("webdataset-"),))
        else:
            cases, _ = _local(cfg, Path(name), (pipeline,), peers=False)
    result = {"environment": environment("cpu"), "config": {"cold_reps": reps, "warmup": cfg.warmup, "mode": cfg.mode}}
    result |= {"cases": cases, "tables": _table(cases), "rows": [r for case in cases for r in _rows(case)]}
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=recheck.__doc__)
    parser.add_argument("reps", type=int, help="rounds after the warm-up")
    parser.add_argument("out", type=Path, help="the JSON result")
    parser.add_argument("--pipeline", default="map", choices=RECHECKED)
    parser.add_argument("--workers", type=int, nargs="+", default=[0], help="num_workers, each a case")
    parser.add_argument("--control", action="store_true", help="DataLoader against itself as well (A/A)")
    args = parser.parse_args()
    recheck(args.reps, args.out, args.pipeline, tuple(args.workers), args.control)
