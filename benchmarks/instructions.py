"""A stream's per-batch cost counted in instructions (issue 32, item 3): valgrind's callgrind runs one process with
0 workers over `FeatureStream`'s nearly free rows (64 a batch), DataLoader against ours and ours with `state_dict()`
after every batch, and reads the instructions each candidate's batches took.

    python -m benchmarks.instructions [--batches 300] [--warmup 10] [--rounds 2]

Instructions, not time: a batch's instruction count does not move with the machine's load, so a 1-2 % difference
that the timed rows cannot resolve on a shared VM is read exactly (`PYTHONHASHSEED=0`, one intra-op thread; what is
left is the garbage collector, run as in training). The ratio is DataLoader's instructions over the candidate's, a
speed as the timed rows read it; its target is read, not asserted (see `benchmarks.rows`). Instructions are not
time (a cache miss costs more than an add), so this resolves the code's cost, not the machine's. Without valgrind
on PATH it says so and exits (status 0): it measures nothing there.

Each candidate's batches lie between two calls of `zlib.adler32`, which callgrind is told to dump its counts
before (`--dump-before=zlib_adler32`): dump 2k+2 holds the k-th measured run, warm-up and construction outside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from benchmarks.loaders import OURS, OURS_CHECKPOINTING, TORCH, Candidate
from benchmarks.report import number
from benchmarks.rows import row
from benchmarks.timing import summary

MEASURED = (TORCH, OURS, OURS_CHECKPOINTING)
TARGET = ">= 0.98"  # DataLoader's instructions / ours with state_dict() every batch (issue 32)
BATCH = 64
_ROOT = Path(__file__).resolve().parent.parent


def _mark() -> None:
    """A phase boundary: callgrind dumps the counts so far before this call."""
    zlib.adler32(b"")


def _count(batches: int, warmup: int, rounds: int) -> int:
    """Runs under callgrind: every candidate `rounds` times, its measured batches between two marks. Returns the
    number of marks made."""
    import torch

    from benchmarks.datasets import FeatureStream
    from benchmarks.loaders import steps

    torch.set_num_threads(1)
    dataset = FeatureStream(BATCH * (batches + warmup + 1), BATCH)
    marks = 0
    for _ in range(rounds):
        for candidate in MEASURED:
            loader = candidate.make(dataset, batch_size=BATCH, num_workers=0)
            batches_of = steps(loader, candidate.checkpoint)
            for _ in range(warmup):
                next(batches_of)
            _mark()
            for _ in range(batches):
                next(batches_of)
            _mark()
            marks += 2
            del batches_of, loader
    return marks


def totals(directory: Path) -> list[int]:
    """The instructions of each numbered dump (`out.1`, `out.2`, ...), in order."""
    numbered = {int(p.suffix[1:]): p for p in directory.glob("out.*") if p.suffix[1:].isdigit()}
    values = []
    for k in sorted(numbered):
        match = re.search(r"^summary:\s*(\d+)", numbered[k].read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{numbered[k]} has no summary line: not a callgrind dump")
        values.append(int(match.group(1)))
    return values


def per_batch(dumps: Sequence[int], marks: int, candidates: Sequence[Candidate], batches: int) -> dict[str, list]:
    """Instructions per batch of each candidate, a value per round, out of the dumps before each mark: the runs
    came in `candidates`' order, round after round, the k-th run's batches in dump 2k+1 (0-based). Refused when
    the dumps do not match the marks (something else called zlib.adler32)."""
    if len(dumps) < marks or marks % (2 * len(candidates)):
        raise RuntimeError(f"{len(dumps)} callgrind dumps for {marks} marks: another caller of zlib.adler32?")
    values: dict[str, list] = {c.name: [] for c in candidates}
    for run in range(marks // 2):
        values[candidates[run % len(candidates)].name].append(dumps[2 * run + 1] / batches)
    return values


def rows(values: dict[str, list]) -> list[dict]:
    """Instructions per batch of each candidate, and DataLoader's over each of ours (the speed ratio), per round."""
    base = values[TORCH.name]
    out = [row(f"{name}: instructions per batch", summary(v), "instructions") for name, v in values.items()]
    for c in MEASURED[1:]:
        ratios = [b / v for b, v in zip(base, values[c.name])]
        target = TARGET if c.checkpoint else None
        out.append(row(f"{c.name} / {TORCH.name} (instructions)", summary(ratios), "x", target))
    return out


def _callgrind(args: argparse.Namespace, valgrind: str, directory: Path) -> list[int]:
    """This module under callgrind, counting; the dumps' totals, checked against the marks it made."""
    command = [
        valgrind,
        "--tool=callgrind",
        "--dump-before=zlib_adler32",
        f"--callgrind-out-file={directory / 'out'}",
        sys.executable,
        "-m",
        "benchmarks.instructions",
        "--count",
        *("--batches", str(args.batches), "--warmup", str(args.warmup), "--rounds", str(args.rounds)),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"callgrind exited with {done.returncode}:\n{done.stderr[-2000:]}")
    marks = json.loads(done.stdout.strip().splitlines()[-1])["marks"]
    return per_batch(totals(directory), marks, MEASURED, args.batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=300, help="measured batches per run")
    parser.add_argument("--warmup", type=int, default=10, help="batches per run before counting")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole callgrind run")
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)  # the process callgrind runs
    args = parser.parse_args()
    if args.count:
        print(json.dumps({"marks": _count(args.batches, args.warmup, args.rounds)}))
        return
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not on PATH: nothing measured (install it, e.g. apt-get install valgrind)")
        return
    with tempfile.TemporaryDirectory(prefix="loader-bench-callgrind-") as name:
        values = _callgrind(args, valgrind, Path(name))
    print(f"instructions per batch ({args.batches} batches after {args.warmup}, {args.rounds} round(s), 0 workers)")
    for r in rows(values):
        met = (
            ""
            if r["target"] is None
            else f"  target {r['target']}: " + {True: "met", False: "MISSED"}.get(r["met"], "not resolved")
        )
        shown = (lambda v: f"{v:.4f}") if r["unit"] == "x" else number  # a ratio to 0.1 %
        spread = "" if r["min"] == r["max"] else f" ({shown(r['min'])} - {shown(r['max'])})"
        print(f"  {r['what']:60s} {shown(r['median'])}{spread}{met}")
    base = summary(values[TORCH.name])["median"]
    for c in MEASURED[1:]:
        extra = summary(values[c.name])["median"] - base
        print(f"  {c.name + ': beyond ' + TORCH.name:60s} {extra:+,.0f} instructions a batch")


if __name__ == "__main__":
    main()
