"""DCP the torchtitan way, real processes, real SIGKILLs: an FSDP2 model, its optimizer and the loader's progress in
one torch.distributed.checkpoint state dict, saved with `dcp.save` or `dcp.async_save`, loaded at another world
size: every sample of every epoch trained exactly once, and the loaded model is the checkpointed step's."""

import pytest

from tests.elastic import logs, run_generation
from tests.framework_jobs import assert_exactly_once, resumed_step
from tests.launch import REPO

pytestmark = pytest.mark.slow

JOB = REPO / "tests" / "dcp_job.py"


def run(run_dir, launch, world_size, *extra):
    argv = [str(run_dir), "--launch", str(launch), "--epochs", "2", "--accumulate", "2", *map(str, extra)]
    return run_generation(world_size, argv, run_dir.parent / f"logs-{launch}", timeout=180, example=JOB)


def test_dcp_save_at_three_ranks_resumes_at_two_after_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    codes = run(run_dir, 1, 3, "--fail-at-step", 13, "--fail-rank", 2)
    assert codes[2] == -9, logs(tmp_path / "logs-1")
    assert run(run_dir, 2, 2) == [0, 0], logs(tmp_path / "logs-2")
    assert resumed_step(run_dir, 2) == 12  # mid-epoch 1: 9 steps per epoch at 3 ranks
    assert_exactly_once(run_dir, epochs=2)


def test_async_save_holds_its_step_and_counts_once_written_a_kill_before_resumes_from_the_previous(tmp_path):
    """The checkpoint of step 3 reaches the disk only after steps 4 to 6 trained; the write of step 6 never
    finishes, and training dies before step 9. Step 6 has no .metadata, so the job resumes at 3 ranks from step 3:
    step 3's model (the job compares it with a snapshot) and step 3's progress (every sample once)."""
    run_dir = tmp_path / "run"
    codes = run(
        run_dir, 1, 2, "--async-save", "--hold-at-step", 3, "--stall-at-step", 6, "--fail-at-step", 8, "--fail-rank", 0
    )
    assert codes[0] == -9, logs(tmp_path / "logs-1")
    assert (run_dir / "step-000006").is_dir() and not (run_dir / "step-000006" / ".metadata").exists()
    assert run(run_dir, 2, 3, "--async-save") == [0, 0, 0], logs(tmp_path / "logs-2")
    assert resumed_step(run_dir, 2) == 3
    assert_exactly_once(run_dir, epochs=2)
