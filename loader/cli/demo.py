"""`python -m loader demo`: a real elastic job loses a node mid-step and finishes on fewer workers, exactly once.

Two torchrun agents on this machine form one job of 4 workers (3 + 1) over a standalone TCP store, as two nodes
would. During step 9 the single-worker node dies: its worker SIGKILLs its own agent, then itself. The remaining
agent restarts its workers; they rendezvous as a job of 3, resume from the newest verified checkpoint and finish
the epoch with the same global batch. Then the ledger is audited, the final model is compared with an
uninterrupted run, and the restart's measured costs are put next to the replay plan. With `--lm` the job is
examples/train_lm.py (a transformer on packed documents of two token corpora, mixed by a schedule: web text alone,
then a ramp to 70/30): the first launch's packing stats and schedule change points are shown, and the audit has a
row per source.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from loader.checkpoint.audit import main as audit_main
from loader.checkpoint.replay import replay_plan
from loader.cli.names import by_source

PROJECT = Path(__file__).resolve().parents[2]  # the checkout: the example and the package it imports
EXAMPLE = PROJECT / "examples" / "train_elastic.py"
LM_EXAMPLE = PROJECT / "examples" / "train_lm.py"
JOB = ["--samples", "480", "--global-batch", "24", "--micro-batch", "2", "--checkpoint-every", "3", "--ledger"]
# 5 s: both nodes join the first round
RDZV = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
FAIL_AT_STEP = 8
STEP_LINE = re.compile(r"\[rank 0\] step (\d+) ")
SAVED_LINE = re.compile(r"\[rank 0\] checkpoint of step \d+ saved in ([\d.]+) s")
DATA_LINE = re.compile(r"\[rank 0\] data: (.*)")  # what the LM example says of its packing and schedule
RESUMED_LINE = re.compile(r"\[rank 0\] world size (\d+), .*resumed at step (\d+).*checkpoint load ([\d.]+) s")
Line = tuple[float, str, str]  # an agent's output line: (arrival time, node, text)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_environment() -> dict:
    """What the demo adds to the environment: the workers import this very `loader` (first on their path),
    installed or not, whatever else is installed; the rendezvous store setting that makes restarts clean here."""
    path = os.pathsep.join(p for p in (str(PROJECT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def _environment() -> dict:
    return {**os.environ, **_job_environment()}


def command_line(args: list[str]) -> str:
    """A torchrun command as a user would type it, with the environment the demo gives it."""
    settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in _job_environment().items())
    return f"{settings} {shlex.join([sys.executable, '-m', 'torch.distributed.run', *args])}"


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
        print(f"  {name}: {command_line(args)}", flush=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_environment(),
            start_new_session=True,
        )
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()

    def _read(self, lines: queue.Queue) -> None:
        for line in self.process.stdout or ():  # a pipe: stdout=PIPE above
            lines.put((time.monotonic(), self.name, line.rstrip()))

    def signal(self, sig: int) -> None:
        """Signal the agent and every worker it started, by pid (SIGCONT wakes a node that was stopped)."""
        for pid in [self.process.pid] + _descendants(self.process.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """End the agent and every worker it started."""
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def _torchrun_args(nproc: int, endpoint: str, job_id: str, run_dir: Path, extra: list[str], example: Path) -> list[str]:
    return [
        "--nnodes=1:2",
        f"--nproc-per-node={nproc}",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job_id}",
        f"--rdzv-conf=is_host=0,{RDZV}",
        str(example),
        "--run-dir",
        str(run_dir),
        *JOB,
        *extra,
    ]


NODE_LOSS = ["--fail-at-step", str(FAIL_AT_STEP), "--fail-rank", "3", "--fail-mode", "node"]


def run_two_nodes(
    run_dir: Path,
    timeout: float,
    fault: list[str],
    extra: tuple[str, ...] = (),
    react: Callable[[Line, list[Agent]], None] | None = None,
    example: Path = EXAMPLE,
) -> list[Line]:
    """The demo's job (`example`) on two torchrun agents, node A (3 workers) and node B (1 worker, told `fault`),
    both given `extra`; `react` sees each line as it comes, with the agents (to wake a stopped node, say). Returns
    every line."""
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    print(
        f"  the rendezvous store (a standalone torch.distributed.TCPStore, as a cluster runs one): 127.0.0.1:{port}",
        flush=True,
    )
    lines: queue.Queue = queue.Queue()
    endpoint, job_id = f"127.0.0.1:{port}", f"demo-{uuid.uuid4().hex[:8]}"
    agents = [
        Agent("node A", _torchrun_args(3, endpoint, job_id, run_dir, [*extra], example), lines),
        Agent("node B", _torchrun_args(1, endpoint, job_id, run_dir, [*fault, *extra], example), lines),
    ]
    seen, deadline, progress = [], time.monotonic() + timeout, ProgressLine()
    try:
        while agents[0].process.poll() is None or not lines.empty():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the elastic job did not finish within {timeout:.0f} s")
            try:
                stamp, name, line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            seen.append((stamp, name, line))
            progress.show(line)
            if react is not None:
                react((stamp, name, line), agents)
        if agents[0].process.returncode != 0:
            raise RuntimeError(f"node A exited with {agents[0].process.returncode}:\n{_failure_excerpt(seen)}")
    finally:
        for agent in agents:
            agent.stop()
        del store
    print()
    return seen


def _failure_excerpt(seen: list[Line], cause_lines: int = 25, tail_lines: int = 15) -> str:
    """The first worker traceback (the cause; torchrun's own report comes later and names only the exit code),
    then the agents' last lines."""
    lines = [f"{name}: {line}" for _, name, line in seen]
    first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    cause = lines[first : first + cause_lines] + ["..."] if first is not None else []
    return "\n".join(cause + lines[-tail_lines:])


class ProgressLine:
    """The job's progress as it happens, every number labelled: each launch (its workers and the checkpoint step it
    resumed from) opens a line of the optimizer steps rank 0 completes; the fault gets a line of its own."""

    def __init__(self) -> None:
        self.launches, self.listing = 0, False  # listing: the current line is a list of completed steps

    def show(self, line: str) -> None:
        if (m := DATA_LINE.search(line)) is not None and self.launches == 0:  # once: every launch says it
            self._write(f"\n  {m.group(1)}", False)
        elif (m := RESUMED_LINE.search(line)) is not None:
            world, step, _ = m.groups()
            self.launches += 1
            start = "fresh start from step 0" if step == "0" else f"resumed from the checkpoint of step {step}"
            self._write(f"\n  launch {self.launches}, {world} workers, {start}; optimizer steps completed:", True)
        elif (m := STEP_LINE.search(line)) is not None:
            if not self.listing:  # rank 0 finished it before the fault, its line just arrived after the fault's
                self._write("\n  completed before the fault, reported after it: step", True)
            self._write(f" {m.group(1)}", True)
        elif "fault injection" in line:
            fault = line.split("] ", 1)[1]
            how = "stopped" if "hang" in fault else "killed"
            self._write(f"\n  {fault} -> node B is gone (its agent and worker {how})", False)

    def _write(self, text: str, listing: bool) -> None:
        print(text, end="", flush=True)
        self.listing = listing


def reference_run(run_dir: Path, timeout: float, example: Path = EXAMPLE) -> None:
    """The demo's job (`example`) without a fault, on 3 workers: the final model to compare with."""
    args = ["--standalone", "--nproc-per-node=3", str(example), "--run-dir", str(run_dir), *JOB]
    print(f"  {command_line(args)}", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def measure_restart(lines: list[Line], started: float) -> dict:
    """The replay plan from what was known before the failure, and the restart as measured (seconds): detection
    (from the fault to node A's first failure: a lost peer at once, a hung one at the group's timeout), launch, load
    and replay."""
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
    noticed = (t for t, node, line in lines if t >= killed and node == "node A" and "FAILED during" in line)
    detected = next(noticed, killed)
    measured = {
        "detect_s": detected - killed,
        "launch_s": resumed_at - detected - float(load),
        "load_s": float(load),
        "replay_s": caught_up - resumed_at,
    }
    return {
        "s_done": s_done,
        "s_ckpt": int(s_ckpt),
        "plan_inputs": plan,
        "plan_s": replay_plan(s_done, int(s_ckpt), plan["t_step_s"], plan["t_launch_s"], plan["t_load_s"]),
        "measured": measured,
        "measured_s": sum(measured.values()),
    }


def print_restart(m: dict) -> None:
    plan, measured = m["plan_inputs"], m["measured"]
    print(f"\nrestart budget ({m['s_done']} steps done, checkpoint at step {m['s_ckpt']}):")
    print(
        f"  plan     {m['plan_s']:5.1f} s = {m['s_done'] - m['s_ckpt']} x {plan['t_step_s']:.3f} s per step + "
        f"{plan['t_launch_s']:.1f} s launch (the first one) + {plan['t_load_s']:.2f} s load (the last save's time)"
    )
    print(
        f"  measured {m['measured_s']:5.1f} s = replay {measured['replay_s']:.2f} s + launch "
        f"{measured['launch_s']:.1f} s + load {measured['load_s']:.2f} s + detection {measured['detect_s']:.1f} s "
        f"(the plan has none: a lost peer is noticed at once, a hung one at the group's timeout)"
    )


def run_elastic_restart(run_dir: Path, timeout: float = 150, example: Path = EXAMPLE) -> dict:
    """The demo's elastic job (4 workers, a node lost, 3 workers) in run_dir; returns its restart measurements."""
    started = time.monotonic()
    return measure_restart(run_two_nodes(run_dir, timeout, NODE_LOSS, example=example), started)


def _audit(run: Path, lm: bool) -> int:
    """The audit as `python -m loader audit` prints it; per source for the mixture of the LM job."""
    if not lm:
        return audit_main(str(run))
    grouping, describe = by_source(str(run / "mixture.json"))
    return audit_main(str(run), describe=describe, grouping=grouping)


def _audit_command(run: Path, lm: bool) -> str:
    mixture = ["--mixture", str(run / "mixture.json")] if lm else []
    return shlex.join([sys.executable, "-m", "loader", "audit", str(run), *mixture])


def main(lm: bool = False, directory: str | None = None) -> int:
    """The demo in `directory` (a new one under the system's temporary directory if None), which it keeps: the
    runs' checkpoints, ledgers and final models stay there to be audited again."""
    example = LM_EXAMPLE if lm else EXAMPLE
    if not example.exists():
        raise SystemExit(f"demo: {example} is missing; run the demo from a checkout of the repository")
    top = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="loader-demo-"))
    run, reference = top / "run", top / "reference"
    if run.exists() or reference.exists():
        raise SystemExit(f"demo: {top} holds an earlier demo's run/ or reference/: name a new directory")
    data = "packed rows of two token corpora mixed by a schedule (to 70/30), 480 rows" if lm else "480 samples"
    print(
        f"demo: one elastic job ({example.name}), 2 nodes (3 + 1 workers), {data}, global batch 24; node B dies "
        f"during step {FAIL_AT_STEP + 1}\nrun directory: {top} (kept after the demo: {_removal(top)})\n"
        f"commands:"
    )
    started = time.monotonic()
    restart = run_elastic_restart(run, example=example)
    print(
        f"  elastic job finished in {time.monotonic() - started:.0f} s; auditing the ledger:\n"
        f"  {_audit_command(run, lm)}\n"
    )
    status = _audit(run, lm)
    print("\nuninterrupted reference run (3 workers) ...", flush=True)
    reference_run(reference, timeout=120, example=example)
    ours, theirs = torch.load(run / "final-model.pt"), torch.load(reference / "final-model.pt")
    drift = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    same = all(torch.allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6) for k in theirs)
    print(
        f"max parameter difference to the uninterrupted run: {drift:.2e} ({'equal' if same else 'DIFFERENT'} "
        f"within rtol 1e-5)"
    )
    print_restart(restart)
    print(
        f"\nthe run's checkpoints, ledger and final models stay in {top}; audit it again with\n"
        f"  {_audit_command(run, lm)}\nand remove it when done with\n  {_removal(top)}"
    )
    return 0 if status == 0 and same else 1


def _removal(top: Path) -> str:
    return f"rm -r {shlex.quote(str(top))}"
