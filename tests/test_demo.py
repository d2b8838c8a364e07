"""The README's main job: a real torchrun elastic job loses a node, resumes on fewer workers, audits clean."""

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """Both demos at once, each in a directory of its own: a demo mostly waits (for its agents' rendezvous rounds, for
    a dozen interpreters started launch after launch), so two take little longer than one on two cores. Keyed by
    the flags; each gives its directory and `python -m loader demo` running."""
    with ThreadPoolExecutor(2) as pool:
        running = {}
        for flags in ((), ("--lm",)):
            directory = tmp_path_factory.mktemp("demo")
            command = [sys.executable, "-m", "loader", "demo", "--dir", str(directory), *flags]
            done = pool.submit(subprocess.run, command, capture_output=True, text=True, timeout=400)
            running[flags] = directory, done
        yield running


def demo_output(demos, *flags: str) -> str:
    """The output of `python -m loader demo` with these flags, checked for what every demo prints."""
    directory, running = demos[flags]
    done = running.result()  # the finished process
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"run directory: {directory} (kept after the demo: rm -r {directory})\n" in out
    assert out.endswith(f"and remove it when done with\n  rm -r {directory}\n")  # what it leaves, and how to remove it
    assert re.search(
        r"node A: .*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .* -m torch.distributed.run .*--nproc-per-node=3", out
    )
    assert re.search(r"node B: .* -m torch.distributed.run .*--nproc-per-node=1 .*--fail-at-step", out)
    audit_again = re.findall(r"^  (.* -m loader audit .*)$", out, re.MULTILINE)[-1]  # the command it prints, run
    again = subprocess.run(audit_again, shell=True, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "audit: every sample exactly once" in again.stdout, again.stdout + again.stderr
    assert "launch 1, 4 workers, fresh start from step 0; optimizer steps completed: 1 2 3" in out
    resumed = re.search(
        r"launch 2, 3 workers, resumed from the checkpoint of step (\d+); optimizer steps completed: "
        r"\d",
        out,
    )
    assert resumed and int(resumed.group(1)) % 3 == 0  # a published checkpoint step
    assert re.search(r"0\s+finished\s+480\s+480\s+0\s+0\s+0", out)  # the audit row of epoch 0
    assert "audit: every sample exactly once" in out
    assert "equal within rtol 1e-5" in out
    assert re.search(r"plan\s+[\d.]+ s = \d+ x", out) and re.search(r"measured\s+[\d.]+ s = replay", out)
    return out


def test_demo_loses_a_node_and_finishes_exactly_once(demos):
    demo_output(demos)


def test_the_lm_demo_loses_a_node_and_audits_each_source_exactly_once(demos):
    """The packed rows of examples/train_lm.py, mixed by its schedule (web alone, a ramp, 70/30): the demo shows the
    packing and the schedule's change points once, and the audit's rows per source are whole and exact."""
    out = demo_output(demos, "--lm")
    assert len(re.findall(r"^  web packed best fit into \d+ rows of 33 tokens: padding", out, re.MULTILINE)) == 1
    assert "by position: 0-59 10/0, 60-179 10/0 -> 7/3, 180-479 7/3" in out
    assert re.search(r"web\s+369\s+369\s+0\s+0\s+0\s+0", out) and re.search(r"code\s+111\s+111\s+0\s+0\s+0\s+0", out)


def test_a_failed_job_reports_the_workers_traceback_not_only_torchrun_s_summary():
    from loader.cli.demo import _failure_excerpt

    worker = ["Traceback (most recent call last):", '  File "train_elastic.py", line 33', "ImportError: boom"]
    agent = [f"torchrun report line {i}" for i in range(40)]
    seen = [(float(i), "node A", line) for i, line in enumerate(["starting"] + worker + agent)]
    excerpt = _failure_excerpt(seen)
    assert "node A: ImportError: boom" in excerpt and "node A: torchrun report line 39" in excerpt
    assert "starting" not in excerpt


def test_every_number_of_the_progress_line_says_what_it_is(capsys):
    from loader.cli.demo import ProgressLine

    progress = ProgressLine()
    for line in [
        "[rank 0] world size 4, grad_accum 3, resumed at step 0, epoch 0 (checkpoint load 0.001 s)",
        "[rank 0] step 1 loss 0.5",
        "[rank 0] step 2 loss 0.4",
        "[rank 3] fault injection: node during step 3",
        "[rank 0] step 2 loss 0.4",
        "[rank 0] world size 3, grad_accum 4, resumed at step 0, epoch 0 (checkpoint load 0.010 s)",
        "[rank 0] step 1 loss 0.5",
    ]:
        progress.show(line)
    assert capsys.readouterr().out.splitlines() == [
        "",
        "  launch 1, 4 workers, fresh start from step 0; optimizer steps completed: 1 2",
        "  fault injection: node during step 3 -> node B is gone (its agent and worker killed)",
        "  completed before the fault, reported after it: step 2",
        "  launch 2, 3 workers, fresh start from step 0; optimizer steps completed: 1",
    ]
