"""examples/train_3d.py end to end: FSDP2 over the data-parallel dimension, tensor parallelism (DTensor) over "tp",
DCP with LoaderState; a rank SIGKILLed at dp 2 x tp 2, the job restarted under a real torchrun at dp 3 x tp 1. Every
sample of every epoch is trained exactly once (the ledger's audit, by sample identity), and the final model equals
the uninterrupted run's within float64 rounding: the global batch of every update holds the same samples at every
mesh shape, and only the order of the gradient sums changes (measured: 6e-17 apart)."""

import pytest
import torch

from loader.checkpoint.audit import audit
from tests.elastic import logs, run_generation
from tests.launch import REPO, launch

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "train_3d.py"


def argv(run_dir, *extra):
    return [
        "--run-dir",
        str(run_dir),
        "--samples",
        "96",
        "--epochs",
        "2",
        "--global-batch",
        "12",
        "--ledger",
        *map(str, extra),
    ]


def test_a_rank_killed_at_dp2_tp2_resumes_under_torchrun_at_dp3_tp1_every_sample_once_same_model(tmp_path):
    reference = tmp_path / "reference"
    codes = run_generation(4, argv(reference, "--dp-shard", 2, "--tp", 2), tmp_path / "logs-ref", example=EXAMPLE)
    assert codes == [0] * 4, logs(tmp_path / "logs-ref")

    run = tmp_path / "run"
    codes = run_generation(
        4,
        argv(run, "--dp-shard", 2, "--tp", 2, "--fail-at-step", 10, "--fail-rank", 3),
        tmp_path / "logs-1",
        example=EXAMPLE,
    )
    assert codes[3] == -9, logs(tmp_path / "logs-1")  # SIGKILLed during step 11, after the checkpoint of step 9
    log = tmp_path / "torchrun.log"
    code = launch(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=3",
            str(EXAMPLE),
            *argv(run, "--dp-shard", 3, "--tp", 1),
        ],
        log,
        timeout=300,
    )
    assert code == 0, log.read_text()[-5000:]
    assert "mesh (1, 3, 1) (dp_replicate, dp_shard, tp), grad_accum 2, resumed at step 9, epoch 1" in log.read_text()

    report = audit(run)
    assert [e.epoch for e in report if e.finished] == [0, 1]
    assert all(e.clean and e.seen_once == 96 for e in report)
    ours, theirs = torch.load(run / "final-model.pt"), torch.load(reference / "final-model.pt")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-12, atol=1e-14)
        assert ours[key].dtype == torch.float64
