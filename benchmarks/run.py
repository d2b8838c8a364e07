"""The runner: `python -m benchmarks [--quick | --smoke] [--peers | --sections KEY ...] [--device cpu|cuda]
[--out DIR] [--overwrite] [--t-launch S] [--note TEXT]`, or `python benchmarks/run.py` with the same options.

Runs the sections in order, then the restart plan from their numbers, and writes <out>/<stem>.json, .md and one
PNG per section (stem: cpu-<hostname> or cuda-<gpu name>). `--sections` runs only those (stem <stem>-<keys>);
`--peers` is `--sections peers`, the peers section, which a default run leaves out (it takes minutes), as it
leaves out `scale` (65,536 ranks simulated, 1,024 store clients). A smoke run writes to a temporary directory
unless --out is given; no run replaces results already in benchmarks/results without --overwrite (or an explicit
--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable, as `python -m` does
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import (  # noqa: E402
    checkpoint,
    cold_start,
    features,
    memory,
    packing,
    plots,
    report,
    restart,
    resume,
    scale,
    throughput,
    tokens,
    training,
    wds,
    wds_remote,
)
from benchmarks.config import Config, config_for  # noqa: E402
from benchmarks.environment import environment, output_stem  # noqa: E402
from benchmarks.peers import section as peers  # noqa: E402
from benchmarks.progress import say  # noqa: E402

SECTIONS: tuple[tuple[str, str, Callable[[Config], dict]], ...] = (
    ("throughput", "1. Loader throughput (samples/s ratio to DataLoader)", throughput.run),
    ("training", "2. Training-step overhead (step time ratio to device-resident data)", training.run),
    ("checkpoint", "3. Checkpoint costs (state_dict, merge_states, bytes)", checkpoint.run),
    ("resume", "4. Resume cost (load_state_dict to first batch)", resume.run),
    ("memory", "5. Order memory (peak RSS added by the order and first batch)", memory.run),
    ("webdataset", "6. WebDataset (samples/s ratio to webdataset.WebDataset, sequential)", wds.run),
    ("tokens", "7. LM data (tokens/s ratio to a plain memmap loop; mixture memory and position cost)", tokens.run),
    (
        "remote",
        "8. Remote shards on a loopback S3 endpoint (samples/s ratio to webdataset streaming them)",
        wds_remote.run,
    ),
    (
        "packing",
        "12. Document packing (padding against Grain's first and best fit, packed tokens/s against an in-order "
        "loop, memory at 1e9 documents)",
        packing.run,
    ),
    (
        "features",
        "13. Filters, batch-size ramps, token-budget batches, online mixture changes (cost per batch against the "
        "same loader without them, state bytes, padding against a best fit)",
        features.run,
    ),
)
RESTART_TITLE = "9. Restart budget (replay plans from measured inputs; a measured elastic restart)"
PEERS = (
    "peers",
    "10. Peers side by side: samples skipped or duplicated by a resume, resume time, state, memory, throughput",
    peers.run,
)
SCALE = (
    "scale",
    "11. Data parallelism at scale (65,536 ranks simulated: merge, gather bytes, validation, load; "
    "the lockstep check's store at 1,024 clients)",
    scale.run,
)
PEERS_EXACT = (
    "peers-exact",
    "10. Peers, exactly once alone: samples skipped or duplicated by a resume, by identity (counts only, no timings)",
    peers.run_exact,
)
COLD_START = (
    "cold-start",
    "14. Cold start after a restart (process start -> first batch, a fresh process each run: ours resumed at the "
    "start, middle and end of the epoch, and peers resumed, against DataLoader's own cold start)",
    cold_start.run,
)
OPT_IN = (PEERS, PEERS_EXACT, SCALE, COLD_START)  # run only when chosen with --sections
RESULTS = Path(__file__).resolve().parent / "results"


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
    mode.add_argument("--smoke", action="store_true", help="seconds: tiny sizes, one repetition, no grading (CI)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--peers",
        action="store_true",
        help="only the peers section: other loaders side by side (pip install -e '.[peers]')",
    )
    only.add_argument(
        "--sections",
        nargs="+",
        choices=[key for key, _, _ in SECTIONS + OPT_IN],
        help="run only these (the restart plan needs training and resume)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="default: a temporary directory with --smoke, else benchmarks/results")
    parser.add_argument("--overwrite", action="store_true", help="replace the results published in benchmarks/results")
    parser.add_argument("--t-launch", type=float, default=10.0, help="relaunch seconds for the restart plan")
    parser.add_argument(
        "--note",
        help="a line on the run the environment does not record (the machine shared with "
        "other work, say): kept in the JSON and shown under the table's header",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here")
    if args.peers:
        args.sections = [PEERS[0]]
    args.stem = output_stem(args.device) + ("" if args.sections is None else "-" + "-".join(args.sections))
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "loader-benchmarks-smoke" if args.smoke else RESULTS
        published = args.out / f"{args.stem}.json"
        if published.exists() and not args.overwrite:
            parser.error(f"{published} holds published results: pass --overwrite to replace them, or --out DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    cfg = config_for(mode, args.device, args.t_launch)
    results = {
        "mode": mode,
        "config": dataclasses.asdict(cfg),
        "environment": environment(args.device),
        "note": args.note,
        "sections": {},
    }
    sections = results["sections"]
    chosen = [s for s in SECTIONS + OPT_IN if s[0] in args.sections] if args.sections else SECTIONS
    with_restart = {"training", "resume"} <= {key for key, _, _ in chosen}
    total = len(chosen) + with_restart
    for number, (key, title, run) in enumerate(chosen, 1):
        say(key, f"section {number}/{total}: {title}")
        start = time.perf_counter()
        sections[key] = {"title": title, **run(cfg), "seconds": time.perf_counter() - start}
    if with_restart:
        say("restart", f"section {total}/{total}: {RESTART_TITLE}")
        sections["restart"] = {"title": RESTART_TITLE, **restart.run(cfg, sections["training"], sections["resume"])}
    if mode == "smoke":  # one repetition at tiny sizes: the figures prove the suite runs, not the targets
        for row in (r for section in sections.values() for r in section.get("rows", [])):
            row["met"] = None
    results["environment"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    args.out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots.write(results, args.out, args.stem)
    for path in report.write(results, args.out, args.stem):
        say("done", f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
