"""torchtitan's own Trainer (`torchtitan.train`, its llama3 debug model) with `ResumableTitanLoader`, under a real
torchrun on CPU and gloo, without triton (tests/titan_job.py says what it changes for that): a rank SIGKILLed at 2
data-parallel ranks after a step its CheckpointManager did not save, the job relaunched at 1, and every window of both
epochs trained exactly once by the ledger's audit, where torchtitan's own loader refuses the relaunch."""

import importlib.util
import sys

import numpy as np
import pytest
import torch

# What torchtitan's trainer imports beyond the test extra (tyro brings its own two). CI installs them as .ci/run's
# torchtitan lines do (torchtitan itself with --no-deps: its datasets<4.8 conflicts with the constraints' fsspec).
MISSING = [name for name in ("torchtitan", "spmd_types", "tyro", "tokenizers") if not importlib.util.find_spec(name)]
if MISSING:
    pytest.skip(
        f"not installed: {', '.join(MISSING)}; install them as .ci/run does (docs/frameworks.md, torchtitan's Trainer)",
        allow_module_level=True,
    )

from loader.checkpoint.audit import audit  # noqa: E402
from loader.cli.main import main as cli  # noqa: E402
from loader.integrations.torchtitan import ResumableTitanLoader  # noqa: E402
from tests.launch import REPO, launch  # noqa: E402

JOB = REPO / "tests" / "titan_job.py"
SEQ_LEN, WINDOWS = 32, 13  # 3 steps of 4 windows an epoch at 2 ranks and at 1; one dropped by policy each epoch


def trainer(run_dir, ranks: int, steps: int, log, kill: str | None = None) -> int:
    args = [
        "--module",
        "tests.titan_job",
        "--config",
        "llama3_debugmodel_loader_cpu",
        "--dump_folder",
        str(run_dir),
        "--hf_assets_path",
        str(run_dir.parent / "tokenizer"),
        "--dataloader.dataset_path",
        str(run_dir.parent / "tokens.bin"),
        "--dataloader.ledger_dir",
        str(run_dir),
        "--training.seq_len",
        str(SEQ_LEN),
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--training.steps",
        str(steps),
        "--checkpoint.interval",
        "2",
        "--comm.init_timeout_seconds",
        "60",
    ]
    return launch(
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(JOB), *args],
        log,
        timeout=300,
        env=None if kill is None else {"LOADER_TITAN_KILL": kill},
    )


@pytest.mark.slow
def test_a_rank_killed_at_dp2_resumes_at_dp1_through_torchtitans_checkpoint_every_window_once(tmp_path):
    rng = np.random.default_rng(0)
    rng.integers(0, 2048, WINDOWS * SEQ_LEN + 1).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.json").write_text('{"<unk>": 0}')  # the trainer loads one; the data needs none
    run = tmp_path / "run"

    first = trainer(run, 2, 6, tmp_path / "launch-1.log", kill="3:1")  # rank 1 dies after step 3, saved at 2
    text = (tmp_path / "launch-1.log").read_text()
    assert first != 0 and "exitcode  : -9" in text, text[-5000:]
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-2"]

    assert trainer(run, 1, 6, tmp_path / "launch-2.log") == 0, (tmp_path / "launch-2.log").read_text()[-5000:]
    text = (tmp_path / "launch-2.log").read_text()
    assert "Training starts at step 3" in text and "gradient accumulation steps 2" in text

    assert cli(["audit", str(run)]) == 0  # `python -m loader audit`: every epoch finished, every window once
    report = audit(run)  # at 1 rank and batch 2, each epoch drops its last window by policy
    assert [(e.epoch, e.expected, e.finished, e.clean, e.seen_once, e.dropped) for e in report] == [
        (0, WINDOWS, True, True, 12, 1),
        (1, WINDOWS, True, True, 12, 1),
    ]


def test_the_shims_stand_in_for_the_triton_kernels_refuses_every_call_by_name(monkeypatch):
    """The trainer above runs without triton only because no kernel of the replaced module is called: one that were
    would end the run with this error, never compute anything."""
    from tests import titan_job

    monkeypatch.setitem(sys.modules, titan_job.KERNELS, None)  # restored (removed) after the test
    titan_job.without_triton_kernels()
    from torchtitan.distributed.minimal_async_ep.kernels import copy_rows_to_peers_kernel

    with pytest.raises(RuntimeError, match=r"kernels.copy_rows_to_peers_kernel: a Triton kernel of MinimalAsyncEP"):
        copy_rows_to_peers_kernel(torch.zeros(2), rank=0)
    assert not hasattr(sys.modules[titan_job.KERNELS], "__path__")  # a module, not a package, to importlib


@pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")  # torchdata's StatefulDataLoader, not ours
def test_torchtitans_own_loader_refuses_another_data_parallel_degree():
    """What the test above does, torchtitan 0.3's ParallelAwareDataloader refuses (an AssertionError)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    saved = ParallelAwareDataloader(list(range(8)), dp_rank=0, dp_world_size=2, batch_size=2).state_dict()
    with pytest.raises(
        AssertionError,
        match="dp_degree is inconsistent before and after checkpoint, dataloader resharding is not supported yet",
    ):
        ParallelAwareDataloader(list(range(8)), dp_rank=0, dp_world_size=1, batch_size=2).load_state_dict(saved)


def build(tmp_path, windows: int, dp_world_size: int = 1, **config):
    """As the trainer builds it (one process)."""
    np.arange(windows * SEQ_LEN + 1, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    config = ResumableTitanLoader.Config(dataset_path=str(tmp_path / "tokens.bin"), **config)
    return config.build(
        dp_world_size=dp_world_size,
        dp_rank=0,
        tokenizer=None,
        seq_len=SEQ_LEN,
        local_batch_size=2,
        snapshot_every_n_steps=None,
    )


def test_the_batches_are_torchtitans_inputs_positions_and_labels_epoch_after_epoch(tmp_path):
    dl = build(tmp_path, 5)  # 5 windows, batches of 2: 2 batches an epoch, one window dropped
    batches = iter(dl)
    seen = []
    for _ in range(4):
        inputs, labels = next(batches)
        assert inputs["input"].shape == labels.shape == (2, SEQ_LEN)
        assert (inputs["input"][:, 1:] == labels[:, :-1]).all()  # the next token
        assert (inputs["positions"] == np.arange(SEQ_LEN)).all()
        seen.append(sorted(int(row[0]) // SEQ_LEN for row in inputs["input"]))
    assert dl.loader.epoch == 1
    assert all(len(set(sum(seen[e * 2 : e * 2 + 2], []))) == 4 for e in (0, 1))  # 4 distinct windows per epoch


def test_a_config_without_files_too_little_data_or_a_ledger_it_cannot_write_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dataset_path must name the token files"):
        ResumableTitanLoader.Config().build(dp_world_size=1, dp_rank=0, seq_len=SEQ_LEN, local_batch_size=2)
    with pytest.raises(ValueError, match="fill no batch of 2 on each of 1"):
        build(tmp_path, 1)
    with pytest.raises(ValueError, match="one writer per data-parallel rank"):
        build(tmp_path, 8, dp_world_size=2, ledger_dir=str(tmp_path / "run"))  # 1 process, 2 dp ranks
