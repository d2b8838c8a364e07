"""The ledger and the audit: replayed steps do not count, and skips and duplicates are reported with indices."""

import numpy as np
import pytest

from loader import ResumableDataLoader, merge_states
from loader.checkpoint.audit import EXACTLY_ONCE, FAILED, NO_LEDGER, UNFINISHED, audit
from loader.checkpoint.ledger import Ledger, read_ledger
from loader.cli.main import main as cli
from tests.conftest import IndexDataset


def train(run_dir, dl, resumed_step, micro_batches):
    dl.ledger = Ledger.open(run_dir, resumed_step, len(dl.dataset))
    it = iter(dl)
    for _ in range(micro_batches):
        next(it)
    state = merge_states([dl.state_dict()])
    dl.ledger.record_finished(state, dl)
    dl.ledger.close()
    return state


def test_replayed_steps_do_not_count_and_the_audit_is_clean(tmp_path, capsys):
    kw = dict(batch_size=4, shuffle=True, grad_accum=2, seed=3)
    first = ResumableDataLoader(IndexDataset(40), **kw)
    state = train(tmp_path, first, 0, 7)  # 3 whole steps, then half of step 4: a crash
    second = ResumableDataLoader(IndexDataset(40), **kw)
    second.load_state_dict(state)
    train(tmp_path, second, 3, second.batches_left)
    records, dropped, n = read_ledger(tmp_path)
    assert n == 40 and dropped.keys() == {0}
    assert max(r.step for r in records if r.generation == 1) == 3  # step 4 of the first launch was replayed
    (epoch,) = audit(tmp_path)
    assert epoch.clean and epoch.finished and epoch.seen_once == 40
    assert cli(["audit", str(tmp_path)]) == 0
    assert "audit: every sample exactly once" in capsys.readouterr().out


def skipped_and_duplicated(run_dir, dropped: list) -> None:
    """A ledger whose second launch, resumed from step 1, replays step 2 as other samples: 7 is skipped, 9 comes
    twice; 8, 10 and 11 never come (those that `dropped`, intervals of positions, does not drop); 0 comes again."""
    dl = ResumableDataLoader(IndexDataset(12), batch_size=4)
    ledger = Ledger.open(run_dir, 0, 12)
    ledger.record(0, np.array([0, 1, 2, 3]), True)
    ledger.record(0, np.array([4, 5, 6, 7]), True)
    ledger.close()
    ledger = Ledger.open(run_dir, 1, 12)  # resumed from step 1: the second batch is replayed...
    ledger.record(0, np.array([4, 5, 6, 9]), True)  # ...but as different samples
    ledger.record(0, np.array([0, 9]), True)
    ledger.record_finished({"finished": [{"epoch": 0, "dropped": dropped}]}, dl)
    ledger.close()


def test_skips_and_duplicates_are_reported_with_their_indices(tmp_path, capsys):
    skipped_and_duplicated(tmp_path, dropped=[])
    (epoch,) = audit(tmp_path)
    assert epoch.skipped.tolist() == [7, 8, 10, 11] and epoch.duplicated.tolist() == [0, 9]
    assert cli(["audit", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "skipped indices: 7, 8, 10, 11" in out and "duplicated indices: 0, 9" in out and "FAILED" in out


class FailsAt3(IndexDataset):
    def __getitem__(self, index):
        if index == 3:
            raise ValueError("bad sample 3")
        return int(index)


def take(it, count: int) -> None:
    for _ in range(count):
        try:
            next(it)
        except ValueError:
            pass


def test_a_failed_batch_that_completes_an_update_advances_the_ledger_step(tmp_path):
    """The ledger labels each record with the step it feeds: a failed last micro-batch completes its step too, or
    every later record of that rank would be labelled a step early, and a resume would count the replayed one twice."""
    kw = dict(batch_size=2, grad_accum=2)
    first = ResumableDataLoader(FailsAt3(16), **kw)
    first.ledger = Ledger.open(tmp_path, 0, 16)
    it = iter(first)
    take(it, 4)  # step 1: [0, 1] and [2, 3], which fails; step 2: [4, 5], [6, 7]
    state = merge_states([first.state_dict()])
    take(it, 2)  # step 3, then a crash
    first.ledger.close()
    second = ResumableDataLoader(FailsAt3(16), **kw)
    second.load_state_dict(state)
    second.ledger = Ledger.open(tmp_path, 2, 16)
    take(iter(second), 4)
    second.ledger.record_finished(merge_states([second.state_dict()]), second)
    second.ledger.close()
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean and epoch.seen_once == 14 and epoch.failed.tolist() == [2, 3]


def test_a_torn_last_record_is_ignored(tmp_path):
    ledger = Ledger.open(tmp_path, 0, 8)
    ledger.record(0, np.arange(4), True)
    ledger.record(0, np.arange(4, 8), False)
    ledger.close()
    path = ledger.path
    path.write_bytes(path.read_bytes()[:-5])  # a crash in the middle of writing the second record
    records, _, _ = read_ledger(tmp_path)
    assert [r.indices.tolist() for r in records] == [[0, 1, 2, 3]]


def test_a_run_without_a_ledger_is_one_clear_line(tmp_path, capsys):
    assert cli(["audit", str(tmp_path)]) == NO_LEDGER == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"audit: {tmp_path / 'ledger'} holds no ledger: run the job with a Ledger attached\n"


def test_a_mistyped_run_directory_is_named_as_missing(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert cli(["audit", str(missing)]) == NO_LEDGER
    assert capsys.readouterr().err == f"audit: {missing}: no such directory (the run directory whose ledger/ to read)\n"


def test_audit_help_lists_its_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        cli(["audit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for status, meaning in (
        (EXACTLY_ONCE, "every sample exactly once"),
        (FAILED, "skipped or duplicated"),
        (NO_LEDGER, "no ledger"),
        (UNFINISHED, "unfinished"),
    ):
        assert f"{status}: " in out and meaning in out


def test_a_crashed_job_never_restarted_is_reported_unfinished_not_exactly_once(tmp_path, capsys):
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=True, grad_accum=2, seed=3)
    train(tmp_path, dl, 0, 7)  # 3 whole steps (24 samples), then half of step 4: the crash
    (epoch,) = audit(tmp_path)
    assert not epoch.finished and epoch.clean and (epoch.seen_once, epoch.not_yet_seen) == (24, 16)
    assert cli(["audit", str(tmp_path)]) == UNFINISHED == 3
    out = capsys.readouterr().out
    assert "audit: epoch 0 unfinished: 24 of 40 samples seen once so far, 16 not yet seen, none duplicated" in out
    assert "exactly once" not in out
