"""The README's main job runs on a fresh interpreter and proves exactly-once, where the usual restart does not."""

import re
import subprocess
import sys


def run_demo(*args):
    return subprocess.run([sys.executable, "-m", "loader", "demo", *args], capture_output=True, text=True, timeout=120)


def counts(output, name):
    line = next(line for line in output.splitlines() if line.strip().startswith(name))
    return [int(v) for v in re.findall(r"(?:once|skipped|duplicated|policy)\s+(\d+)", line)]


def test_demo_resumes_at_another_world_size_exactly_once():
    done = run_demo("--world-sizes", "4", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert counts(done.stdout, "loader") == [1008, 0, 0, 0]
    naive = counts(done.stdout, "DistributedSampler")
    assert naive[1] + naive[2] > 0  # the usual restart skips or repeats samples
    assert "exactly once: yes" in done.stdout


def test_demo_rejects_a_world_size_that_breaks_the_global_batch():
    done = run_demo("--world-sizes", "4", "5")
    assert done.returncode != 0 and "world size 5 cannot keep the global batch 48" in done.stderr
