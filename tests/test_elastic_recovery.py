"""Real elastic recovery: ranks are real processes, failures are real SIGKILLs, the gloo group is real.

Each scenario runs examples/train_elastic.py through tests/elastic.py (a fork-based agent that, like torchrun's,
stops the whole generation when a rank fails and starts the next one from the newest verified checkpoint).
"""

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from loader.checkpoint.audit import audit
from loader.checkpoint.publish import latest
from tests.elastic import EXAMPLE, load_example, logs, run_generation

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 10  # 240 samples, global batch 24, drop_last


def job(run_dir, *extra):
    return [
        "--run-dir",
        str(run_dir),
        "--samples",
        "240",
        "--global-batch",
        "24",
        "--micro-batch",
        "2",
        "--checkpoint-every",
        "3",
        "--ledger",
        *extra,
    ]


def assert_audit_clean(run_dir, epochs=1):
    report = audit(run_dir)
    assert [e.epoch for e in report if e.finished] == list(range(epochs))
    for e in report:
        assert e.clean, f"epoch {e.epoch}: skipped {e.skipped.tolist()} duplicated {e.duplicated.tolist()}"
        assert e.seen_once + e.dropped == e.expected


def final_model(run_dir):
    return torch.load(run_dir / "final-model.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run at 2 ranks, with model and optimizer saved after every step."""
    root = tmp_path_factory.mktemp("reference")
    codes = run_generation(
        2, job(root / "run", "--snapshot-dir", str(root / "snapshots")), root / "logs", collector=False
    )  # see test_the_example_leaves_the_group_holding_nothing
    assert codes == [0, 0], logs(root / "logs")
    return root


def test_the_example_leaves_the_group_holding_nothing(reference):
    """Destroyed while the DDP model was alive (in a reference cycle after train() returned, until the collector
    ran: the reference's ranks run without it, so that this does not depend on when it would), the group was
    freed at the interpreter's exit, where gloo's teardown hangs at times (pytorch#56297); the ledger's file too."""
    for rank, text in logs(reference / "logs").items():
        assert "held at teardown: 0 DDP, 0 ledger files, 0 workers" in text, f"rank {rank}: {text[-2000:]}"
        assert f"[rank {rank}] left the process group" in text


def assert_final_model_close(run, reference_run):
    """After a resize the summation order changes, so equal within float tolerance rather than bitwise."""
    ours, theirs = final_model(run), final_model(reference_run)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)


def snapshot(root, step):
    return torch.load(root / f"step-{step:05d}.pt")


def assert_bitwise_equal(a, b, where):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_same_world_size_restart_after_sigkill_is_bitwise_equal(tmp_path, reference):
    run = tmp_path / "run"
    first = run_generation(2, job(run, "--fail-at-step", "7", "--fail-rank", "1"), tmp_path / "logs1")
    assert first[1] == -9  # rank 1 was SIGKILLed in the middle of step 8
    assert run_generation(2, job(run, "--snapshot-dir", str(tmp_path / "snapshots")), tmp_path / "logs2") == [0, 0]
    assert "resumed at step 6" in logs(tmp_path / "logs2")[0]
    for step in range(7, STEPS_PER_EPOCH + 1):  # every step after the restart, model and optimizer
        assert_bitwise_equal(
            snapshot(tmp_path / "snapshots", step), snapshot(reference / "snapshots", step), f"step {step}"
        )
    assert_audit_clean(run)


@pytest.mark.parametrize("worlds", [(4, 3), (2, 4)])
def test_world_size_change_keeps_the_trajectory_and_every_sample_once(tmp_path, reference, worlds):
    before, after = worlds
    run = tmp_path / "run"
    codes = run_generation(before, job(run, "--fail-at-step", "4", "--fail-rank", str(before - 1)), tmp_path / "logs1")
    assert codes[before - 1] == -9
    assert run_generation(after, job(run), tmp_path / "logs2") == [0] * after
    assert f"world size {after}, grad_accum {24 // (2 * after)}, resumed at step 3" in logs(tmp_path / "logs2")[0]
    assert_final_model_close(run, reference / "run")
    assert_audit_clean(run)


def test_two_failures_in_a_row_shrink_4_3_2_and_still_every_sample_once(tmp_path, reference):
    run = tmp_path / "run"
    assert run_generation(4, job(run, "--fail-at-step", "2", "--fail-rank", "3"), tmp_path / "logs1")[3] == -9
    assert run_generation(3, job(run, "--fail-at-step", "7", "--fail-rank", "0"), tmp_path / "logs2")[0] == -9
    assert "world size 3, grad_accum 4, resumed at step 0" in logs(tmp_path / "logs2")[0]
    assert run_generation(2, job(run), tmp_path / "logs3") == [0, 0]
    assert "world size 2, grad_accum 6, resumed at step 6" in logs(tmp_path / "logs3")[0]
    assert_final_model_close(run, reference / "run")
    assert_audit_clean(run)


def test_kill_during_checkpoint_write_falls_back_to_the_previous_checkpoint(tmp_path, reference):
    run = tmp_path / "run"
    codes = run_generation(
        2, job(run, "--fail-at-step", "6", "--fail-rank", "0", "--fail-mode", "checkpoint"), tmp_path / "logs1"
    )
    assert codes[0] == -9
    torn = [p.name for p in run.iterdir() if ".tmp-" in p.name]
    assert torn and torn[0].startswith("step-000000006.tmp-")  # the data files were written, the manifest not
    with pytest.warns(UserWarning, match="step-000000006.tmp-"):
        assert latest(run).name == "step-000000003"
    assert run_generation(2, job(run), tmp_path / "logs2") == [0, 0]
    assert "resumed at step 3" in logs(tmp_path / "logs2")[0]
    assert_bitwise_equal(final_model(run), final_model(reference / "run"), "final model")
    assert_audit_clean(run)


def test_uneven_consumption_with_join_then_resize(tmp_path):
    run = tmp_path / "run"
    assert run_generation(3, job(run, "--uneven", "3"), tmp_path / "logs1") == [0, 0, 0]
    first = logs(tmp_path / "logs1")
    assert "uneven input: stopping" in first[1] and "uneven input: stopping" in first[2]
    manifest = json.loads((latest(run) / "manifest.json").read_text())
    assert manifest["extra"]["epoch"] == 0  # the epoch is not finished: ranks 1 and 2 left holes
    assert [e.finished for e in audit(run)] == [False]
    assert run_generation(2, job(run), tmp_path / "logs2") == [0, 0]
    assert_audit_clean(run)


def test_torchrun_as_documented_restarts_without_any_setting_of_the_agent(tmp_path, reference):
    """The example's command line under a real torchrun agent, whose shared rendezvous store keeps the keys of the
    launch before; nothing in the environment tells it otherwise."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE.parent.parent), "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(EXAMPLE),
            *job(run, "--fail-at-step", "4", "--fail-rank", "1", "--timeout", "30"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[rank 1] fault injection: sigkill during step 5" in done.stdout
    assert "[rank 0] left the process group" in done.stdout and "[rank 1] left the process group" in done.stdout
    assert "[rank 0] world size 2, grad_accum 6, resumed at step 3" in done.stdout
    assert_final_model_close(run, reference / "run")
    assert_audit_clean(run)


def test_several_agents_sharing_their_store_are_told_how_to_restart_safely(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="start every agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        load_example()._store_of_this_launch(timedelta(seconds=5))


def test_exception_and_clean_exhaustion_are_told_apart_in_the_logs(tmp_path):
    failed = run_generation(
        2, job(tmp_path / "a", "--fail-at-step", "2", "--fail-rank", "1", "--fail-mode", "exception"), tmp_path / "la"
    )
    assert failed[1] == 1
    text = logs(tmp_path / "la")
    assert "FAILED during step 3: RuntimeError: injected failure during step 3" in text[1]
    assert all("iterator exhausted" not in t for t in text.values())
    assert run_generation(2, job(tmp_path / "b"), tmp_path / "lb") == [0, 0]
    for t in logs(tmp_path / "lb").values():
        assert "epoch 0 finished: iterator exhausted after step 10" in t and "FAILED" not in t


def test_a_batch_size_ramp_resumes_at_another_world_size_with_every_step_as_uninterrupted(tmp_path):
    """--ramp 0:12,3:24,5:36 over 120 samples: rank 2 of 3 SIGKILLed in step 5, the job resumes from step 3 at 2
    ranks (K 6 for 24); every step trains the samples an uninterrupted single-process loader's step does, each sample
    once."""
    from examples.train_elastic import Regression
    from loader import ResumableDataLoader
    from loader.checkpoint.ledger import read_ledger
    from loader.core.batch_policy import BatchPolicy

    run, ramp = tmp_path / "run", [(0, 12), (3, 24), (5, 36)]
    argv = job(run, "--ramp", "0:12,3:24,5:36", "--samples", "120")
    assert run_generation(3, [*argv, "--fail-at-step", "4", "--fail-rank", "2"], tmp_path / "logs1")[2] == -9
    assert run_generation(2, argv, tmp_path / "logs2") == [0, 0]
    assert "world size 2, grad_accum 6, resumed at step 3" in logs(tmp_path / "logs2")[0]
    assert_audit_clean(run)
    trained: dict[int, list[int]] = {}
    for record in read_ledger(run)[0]:
        trained.setdefault(record.step, []).extend(record.indices.tolist())
    uninterrupted = ResumableDataLoader(
        Regression(120), batch_size=2, shuffle=True, seed=0, batch_policy=BatchPolicy(ramp, 2), drop_last=True
    )
    expected, current = [], []
    for _ in uninterrupted:
        current += uninterrupted.last_indices().tolist()
        if uninterrupted.update_complete:
            expected.append(sorted(current))
            current = []
    assert [len(s) for s in expected] == [12, 12, 12, 24, 24, 36]
    assert [sorted(trained[s]) for s in sorted(trained)] == expected
