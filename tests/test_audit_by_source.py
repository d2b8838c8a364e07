"""The audit of a mixture run, per source: expected, seen once, skipped, duplicated, from the ledger and the plan."""

import numpy as np
import pytest

from loader import ResumableDataLoader, merge_states
from loader.checkpoint.audit import Grouping, audit
from loader.checkpoint.ledger import Ledger
from loader.cli.main import main as cli
from loader.sources import Mixture
from tests.conftest import IndexDataset


def mixture():
    sources = [IndexDataset(30), IndexDataset(7), IndexDataset(100)]
    return Mixture(sources, [0.5, 0.2, 0.3], num_samples=97, seed=4, names=["web", "code", "books"])


def run(run_dir, mix, world, resumed_step, state=None, updates=None):
    """Lockstep ranks, each with its own ledger file of one new generation (what Ledger.open gives each rank of a
    process group), `updates` updates or to the end of the epoch."""
    ranks = [
        ResumableDataLoader(mix, batch_size=2, rank=r, world_size=world, grad_accum=12 // (2 * world), drop_last=True)
        for r in range(world)
    ]
    first = Ledger.open(run_dir, resumed_step, len(mix))
    for r, dl in enumerate(ranks):
        if state is not None:
            dl.load_state_dict(state)
        dl.ledger = first if r == 0 else Ledger(run_dir, first.path.parent / f"rank-{r:05d}.bin", resumed_step)
    iterators = [iter(dl) for dl in ranks]
    done = 0
    while updates is None or done < updates:
        if not all(next(it, None) is not None for it in iterators for _ in range(ranks[0].grad_accum)):
            break
        done += 1
    merged = merge_states([dl.state_dict() for dl in ranks])
    ranks[0].ledger.record_finished(merged, ranks[0])
    for dl in ranks:
        dl.ledger.close()
    return merged


def test_a_resized_mixture_run_is_clean_source_by_source(tmp_path, capsys):
    mix = mixture()
    mix.plan.save(tmp_path / "mixture.json")
    state = run(tmp_path, mix, world=2, resumed_step=0, updates=3)
    run(tmp_path, mix, world=3, resumed_step=3, state=state)
    (epoch,) = audit(tmp_path, Grouping(mix.names, mix.plan.source_of, len(mix)))
    assert epoch.finished and epoch.clean and epoch.dropped == 97 % 12
    expected = mix.plan.samples_per_source()
    dropped = np.bincount(mix.plan.source_of(np.arange(96, 97)), minlength=3)  # drop_last: the 97th position
    assert [(g.name, g.expected, g.seen_once, g.skipped, g.duplicated, g.dropped) for g in epoch.groups] == [
        (name, n, n - d, 0, 0, d) for name, n, d in zip(mix.names, expected, dropped.tolist())
    ]
    assert cli(["audit", str(tmp_path), "--mixture", str(tmp_path / "mixture.json")]) == 0
    out = capsys.readouterr().out
    for name, n in zip(mix.names, expected):
        assert f"{name:>11} {n:>9}" in out
    assert "audit: every sample exactly once" in out


def test_skips_and_duplicates_are_counted_by_source_and_named_by_source_and_index(tmp_path, capsys):
    mix = mixture()
    mix.plan.save(tmp_path / "mixture.json")
    ledger = Ledger.open(tmp_path, 0, len(mix))
    ledger.record(0, np.arange(0, 90), True)
    ledger.record(0, np.array([5, 6]), True)  # positions 5 and 6 twice; 90..96 never
    ledger.record_finished({"finished": [{"epoch": 0, "dropped": []}]}, ResumableDataLoader(mix))
    ledger.close()
    (epoch,) = audit(tmp_path, Grouping(mix.names, mix.plan.source_of, len(mix)))
    source = mix.plan.source_of(np.arange(len(mix)))
    by_source = [(g.skipped, g.duplicated) for g in epoch.groups]
    assert by_source == [(int((source[90:] == s).sum()), int((source[5:7] == s).sum())) for s in range(3)]
    assert cli(["audit", str(tmp_path), "--mixture", str(tmp_path / "mixture.json")]) == 1
    out = capsys.readouterr().out
    name, index = mix.sample_key(5)
    assert f"duplicated indices: 5 ({name}:{index}), " in out and "FAILED" in out


def test_a_plan_of_another_length_is_refused(tmp_path):
    mix = mixture()
    ledger = Ledger.open(tmp_path, 0, 50)
    ledger.close()
    with pytest.raises(ValueError, match="describes a dataset of 97 samples, the ledger of .* one of 50"):
        audit(tmp_path, Grouping(mix.names, mix.plan.source_of, len(mix)))
