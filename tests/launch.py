"""Real launches of a training script for tests: a free port, bounded waits, and every process it started ended.

Frameworks start processes of their own (Lightning re-runs the script per rank; torchrun's workers live in sessions
of their own and outlive a killed parent), so each launch tags its environment and, once the launch is over, every
process still carrying the tag is SIGKILLed by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
_TAG = "LOADER_TEST_LAUNCH"


def _tagged(tag: str) -> list[int]:
    needle = f"{_TAG}={tag}\0".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _end_tagged(tag: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while pids := _tagged(tag):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} of launch {tag} survived SIGKILL for {timeout} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def launch(argv: list[str], log: Path, timeout: float, env: dict | None = None) -> int:
    """Run `python argv...` from the repository root with this checkout's `loader` first on the path and a free
    MASTER_PORT; return its exit code (negative: killed by that signal). Its output goes to `log`."""
    tag = uuid.uuid4().hex
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    environment = {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        _TAG: tag,
        **(env or {}),
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO,
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout)
        finally:
            _end_tagged(tag)
            process.wait(timeout=30)
