"""`python -m loader audit RUN_DIR --plot out.png`: the picture of a run drawn from its ledger, whose categories are
the audit's counts, with its launches, world sizes, replayed steps and failed batches where they happened."""

import sys

import numpy as np
import pytest

from loader import ResumableDataLoader, merge_states
from loader.checkpoint.audit import audit, tally
from loader.checkpoint.ledger import Ledger, read_ledger
from loader.cli.main import main as cli
from tests.conftest import IndexDataset
from tests.test_audit import skipped_and_duplicated

pytest.importorskip("matplotlib", reason="the picture needs matplotlib: pip install 'loader[bench]'")
from loader.cli.plot import CATEGORIES, DROPPED, DUPLICATED, FILTERED, ONCE, SKIPPED, categories_of, plot  # noqa: E402 - after the skip

PNG = b"\x89PNG\r\n\x1a\n"


class Flaky(IndexDataset):
    def __getitem__(self, index):
        if index in (17, 90):
            raise ValueError(f"bad sample {index}")
        return int(index)


def launch(run_dir, world: int, grad_accum: int, resumed_step: int, state, updates: int) -> list[dict]:
    """One launch of lockstep ranks (a global batch of 24), each with its ledger file of one new generation, as
    Ledger.open gives each rank of a process group: `updates` steps, going on into the next epoch. Returns the merged
    state after each step."""
    dataset = Flaky(121)
    ranks = [
        ResumableDataLoader(
            dataset, batch_size=2, rank=r, world_size=world, grad_accum=grad_accum, shuffle=True, seed=1
        )
        for r in range(world)
    ]
    first = Ledger.open(run_dir, resumed_step, len(dataset))
    for r, dl in enumerate(ranks):
        if state is not None:
            dl.load_state_dict(state)
        dl.ledger = first if r == 0 else Ledger(run_dir, first.path.parent / f"rank-{r:05d}.bin", resumed_step)
    iterators, states = [iter(dl) for dl in ranks], []
    while len(states) < updates:
        if ranks[0].exhausted:  # the pass ends (its StopIteration handed out), the next epoch begins
            assert all(next(it, None) is None for it in iterators)
            iterators = [iter(dl) for dl in ranks]
        for it in iterators:
            for _ in range(grad_accum):
                try:
                    next(it)
                except ValueError:
                    pass
        states.append(merge_states([dl.state_dict() for dl in ranks]))
    ranks[0].ledger.record_finished(states[-1], ranks[0])
    for dl in ranks:
        dl.ledger.close()
    return states


def test_the_picture_shows_each_launch_and_the_audits_categories(tmp_path, capsys):
    states = launch(tmp_path, world=4, grad_accum=3, resumed_step=0, state=None, updates=3)  # dies after step 3
    states = launch(tmp_path, world=3, grad_accum=4, resumed_step=2, state=states[1], updates=2)  # after step 4
    launch(tmp_path, world=2, grad_accum=6, resumed_step=3, state=states[0], updates=5)  # into epoch 1
    report = audit(tmp_path)
    picture = plot(tmp_path, tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG
    assert [(g.number, g.resumed_step) for g in picture.launches] == [(1, 0), (2, 2), (3, 3)]
    assert picture.ranks == {1: 4, 2: 3, 3: 2}
    for e in report:  # each epoch's indices are drawn in the audit's categories, as many as the audit counts
        drawn = picture.categories[e.epoch]
        assert sum(drawn.values()) == e.expected
        assert (drawn["seen once"], drawn["skipped"], drawn["duplicated"], drawn["failed to load"]) == (
            e.seen_once,
            len(e.skipped),
            len(e.duplicated),
            len(e.failed),
        )
        assert drawn["dropped by policy"] == e.dropped and drawn["not yet seen"] == (
            0 if e.finished else e.not_yet_seen
        )
        assert drawn["skipped on request"] == len(e.requested) - len(e.served_anyway)
    assert [e.epoch for e in report] == [0, 1] and report[0].finished and len(report[0].failed) == 4
    assert report[1].not_yet_seen > 0  # (121 = 5 * 24 + 1: the one more rides on the last step, nothing dropped)
    lines = {(line.generation, line.epoch): line for line in picture.lines}
    assert lines[1, 0].steps.tolist() == [1, 2, 3] and lines[1, 0].counted.tolist() == [True, True, False]
    assert lines[2, 0].steps.tolist() == [3, 4] and lines[2, 0].counted.tolist() == [True, False]
    assert lines[3, 0].steps.tolist() == [4, 5] and lines[3, 1].steps.tolist() == [6, 7, 8]
    assert lines[3, 0].positions[-1] == 121 and lines[1, 0].positions.tolist() == [24, 48, 72]
    assert lines[2, 0].positions[0] == lines[1, 0].positions[2] == 72  # a replay at the same global batch
    records, _, _ = read_ledger(tmp_path)
    assert [step for step, _ in picture.failed_at] == sorted({r.step for r in records if r.failed}) == [1, 5, 8]
    assert not picture.duplicated_at
    assert cli(["audit", str(tmp_path), "--plot", str(tmp_path / "cli.png")]) == 3  # epoch 1 unfinished
    assert f"audit: the run drawn in {tmp_path / 'cli.png'}" in capsys.readouterr().out
    assert (tmp_path / "cli.png").read_bytes()[:8] == PNG


def test_skips_and_duplicates_are_drawn_where_they_are(tmp_path):
    skipped_and_duplicated(tmp_path, dropped=[[11, 12]])  # 7, 8, 10 skipped, 11 dropped, 0 and 9 twice
    picture = plot(tmp_path, tmp_path / "run.png")
    assert picture.categories[0] == dict(zip(CATEGORIES, [6, 0, 1, 0, 0, 0, 3, 2], strict=True))
    assert picture.duplicated_at == [(1, 4), (2, 8), (3, 10)]  # 0 at steps 1 and 3, 9 at steps 2 and 3
    assert [line.counted.tolist() for line in picture.lines] == [[True, False], [True, True]]


def test_samples_skipped_on_request_are_drawn_as_such_not_as_skipped(tmp_path):
    """dl.skip() in a finished epoch and in one in progress: those samples are drawn in their own category, as many as
    the audit's "skipped on request" column counts; nothing is drawn as skipped (lost) or as not yet seen."""
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=1, collate_fn=list)
    dl.ledger = Ledger.open(tmp_path, 0, 40)
    it = iter(dl)
    for _ in range(3):
        next(it)
    dl.skip(updates=2)  # 8 samples of epoch 0
    for _ in dl:
        pass
    dl.skip(positions=range(4, 12), epoch=1)  # 8 samples of epoch 1, which then trains 2 batches
    it = iter(dl)
    for _ in range(2):
        next(it)
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    report = audit(tmp_path)
    picture = plot(tmp_path, tmp_path / "run.png")
    assert [len(e.requested) for e in report] == [8, 8] and report[0].finished and not report[1].finished
    for e in report:
        drawn = picture.categories[e.epoch]
        assert drawn["skipped on request"] == len(e.requested) and drawn["skipped"] == len(e.skipped) == 0
        assert drawn["seen once"] == e.seen_once and drawn["not yet seen"] == (0 if e.finished else e.not_yet_seen)
        assert sum(drawn.values()) == e.expected
    assert picture.categories[1] == dict(zip(CATEGORIES, [8, 24, 0, 0, 8, 0, 0, 0], strict=True))


def test_filtered_samples_are_drawn_as_such_and_a_second_delivery_as_duplicated(tmp_path):
    """The loader's filter= records what it dropped in records of their own (flag 32: 16 is an epoch's end): drawn
    as "filtered by policy", as many as the audit counts; filtered twice, or filtered and trained, is duplicated; a
    filtered sample is neither not yet seen nor skipped."""
    ledger = Ledger.open(tmp_path, 0, 8)
    ledger.record(0, np.array([0, 1]), True, filtered=np.array([2, 3]))
    ledger.record(0, np.array([3, 4]), True, filtered=np.array([2, 5]))  # 3 trained and filtered, 2 filtered twice
    ledger.close()
    (unfinished,) = audit(tmp_path)
    assert plot(tmp_path, tmp_path / "run.png").categories[0] == dict(
        zip(CATEGORIES, [3, 2, 0, 1, 0, 0, 0, 2], strict=True)
    )
    assert (unfinished.seen_once, unfinished.filtered.tolist(), unfinished.not_yet_seen) == (3, [5], 2)
    (tmp_path / "ledger" / "dropped").mkdir()
    np.save(tmp_path / "ledger" / "dropped" / "epoch-000000.npy", np.array([7]))  # finished: 6 skipped
    (e,) = audit(tmp_path)
    drawn = plot(tmp_path, tmp_path / "run.png").categories[0]
    assert drawn == dict(zip(CATEGORIES, [3, 0, 1, 1, 0, 0, 1, 2], strict=True))
    assert (e.finished, e.seen_once, e.duplicated.tolist(), e.filtered.tolist(), e.skipped.tolist()) == (
        True,
        3,
        [2, 3],
        [5],
        [6],
    )
    assert (drawn["filtered by policy"], drawn["duplicated"]) == (len(e.filtered), len(e.duplicated))
    (t,) = tally(read_ledger(tmp_path)[0], {0})
    assert categories_of(t, np.array([7]), np.zeros(0, np.int64), 8, 8)[1].tolist() == [
        ONCE,
        ONCE,
        DUPLICATED,
        DUPLICATED,
        ONCE,
        FILTERED,
        SKIPPED,
        DROPPED,
    ]


def test_without_matplotlib_the_plot_names_what_to_install(tmp_path, monkeypatch, capsys):
    Ledger.open(tmp_path, 0, 4).close()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as exit_:
        cli(["audit", str(tmp_path), "--plot", str(tmp_path / "run.png")])
    assert exit_.value.code == 2 and "pip install 'loader[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "run.png").exists()
