"""`python -m loader demo`: a real elastic job loses a node mid-step and finishes on fewer workers, exactly once.

Two torchrun agents on this machine form one job of 4 workers (3 + 1) over a standalone TCP store, as two nodes
would. During step 9 the single-worker node dies: its worker SIGKILLs its own agent, then itself. The remaining
agent restarts its workers; they rendezvous as a job of 3, resume from the newest verified checkpoint and finish
the epoch with the same global batch. Then the ledger is audited, the final model is compared with an
uninterrupted run, and the restart's measured costs are put next to the replay plan. With `--lm` the job is
examples/train_lm.py (a transformer on a 70/30 mixture of token files) and the audit has a row per source.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

from loader.audit import main as audit_main
from loader.replay import replay_plan

PROJECT = Path(__file__).resolve().parent.parent  # the checkout: the example and the package it imports
EXAMPLE = PROJECT / "examples" / "train_elastic.py"
LM_EXAMPLE = PROJECT / "examples" / "train_lm.py"
JOB = ["--samples", "480", "--global-batch", "24", "--micro-batch", "2", "--checkpoint-every", "3", "--ledger"]
RDZV = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"  # 5 s: both nodes join the first round
FAIL_AT_STEP = 8
STEP_LINE = re.compile(r"\[rank 0\] step (\d+) ")
SAVED_LINE = re.compile(r"\[rank 0\] checkpoint of step \d+ saved in ([\d.]+) s")
RESUMED_LINE = re.compile(r"\[rank 0\] world size (\d+), .*resumed at step (\d+).*checkpoint load ([\d.]+) s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment() -> dict:
    """The workers import this very `loader` (first on their path), installed or not, whatever else is installed."""
    path = os.pathsep.join(p for p in (str(PROJECT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _descendants(pid: int) -> list[int]:
    """Every process below pid: torchrun's workers run in sessions of their own and outlive a killed agent."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Agent:
    """One torchrun agent (a node) whose output lines are collected with their arrival times."""

    def __init__(self, name: str, args: list[str], lines: queue.Queue):
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=_environment(), start_new_session=True,
        )
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()

    def _read(self, lines: queue.Queue) -> None:
        for line in self.process.stdout:
            lines.put((time.monotonic(), self.name, line.rstrip()))

    def stop(self) -> None:
        """End the agent and every worker it started, by pid."""
        for pid in _descendants(self.process.pid) + [self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)


def _torchrun_args(nproc: int, endpoint: str, job_id: str, run_dir: Path, extra: list[str], example: Path) -> list[str]:
    return ["--nnodes=1:2", f"--nproc-per-node={nproc}", "--max-restarts=3", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}", f"--rdzv-conf=is_host=0,{RDZV}",
            str(example), "--run-dir", str(run_dir), *JOB, *extra]


def _run_elastic(run_dir: Path, timeout: float, example: Path) -> list[tuple[float, str, str]]:
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    lines: queue.Queue = queue.Queue()
    endpoint, job_id = f"127.0.0.1:{port}", f"demo-{uuid.uuid4().hex[:8]}"
    fault = ["--fail-at-step", str(FAIL_AT_STEP), "--fail-rank", "3", "--fail-mode", "node"]
    agents = [Agent("node A", _torchrun_args(3, endpoint, job_id, run_dir, [], example), lines),
              Agent("node B", _torchrun_args(1, endpoint, job_id, run_dir, fault, example), lines)]
    seen, deadline = [], time.monotonic() + timeout
    try:
        while agents[0].process.poll() is None or not lines.empty():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the elastic job did not finish within {timeout:.0f} s")
            try:
                stamp, name, line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            seen.append((stamp, name, line))
            _show_progress(line)
        if agents[0].process.returncode != 0:
            raise RuntimeError(f"node A exited with {agents[0].process.returncode}:\n{_failure_excerpt(seen)}")
    finally:
        for agent in agents:
            agent.stop()
        del store
    print()
    return seen


def _failure_excerpt(seen: list[tuple[float, str, str]], cause_lines: int = 25, tail_lines: int = 15) -> str:
    """The first worker traceback (the cause; torchrun's own report comes later and names only the exit code),
    then the agents' last lines."""
    lines = [f"{name}: {line}" for _, name, line in seen]
    first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    cause = lines[first:first + cause_lines] + ["..."] if first is not None else []
    return "\n".join(cause + lines[-tail_lines:])


def _show_progress(line: str) -> None:
    if (m := RESUMED_LINE.search(line)) is not None:
        world, step, _ = m.groups()
        print(f"\n  {world} workers: training from step {step}", end="", flush=True)
    elif (m := STEP_LINE.search(line)) is not None:
        print(f" {m.group(1)}", end="", flush=True)
    elif "fault injection" in line:
        print(f"\n  {line.split('] ', 1)[1]} -> node B is gone", end="", flush=True)


def _reference(run_dir: Path, timeout: float, example: Path) -> None:
    args = ["--standalone", "--nproc-per-node=3", str(example), "--run-dir", str(run_dir), *JOB]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True,
                          env=_environment(), timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def measure_restart(lines: list[tuple[float, str, str]], started: float) -> dict:
    """The replay plan from what was known before the failure, and the restart as measured (seconds)."""
    steps = [(t, int(m.group(1))) for t, _, line in lines if (m := STEP_LINE.search(line))]
    resumes = [(t, m.groups()) for t, _, line in lines if (m := RESUMED_LINE.search(line))]
    killed = next(t for t, _, line in lines if "fault injection" in line)
    (first_launch, _), (resumed_at, (_, s_ckpt, load)) = resumes[0], resumes[1]
    before = [(t, s) for t, s in steps if t < resumed_at]
    s_done = max(s for _, s in before)
    caught_up = next(t for t, s in steps if t > resumed_at and s == s_done)
    plan = {
        "t_step_s": (before[-1][0] - before[0][0]) / max(1, before[-1][1] - before[0][1]),
        "t_launch_s": first_launch - started,  # the first launch, as a forecast of the relaunch
        "t_load_s": [float(m.group(1)) for t, _, line in lines if t < killed and (m := SAVED_LINE.search(line))][-1],
    }
    measured = {"launch_s": resumed_at - killed - float(load), "load_s": float(load), "replay_s": caught_up - resumed_at}
    return {
        "s_done": s_done,
        "s_ckpt": int(s_ckpt),
        "plan_inputs": plan,
        "plan_s": replay_plan(s_done, int(s_ckpt), plan["t_step_s"], plan["t_launch_s"], plan["t_load_s"]),
        "measured": measured,
        "measured_s": sum(measured.values()),
    }


def _print_restart(m: dict) -> None:
    plan, measured = m["plan_inputs"], m["measured"]
    print(f"\nrestart budget ({m['s_done']} steps done, checkpoint at step {m['s_ckpt']}):")
    print(f"  plan     {m['plan_s']:5.1f} s = {m['s_done'] - m['s_ckpt']} x {plan['t_step_s']:.3f} s per step + "
          f"{plan['t_launch_s']:.1f} s launch (the first one) + {plan['t_load_s']:.2f} s load (the last save's time)")
    print(f"  measured {m['measured_s']:5.1f} s = replay {measured['replay_s']:.2f} s + launch "
          f"{measured['launch_s']:.1f} s + load {measured['load_s']:.2f} s")


def run_elastic_restart(run_dir: Path, timeout: float = 150, example: Path = EXAMPLE) -> dict:
    """The demo's elastic job (4 workers, a node lost, 3 workers) in run_dir; returns its restart measurements."""
    started = time.monotonic()
    return measure_restart(_run_elastic(run_dir, timeout, example), started)


def _audit(run: Path, lm: bool) -> int:
    """The audit as `python -m loader audit` prints it; per source for the mixture of the LM job."""
    if not lm:
        return audit_main(str(run))
    from loader.__main__ import main as cli  # the command line imports this module: import it when needed

    return cli(["audit", str(run), "--mixture", str(run / "mixture.json")])


def main(lm: bool = False) -> int:
    example = LM_EXAMPLE if lm else EXAMPLE
    if not example.exists():
        raise SystemExit(f"demo: {example} is missing; run the demo from a checkout of the repository")
    data = "a 70/30 mixture of two token corpora, 480 sequences" if lm else "480 samples"
    print(f"demo: one elastic job ({example.name}), 2 nodes (3 + 1 workers), {data}, global batch 24; node B dies "
          f"during step {FAIL_AT_STEP + 1}")
    with tempfile.TemporaryDirectory(prefix="loader-demo-") as tmp:
        run, reference = Path(tmp) / "run", Path(tmp) / "reference"
        started = time.monotonic()
        restart = run_elastic_restart(run, example=example)
        print(f"  elastic job finished in {time.monotonic() - started:.0f} s; auditing the ledger:\n")
        status = _audit(run, lm)
        print("\nuninterrupted reference run (3 workers) ...", flush=True)
        _reference(reference, timeout=120, example=example)
        ours, theirs = torch.load(run / "final-model.pt"), torch.load(reference / "final-model.pt")
        drift = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
        same = all(torch.allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6) for k in theirs)
        print(f"max parameter difference to the uninterrupted run: {drift:.2e} ({'equal' if same else 'DIFFERENT'} "
              f"within rtol 1e-5)")
        _print_restart(restart)
    return 0 if status == 0 and same else 1
