"""`python -m loader inspect PATH`: a real checkpoint of save_checkpoint, through its run directory and itself, and
crafted input that exits 2 naming the file and the field, never with a traceback, never running what it names."""

import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loader import ResumableDataLoader, merge_states
from loader.checkpoint import save_checkpoint
from loader.checkpoint.publish import publish, verify
from loader.cli.main import main
from tests.test_checkpoint import RunsCommand, _with_metadata, make
from tests.test_mixture_schedule import scheduled

N, WINDOW = 64, 4
AMENDED = [{"from": [3, 1], "to": [0, 1], "windows": 6}, {"weights": [1, 1]}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run over a mixture whose schedule was changed at position 12: 3 steps of 4 trained, checkpointed, and its
    plan saved as the guide saves it."""
    run_dir = tmp_path_factory.mktemp("run")
    old = scheduled([13, 7], [{"weights": [3, 1]}], N, window=WINDOW, names=["web", "code"])
    mix = scheduled([13, 7], AMENDED, N, window=WINDOW, names=["web", "code"], amends=old.plan, change_at=12)
    dl = ResumableDataLoader(mix, batch_size=4, shuffle=False, collate_fn=list)
    model = torch.nn.Linear(2, 1)
    it = iter(dl)
    for _ in range(3):
        next(it)
    save_checkpoint(run_dir, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=dl)
    mix.plan.save(run_dir / "mixture.json")
    return run_dir


def _inspect(capsys, *args) -> tuple[int, str, str]:
    status = main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_run_directory_and_its_checkpoint_are_described_as_a_user_reads_them(run, capsys):
    """Step, epoch, world size, committed and remaining samples, the mixture plan with its change, and every file
    verified; the run directory names its newest checkpoint that verifies, and why it skipped a newer broken one."""
    status, out, err = _inspect(capsys, run / "step-000000003")
    assert status == 0 and err == "", err
    assert "  step 3, epoch 0, world size 1, saved " in out
    assert (
        "progress: epoch 0 of 64 samples (seed 0, shuffle none): 12 committed (0 of them skipped on request), "
        "52 remaining\n" in out
    )
    files = verify(run / "step-000000003").files
    assert f"files verified (size and sha256): .metadata ({files['.metadata'].size:,} B), " in out
    assert "mixture plan " + str(run / "mixture.json") + ": web (13 samples), code (7 samples)\n" in out
    assert (
        "web/code slots per window of 4, by position: 0-11 3/1, 12-23 3/1 -> 0/4, 24-63 2/2, changed at position "
        "12 (window 3)" in out
    )
    broken = run.parent / "run-with-a-misnamed-newer"
    shutil.copytree(run, broken)
    shutil.copytree(run / "step-000000003", broken / "step-000000009")
    status, out, err = _inspect(capsys, broken)
    assert status == 0, err
    assert out.startswith(
        f"run {broken}: newest checkpoint that verifies step-000000003\n  skipping checkpoint "
        f"{broken / 'step-000000009'}: manifest.json says step 3 but the directory is named for "
        f"step 9."
    )
    with open(broken / "step-000000003" / "__0_0.distcp", "r+b") as f:
        f.write(b"X")
    status, out, err = _inspect(capsys, broken)
    assert status == 2 and out == "" and err.startswith(f"inspect: {broken}: no checkpoint (step-NNNNNNNNN/ with a ")
    assert f"skipping checkpoint {broken / 'step-000000003'}: checksum mismatch for '__0_0.distcp'" in err


@pytest.mark.slow  # a process of its own
def test_the_command_as_a_user_runs_it(run):
    done = subprocess.run(
        [sys.executable, "-m", "loader", "inspect", str(run)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "12 committed" in done.stdout and "mixture plan" in done.stdout, done.stderr


def _published(tmp_path, run, write, **extra):
    """Step 5 published as save_checkpoint publishes (a manifest that verifies), its files written by `write`."""
    manifest_extra = {**verify(run / "step-000000003").extra, **extra}
    return publish(tmp_path / "crafted", 5, write, manifest_extra=manifest_extra)


def _progress_saved(progress):
    def write(target):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.save({"loader": {"progress": progress}}, checkpoint_id=target, no_dist=True)

    return write


def test_bad_input_exits_2_naming_the_file_and_the_field(run, tmp_path, capsys):
    progress = merge_states([ResumableDataLoader(range(64), batch_size=4).state_dict()])
    progress["committed"] = [[0, [8, 4]]]
    plan = json.loads((run / "mixture.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps({**plan, "num_samples": 65}))
    (tmp_path / "truncated.json").write_text(json.dumps({k: v for k, v in plan.items() if k != "lengths"}))
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "missing", [], f"{tmp_path / 'missing'}: no such directory"),
        (tmp_path / "empty", [], f"{tmp_path / 'empty'}: no checkpoint (step-NNNNNNNNN/ with a manifest.json)"),
        (
            run,
            ["--mixture", tmp_path / "other.json"],
            f"{tmp_path / 'other.json'}: num_samples is 65, the checkpoint's progress has 64",
        ),
        (run, ["--mixture", tmp_path / "truncated.json"], f"{tmp_path / 'truncated.json'}: no field 'lengths'"),
        (_published(tmp_path / "a", run, _progress_saved("{")), [], "the loader progress: not JSON"),
        (
            _published(tmp_path / "b", run, _progress_saved(json.dumps(progress))),
            [],
            "the loader progress.committed[epoch 0]",
        ),
        (
            _published(tmp_path / "d", run, _progress_saved(json.dumps({"kind": "streams"}))),
            [],
            "the loader progress: state has no field 'format'",
        ),
    ]
    for path, flags, message in cases:
        status, out, err = _inspect(capsys, path, *flags)
        assert (status, out) == (2, ""), (path, out, err)
        assert err.startswith("inspect: ") and message in err and "Traceback" not in err, (message, err)

    def copied(target):
        for part in (run / "step-000000003").iterdir():
            if part.name != "manifest.json":
                shutil.copy(part, target / part.name)

    status, _, err = _inspect(capsys, _published(tmp_path / "c", run, copied, checkpoint_format=1))
    assert status == 2 and "manifest.json: extra.checkpoint_format is 1, this release reads 2" in err, err


def test_a_crafted_metadata_exits_2_naming_the_file_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    objects = make()
    next(iter(objects["loader"]))
    crafted = _with_metadata(tmp_path, objects, RunsCommand(marker))
    status, out, err = _inspect(capsys, crafted)
    assert status == 2 and f"checkpoint file {crafted / '.metadata'} names " in err and "system" in err, err
    assert not marker.exists()
