"""Ranks as real processes, for systems that read the rank from the environment or torch.distributed.

A launch starts `world` processes together, as torchrun would: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
(one node), MASTER_ADDR/PORT on the loopback, and a gloo group each initialises before building its loader. Each
process plays the launch's phases for its rank (`phase.play`, states gathered with all_gather_object) and writes
its outcomes to a file. The wait is bounded: a launch past its timeout has its processes killed by pid and is
reported as an error.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.peers.phase import Outcome, Phase, play

_ROOT = Path(__file__).resolve().parents[2]  # where `python -m benchmarks.peers.ranks` finds the package


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
    }  # the
    # project first, then what the caller added (e.g. peers installed with --target, as benchmarks/README.md notes)


def launch(module: str, phases: list[Phase], timeout_s: float) -> list[Outcome]:
    """Start every rank of the phases' world, each playing `module`.PEER (`module:NAME`: its NAME) through the
    phases; return the outcomes with every rank's ids. Raises with the failing rank's last error line when a rank
    fails or the launch runs past `timeout_s`."""
    world = phases[0].world
    with tempfile.TemporaryDirectory(prefix="loader-ranks-") as directory:
        job = Path(directory) / "phases.pkl"
        job.write_bytes(pickle.dumps(phases))
        port, procs = _free_port(), []
        for rank in range(world):
            with open(Path(directory) / f"{rank}.log", "w") as log:
                command = [sys.executable, "-m", "benchmarks.peers.ranks", module, str(job), f"{directory}/{rank}.pkl"]
                procs.append(
                    subprocess.Popen(
                        command, env=_env(rank, world, port), cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT
                    )
                )
        deadline = time.monotonic() + timeout_s
        try:
            codes = [proc.wait(timeout=max(0.1, deadline - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for proc in procs:  # only ours, by pid; reaped so none is left behind
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        failed = [r for r in range(world) if codes is None or codes[r]]
        if failed:
            log = (Path(directory) / f"{failed[0]}.log").read_text()
            what = f"ran past {timeout_s:.0f} s" if codes is None else f"rank {failed[0]} exited {codes[failed[0]]}"
            raise RuntimeError(f"{what}: {_last_error(log)}")
        per_rank = [pickle.loads((Path(directory) / f"{rank}.pkl").read_bytes()) for rank in range(world)]
    return [
        Outcome(
            ids=[ranks[i].ids[0] if ranks[i].ids else [] for ranks in per_rank],
            saved=per_rank[0][i].saved,
            error=next((ranks[i].error for ranks in per_rank if ranks[i].error), None),
        )
        for i in range(len(phases))
    ]


def _last_error(log: str) -> str:
    """The exception line of a rank's log (the last line that names an error), else its tail."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors or lines or ["no output"])[-1].strip()


def _main(module: str, job: str, out: str) -> None:
    import torch.distributed as dist

    phases: list[Phase] = pickle.loads(Path(job).read_bytes())
    rank, world = int(os.environ["RANK"]), phases[0].world
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))

    def gather(states):
        every = [None] * world
        dist.all_gather_object(every, states)
        return every

    path, _, name = module.partition(":")
    outcomes = play(getattr(importlib.import_module(path), name or "PEER"), phases, [rank], gather)
    Path(out).write_bytes(pickle.dumps(outcomes))
    dist.barrier()  # no rank tears the group down while another still reads
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(*sys.argv[1:4])
