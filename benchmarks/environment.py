"""What the numbers were measured on: versions, CPUs, device, commit and load, so results can be compared."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
from pathlib import Path

import numpy
import torch
import torchdata
import webdataset

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), which can be fewer than the machine has."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else _cpu_model()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def output_stem(device: str) -> str:
    """`cpu-<hostname>` or `cuda-<gpu name>`: results of different machines sit side by side."""
    return f"cuda-{slug(device_name(device))}" if device == "cuda" else f"cpu-{slug(socket.gethostname())}"


def environment(device: str) -> dict:
    status = _git("status", "--porcelain")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torchdata": torchdata.__version__,
        "webdataset": getattr(webdataset, "__version__", "unknown"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": device,
        "device_name": device_name(device),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }
