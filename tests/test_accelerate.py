"""Accelerate on CPU under torchrun, real processes, real SIGKILLs: model and optimizer prepared, the loader left
out of prepare() (which refuses it, saying so) and carried by `save_state()` / `load_state()` through
`register_for_checkpointing`, resumed exactly at the same and at another number of processes."""

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[accelerate]'")

from accelerate import Accelerator  # noqa: E402

from loader import ResumableDataLoader  # noqa: E402
from tests.conftest import IndexDataset  # noqa: E402
from tests.framework_jobs import assert_exactly_once, resumed_step  # noqa: E402
from tests.launch import launch  # noqa: E402


def test_prepare_refuses_the_loader_and_says_what_to_do_instead():
    dl = ResumableDataLoader(IndexDataset(10), batch_size=2)
    with pytest.raises(TypeError, match=r"leave it out of prepare\(\).*register_for_checkpointing"):
        Accelerator(cpu=True).prepare(dl)


def run(run_dir, launch_number, processes, *extra, timeout=240):
    argv = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(processes),
        "--max-restarts",
        "0",
        "tests/accelerate_job.py",
        str(run_dir),
        "--launch",
        str(launch_number),
        *map(str, extra),
    ]
    return launch(argv, run_dir.parent / f"launch-{launch_number}.log", timeout)


@pytest.mark.slow
def test_save_state_load_state_after_sigkill_at_the_same_and_another_process_count(tmp_path):
    """13 steps per epoch at 2 processes in updates of 2 micro-batches of 4, 9 at 3; a checkpoint every 3 steps.
    Launch 1 dies before step 6, launch 2 (same count) before step 17 in epoch 1, launch 3 finishes at 3."""
    run_dir = tmp_path / "run"
    job = ("--epochs", 2, "--every", 3, "--accumulate", 2)
    assert run(run_dir, 1, 2, *job, "--fail-at-step", 5, "--fail-rank", 1) != 0
    assert run(run_dir, 2, 2, *job, "--fail-at-step", 16, "--fail-rank", 0) != 0
    assert run(run_dir, 3, 3, *job) == 0, (tmp_path / "launch-3.log").read_text()
    assert (resumed_step(run_dir, 2), resumed_step(run_dir, 3)) == (3, 15)
    assert_exactly_once(run_dir, epochs=2)
