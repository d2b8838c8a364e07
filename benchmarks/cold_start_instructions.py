"""Section 14's cold start counted in instructions: one fresh process per candidate under valgrind's callgrind
(its forked workers followed, a dump per process), from the interpreter's start to its exit, DataLoader's own cold
start against ours resumed at each position of the map-style or packed pipeline.

    python -m benchmarks.cold_start_instructions [--pipeline packed] [--workers 0 8]

Why: the timed rows of a single cold start (about 1.5 s, most of it torch's import) spread ±10 % a round on a
shared 2-core VM, DataLoader against itself as much (`python -m benchmarks.cold_start ... --control`), so a 10 %
target cannot be resolved there in seconds; what differs between the two loaders can in instructions
(`PYTHONHASHSEED=0`; the count moves by well under 1 % between identical runs). Instructions are not time (a cache
miss or a download costs more than its instructions), so this reads the code's cost, not the machine's or the
store's: the WebDataset pipelines, whose first batch waits on a server, are not counted. Without valgrind it says
so and exits (status 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cold_start import BASELINE, TARGET, candidate_specs, local_specs
from benchmarks.config import FULL
from benchmarks.first_batch import loader_of
from benchmarks.instructions import totals
from benchmarks.rows import row

_ROOT = Path(__file__).resolve().parent.parent


def count(valgrind: str, spec: Path, directory: Path, timeout_s: float) -> int:
    """The instructions of one cold start: the process and every worker it forked, summed over their dumps."""
    directory.mkdir()
    command = [valgrind, "--tool=callgrind", f"--callgrind-out-file={directory / 'out'}.%p", sys.executable]
    command += ["-m", "benchmarks.first_batch", str(spec)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"callgrind of {spec.name} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    return sum(totals(directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", choices=("map", "packed"), default="packed")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 8], help="num_workers, each a case")
    parser.add_argument("--timeout", type=float, default=1800.0, help="a bound for a hung run, not a slow one")
    args = parser.parse_args()
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not on PATH: nothing measured (apt install valgrind)")
        return
    with tempfile.TemporaryDirectory(prefix="loader-bench-cold-ir-") as name:
        directory = Path(name)
        spec = local_specs(FULL, directory, (args.pipeline,))[args.pipeline]
        n = len(loader_of(spec).dataset)
        for workers in args.workers:
            specs = candidate_specs(directory, args.pipeline, {**spec, "num_workers": workers}, n)
            counted = {
                who: count(valgrind, path, directory / f"w{workers}-{i}", args.timeout)
                for i, (who, path) in enumerate(specs.items())
            }
            label = f"{args.pipeline}, workers={workers}"
            print(f"{label}: {BASELINE} {counted[BASELINE]:,} instructions, process start -> exit")
            for who, value in counted.items():
                if who != BASELINE:
                    ratio = value / counted[BASELINE]
                    graded = row(label, {"median": ratio, "min": ratio, "max": ratio}, "ratio", TARGET)
                    print(f"  {who}: {value:,} ({ratio:.4f}; target {TARGET}: {'met' if graded['met'] else 'missed'})")


if __name__ == "__main__":
    main()
