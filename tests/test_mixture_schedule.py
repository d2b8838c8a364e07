"""Mixture schedules: weights that change with the window, exact per window, closed-form draw counters, and an
explicit change of schedule in a running job that keeps the past and repeats or leaves out no source sample."""

import json
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, SampleIndex, merge_states
from loader.checkpoint.publish import CheckpointError
from loader.checkpoint.save import check_change, load_checkpoint, save_checkpoint
from loader.core.state import StateError
from loader.sources import Mixture, MixturePlan
from loader.sources import mixture as mixture_module
from tests.test_mixture import Tagged, mixture


def scheduled(lengths, schedule, num_samples, seed=0, **kw):
    return Mixture(
        [Tagged(n, f"s{i}") for i, n in enumerate(lengths)], None, num_samples, seed, schedule=schedule, **kw
    )


def ideal(schedule, window: int, k: int) -> list[Fraction]:
    """The realised weight times M at window k, from the segments as the user wrote them: each weight vector
    apportioned to M (window_counts), a ramp linear between its ends; after the last segment, its final counts."""
    start = 0
    for segment in schedule:
        first, last = (realised(segment.get("weights", segment.get(end)), window) for end in ("from", "to"))
        length = segment.get("windows")
        if length is None or k < start + length:
            return [Fraction(a) + Fraction((b - a) * (k - start), length or 1) for a, b in zip(first, last)]
        start += length
    return [Fraction(b) for b in last]


def realised(weights, window):
    """Weights as counts of the window, by largest remainder (window_counts' rounding, zeros allowed)."""
    return mixture_module._apportion(np.asarray(weights, dtype=float) / sum(weights), window)


def weight_vectors(sources):
    """Weights that may hold zeros (a source not drawn yet), never all zero."""
    return st.lists(st.integers(0, 9), min_size=sources, max_size=sources).filter(any)


@st.composite
def schedules(draw, sources):
    segments = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            segments.append({"weights": draw(weight_vectors(sources)), "windows": draw(st.integers(1, 12))})
        else:
            segments.append(
                {
                    "from": draw(weight_vectors(sources)),
                    "to": draw(weight_vectors(sources)),
                    "windows": draw(st.integers(1, 12)),
                }
            )
    if draw(st.booleans()) and "weights" in segments[-1]:
        del segments[-1]["windows"]  # the last constant segment runs to the end
    return segments


@settings(max_examples=80, deadline=None)
@given(sources=st.integers(1, 4), window=st.integers(3, 40), data=st.data())
def test_each_window_holds_each_source_within_one_of_its_scheduled_weight(sources, window, data):
    schedule = data.draw(schedules(sources), label="schedule")
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=sources, max_size=sources), label="lengths")
    windows = sum(s.get("windows", 0) for s in schedule) + data.draw(st.integers(1, 4), label="more")
    mix = scheduled(lengths, schedule, windows * window, seed=data.draw(st.integers(0, 2**40)), window=window)
    source, _ = mix.locate(list(range(len(mix))))
    held = np.stack([np.bincount(source[k * window : (k + 1) * window], minlength=sources) for k in range(windows)])
    counts, drawn = mix.plan.window_table(np.arange(windows))
    assert np.array_equal(held, counts) and (held.sum(axis=1) == window).all()
    for k in range(windows):
        assert all(abs(c - x) < 1 for c, x in zip(held[k].tolist(), ideal(schedule, window, k))), k
    assert np.array_equal(drawn, np.cumsum(held, axis=0) - held)  # the closed form equals the explicit sum
    some = np.unique(data.draw(st.lists(st.integers(0, windows - 1), min_size=1), label="some windows"))
    assert np.array_equal(mix.plan.window_table(some)[1], drawn[some])  # the same, whichever windows are asked
    assert list(mix.plan.samples_per_source()) == np.bincount(source, minlength=sources).tolist()


@settings(max_examples=60, deadline=None)
@given(sources=st.integers(1, 3), shuffle=st.booleans(), data=st.data())
def test_each_source_epoch_stays_a_permutation_in_position_order(sources, shuffle, data):
    schedule = data.draw(schedules(sources), label="schedule")
    lengths = data.draw(st.lists(st.integers(1, 20), min_size=sources, max_size=sources), label="lengths")
    mix = scheduled(
        lengths,
        schedule,
        data.draw(st.integers(1, 500), label="num_samples"),
        seed=data.draw(st.integers(0, 2**40)),
        window=data.draw(st.integers(3, 20)),
        shuffle=shuffle,
    )
    source, index = mix.locate(list(range(len(mix))))
    for s, n in enumerate(lengths):
        drawn = index[source == s]
        for run in range(0, len(drawn), n):
            chunk = drawn[run : run + n].tolist()
            assert sorted(chunk) == sorted(set(chunk)) and all(0 <= i < n for i in chunk)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(3, 30)),
    seed=st.integers(0, 2**40),
    num_samples=st.integers(1, 400),
)
def test_a_constant_schedule_is_the_fixed_weight_mixture(weights, window, seed, num_samples):
    """The same positions, and the same plan: a saved plan of fixed weights means what it meant."""
    lengths = [7, 3, 11, 5][: len(weights)]
    assume(0 not in realised(weights, window or sum(weights)))  # a fixed mixture refuses a source without a slot
    fixed = Mixture([Tagged(n, "t") for n in lengths], weights, num_samples, seed, window=window)
    constant = scheduled(lengths, [{"weights": weights}], num_samples, seed, window=window)
    assert constant.plan == fixed.plan and constant.fingerprint() == fixed.fingerprint()
    for a, b in zip(fixed.locate(list(range(num_samples))), constant.locate(list(range(num_samples)))):
        assert np.array_equal(a, b)


def test_a_position_near_1e12_is_located_in_a_few_closed_form_steps(monkeypatch):
    """A ramp over 10**11 windows: the draws before any window are floor sums (O(log) steps each), never a loop over
    windows; they match the ramp's total by the gcd formula, and the counts of the windows around."""
    window, ramp = 10, 10**11
    schedule = [{"from": [0.9, 0.1, 0.0], "to": [0.2, 0.3, 0.5], "windows": ramp}, {"weights": [0.2, 0.3, 0.5]}]
    mix = scheduled([10**9, 10**8, 10**7], schedule, 10**12 + 7, seed=3, window=window)
    steps = []
    real = mixture_module._floor_sum

    def counted(n, m, a):
        steps.append(1)
        return real(n, m, a)

    monkeypatch.setattr(mixture_module, "_floor_sum", counted)
    positions = [10**12 - 3, 10**12 + 6, 5 * 10**11 + 1, 123_456_789_012]
    source, index = mix.plan.locate(positions)
    assert len(steps) < 100
    assert (index >= 0).all() and (index < np.array([10**9, 10**8, 10**7])[source]).all()
    # over the whole ramp, sum_j floor(P j / L) = ((P - 1)(L - 1) + gcd(P, L) - 1) / 2 for P >= 0, and for P < 0
    # minus that of -P, less one per j where -P j / L is not whole (all but gcd(P, L) of them); P: the partial sums
    # of to - from (-7, -5, 0), so C_s at the ramp's end is known independently of the floor sums
    first, last = (9, 1, 0), (2, 3, 5)
    partial = [0] + np.cumsum(np.subtract(last, first)).tolist()

    def floor_total(p):
        if p < 0:
            return -floor_total(-p) - (ramp - math.gcd(-p, ramp))
        return ((p - 1) * (ramp - 1) + math.gcd(p, ramp) - 1) // 2

    expected = [a * ramp + floor_total(hi) - floor_total(lo) for a, hi, lo in zip(first, partial[1:], partial[:-1])]
    counts, drawn = mix.plan.window_table(np.array([ramp - 2, ramp - 1, ramp]))
    assert drawn[-1].tolist() == expected
    assert np.array_equal(drawn[1:] - drawn[:-1], counts[:-1])
    assert counts[-1].tolist() == list(last)


def test_bad_schedules_are_refused_naming_the_segment_and_field():
    for schedule, message in [
        ([], "schedule must be a non-empty list of segments"),
        ([{"weights": [1, 1], "windows": 3}, {"weights": [1], "windows": 2}], r"schedule\[1\].weights has 1 weights"),
        ([{"weights": [1, -1]}], r"schedule\[0\].weights must be non-negative finite numbers"),
        ([{"weights": [0, 0]}], r"schedule\[0\].weights must be non-negative finite numbers, not all zero"),
        ([{"from": [1, 0], "to": [0, 1]}], r"schedule\[0\].windows is missing"),
        ([{"weights": [1, 1]}, {"weights": [1, 2]}], r"schedule\[0\].windows is missing"),
        ([{"weights": [1, 1], "windows": 0}], r"schedule\[0\].windows must be a positive int"),
        ([{"weights": [1, 1], "windows": 2}, {"from": [1, 1], "windows": 2}], r"schedule\[1\] must be a dict with"),
        ([{"weights": [1, 1], "steps": 2}], r"schedule\[0\] must be a dict with"),
    ]:
        with pytest.raises(ValueError, match=message):
            scheduled([5, 5], schedule, 100)
    with pytest.raises(ValueError, match="pass weights= .* or schedule="):
        Mixture([Tagged(5, "a")], [1], 10, schedule=[{"weights": [1]}])


def test_the_plan_of_a_schedule_saves_loads_and_is_refused_by_a_reader_of_fixed_plans(tmp_path):
    schedule = [{"weights": [1, 0], "windows": 4}, {"from": [1, 0], "to": [1, 1], "windows": 6}, {"weights": [1, 1]}]
    mix = scheduled([9, 4], schedule, 200, seed=2)
    mix.plan.save(tmp_path / "plan.json")
    plan = MixturePlan.load(tmp_path / "plan.json")
    assert plan == mix.plan and plan.fingerprint() == mix.plan.fingerprint()
    assert np.array_equal(plan.locate(np.arange(200))[1], mix.locate(list(range(200)))[1])
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["version"] == 2 and data["changes"] == []
    bad = {**data, "schedule": [{**data["schedule"][1], "to": [3, 3]}, *data["schedule"][1:]]}
    with pytest.raises(ValueError, match=r"schedule piece 0.to must be 2 non-negative ints summing to the window 2"):
        MixturePlan.from_dict(bad)


def changed(lengths, old_schedule, new_schedule, num_samples, change_at, **kw):
    old = scheduled(lengths, old_schedule, num_samples, **kw)
    return old, scheduled(lengths, new_schedule, num_samples, amends=old.plan, change_at=change_at, **kw)


@settings(max_examples=60, deadline=None)
@given(sources=st.integers(1, 3), data=st.data())
def test_a_change_keeps_the_past_and_continues_every_source_without_repeats(sources, data):
    window = data.draw(st.integers(3, 12), label="window")
    lengths = data.draw(st.lists(st.integers(1, 15), min_size=sources, max_size=sources), label="lengths")
    num_samples = data.draw(st.integers(window + 1, 400), label="num_samples")
    change_at = data.draw(st.integers(0, (num_samples - 1) // window * window), label="change_at")  # see below
    old, new = changed(
        lengths,
        data.draw(schedules(sources)),
        data.draw(schedules(sources)),
        num_samples,
        change_at,
        seed=data.draw(st.integers(0, 2**40)),
        window=window,
    )
    at = -(-change_at // window) * window
    before, after = old.locate(list(range(num_samples))), new.locate(list(range(num_samples)))
    assert all(np.array_equal(a[:at], b[:at]) for a, b in zip(before, after))  # the past as it was trained
    source, index = after
    for s, n in enumerate(lengths):  # each source's draws run on across the change: permutations per epoch
        drawn = index[source == s]
        for run in range(0, len(drawn), n):
            chunk = drawn[run : run + n].tolist()
            assert sorted(chunk) == sorted(set(chunk))
    assert new.plan.changes in ((), (-(-change_at // window),))
    assert MixturePlan.from_dict(json.loads(json.dumps(new.plan.to_dict()))) == new.plan


def test_a_change_at_window_0_to_constant_weights_is_recorded_and_survives_the_plan_file():
    """Found by the property test above: a change at window 0 whose result is one constant piece was written as a
    fixed-weight plan, dropping the record of the change, so a reloaded plan no longer knew a change had happened."""
    old, new = changed([5], [{"from": [1], "to": [1], "windows": 1}], [{"weights": [1], "windows": 1}], 4, 0, window=3)
    assert new.plan.changes == (0,)
    assert MixturePlan.from_dict(json.loads(json.dumps(new.plan.to_dict()))) == new.plan


def test_changes_accumulate_and_anything_but_the_weights_is_refused_naming_the_field():
    first = [{"weights": [3, 1]}]
    old, once = changed([9, 4], first, [{"from": [3, 1], "to": [1, 3], "windows": 5}, {"weights": [1, 3]}], 120, 17)
    twice = scheduled([9, 4], [{"weights": [1, 1]}], 120, amends=once.plan, change_at=60)
    assert once.plan.changes == (5,) and twice.plan.changes == (5, 15)
    assert np.array_equal(twice.locate(list(range(60)))[1], once.locate(list(range(60)))[1])
    for kw, field in [({"seed": 1}, "seed"), ({"num_samples": 121}, "num_samples"), ({"window": 8}, "window")]:
        args = {"num_samples": 120, **kw}
        n = args.pop("num_samples")
        with pytest.raises(ValueError, match=f"amends: the plan's {field} is"):
            scheduled([9, 4], first, n, amends=old.plan, change_at=17, **args)
    with pytest.raises(ValueError, match="amends: the plan's lengths is"):
        scheduled([9, 5], first, 120, amends=old.plan, change_at=17)
    with pytest.raises(ValueError, match=r"change_at must be a position in \[0, 120\)"):
        scheduled([9, 4], first, 120, amends=old.plan, change_at=120)
    # found by the explore profile: a change_at inside the last window was accepted and never applied
    window = old.plan.window
    last = 119 // window * window
    assert scheduled([9, 4], [{"weights": [1, 3]}], 120, amends=old.plan, change_at=last).plan.changes == (
        last // window,
    )
    with pytest.raises(
        ValueError,
        match=rf"change_at={last + 1} is inside the mixture's last window .* pass "
        rf"change_at <= {last}",
    ):
        scheduled([9, 4], first, 120, amends=old.plan, change_at=last + 1)
    with pytest.raises(ValueError, match="go together"):
        scheduled([9, 4], first, 120, amends=old.plan)


def loader_of(mix):
    model = torch.nn.Linear(1, 1)
    return dict(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=ResumableDataLoader(mix, batch_size=4, shuffle=False, collate_fn=list),
    )


def test_a_checkpoint_saved_before_a_change_resumes_under_the_new_schedule_every_position_once(tmp_path):
    """Train 3 steps (12 positions) under the old schedule, checkpoint, change the schedule from position 12 and
    resume: every position exactly once, the first 12 as the old plan had them, the rest as the new one does. A
    change that would begin inside what was committed, and a silent change, are refused."""
    lengths, n, window = [13, 7], 64, 4
    old = scheduled(lengths, [{"weights": [3, 1]}], n, window=window)
    run = loader_of(old)
    it = iter(run["loader"])
    served = [pos for _ in range(3) for pos in (next(it), run["loader"].last_indices().tolist())[1]]
    path = save_checkpoint(tmp_path, 3, **run)

    new_schedule = [{"from": [3, 1], "to": [0, 1], "windows": 6}, {"weights": [1, 1]}]
    for change_at, fits in ((8, False), (12, True)):
        new = scheduled(lengths, new_schedule, n, window=window, amends=old.plan, change_at=change_at)
        resumed = loader_of(new)
        if not fits:
            with pytest.raises(
                CheckpointError,
                match="the schedule change begins at position 8 .* up to 11 under "
                r"the old plan: pass change_at >= 12",
            ):
                load_checkpoint(path, **resumed)
            continue
        assert load_checkpoint(path, **resumed) == 3
        samples = []
        for batch in resumed["loader"]:
            samples += batch
            served += resumed["loader"].last_indices().tolist()
        assert sorted(served) == list(range(n))
        assert samples == [new[p] for p in range(12, n)]
        assert [old[p] for p in range(12)] == [new[p] for p in range(12)]
    silent = scheduled(lengths, new_schedule, n, window=window)
    with pytest.raises(CheckpointError, match="dataset fingerprint is"):
        load_checkpoint(path, **loader_of(silent))


def test_the_audit_shows_the_change_and_every_sample_once_across_it_at_another_world_size(tmp_path, capsys):
    """Two updates under the old weights at 1 rank, the change at the position they reached, the rest at 2 ranks:
    the audit by source is clean and says where the schedule changed."""
    from loader.cli.main import main as cli
    from tests.conftest import IndexDataset
    from tests.test_audit_by_source import run

    sources = [IndexDataset(30), IndexDataset(7), IndexDataset(100)]
    old = Mixture(sources, [0.5, 0.2, 0.3], 97, seed=4, names=["web", "code", "books"])
    state = run(tmp_path, old, 1, 0, updates=2)
    new = Mixture(
        sources,
        None,
        97,
        seed=4,
        names=["web", "code", "books"],
        amends=old.plan,
        change_at=24,
        schedule=[{"from": [0.5, 0.2, 0.3], "to": [0.1, 0.1, 0.8], "windows": 4}, {"weights": [1, 1, 8]}],
    )
    run(tmp_path, new, 2, 2, state)
    new.plan.save(tmp_path / "mixture.json")
    assert cli(["audit", str(tmp_path), "--mixture", str(tmp_path / "mixture.json")]) == 0
    out = capsys.readouterr().out
    assert "mixture schedule changed at position 30 (window 3)" in out and "every sample exactly once" in out


def shuffled_run(mix):
    model = torch.nn.Linear(1, 1)
    return dict(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=ResumableDataLoader(mix, batch_size=10, shuffle=True, seed=0),
    )


def serve(loader, batches=None):
    """The samples (their values) of the next `batches` batches, or to the end of the epoch."""
    it = iter(loader)
    return [int(v) for _, (batch,) in zip(range(batches or len(loader.dataset)), it) for v in batch]


def test_a_change_under_shuffle_true_fits_just_after_what_was_committed(tmp_path):
    """Issue 29's repro: 20 batches of a shuffled loader order committed positions spread over the whole mixture,
    so a change from position 200 renamed trained ones (101 of 2,000 samples served twice, silently), and later was
    refused. A loader with shuffle=True now leaves the order to the mixture: the 20 batches committed positions
    [0, 200), a change from 150 is refused naming 200, the change from 200 serves every sample once; at the epoch's
    end, epoch 1 continues the stream (positions from 2,000), where the next change goes."""
    src = [torch.utils.data.TensorDataset(torch.arange(10000) + 100000 * k) for k in range(2)]
    old = Mixture(src, [0.5, 0.5], 2000, seed=0, window=10)
    run = shuffled_run(old)
    served = serve(run["loader"], 20)
    path = save_checkpoint(tmp_path / "mid", 20, **run)
    refused = (
        r"begins at mixture position 150 \(window 15\), but the run committed mixture position 199 "
        r"\(epoch 0, position 199; .* pass change_at >= 200"
    )
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint(
            path, **shuffled_run(Mixture(src, [0.9, 0.1], 2000, seed=0, window=10, amends=old.plan, change_at=150))
        )
    new = Mixture(src, [0.9, 0.1], 2000, seed=0, window=10, amends=old.plan, change_at=200)
    resumed = shuffled_run(new)
    assert load_checkpoint(path, **resumed) == 20
    served += serve(resumed["loader"])
    assert sorted(served) == sorted(int(new[p][0]) for p in range(2000)) and len(set(served)) == 2000
    assert sum(v < 100000 for v in served) == 100 + 1800 * 9 // 10  # the new weights from position 200
    end = save_checkpoint(tmp_path / "end", 200, **resumed)
    with pytest.raises(CheckpointError, match=r"committed mixture position 1999 .* pass change_at >= 2000"):
        load_checkpoint(
            end, **shuffled_run(Mixture(src, [0.5, 0.5], 2000, seed=0, window=10, amends=new.plan, change_at=200))
        )
    again = Mixture(src, [0.5, 0.5], 2000, seed=0, window=10, amends=new.plan, change_at=2200)
    changed = shuffled_run(again)
    assert load_checkpoint(end, **changed) == 200
    epoch_1 = serve(changed["loader"])
    assert sorted(epoch_1) == sorted(int(again[SampleIndex(p, epoch=1)][0]) for p in range(2000))
    assert sum(v < 100000 for v in epoch_1) == 180 + 1800 // 2  # epoch 1's first 200 under 90/10, then 50/50
    assert not set(served) & set(epoch_1) - {v for v in served if v < 100000}  # source 1's epoch not used up: new


def ranks_of(mix, world, shuffle=True, batch_size=10):
    return [
        ResumableDataLoader(
            mix, batch_size=batch_size, shuffle=shuffle, seed=3, rank=r, world_size=world, collate_fn=list
        )
        for r in range(world)
    ]


def deliver(loader, batches=None):
    """(mixture position, sample) of the next `batches` batches of `loader`, or to the end of its epoch."""
    out = []
    for _, batch in zip(range(len(loader.dataset) if batches is None else batches), loader):
        out += zip(loader.last_indices().tolist(), batch)
    return out


def resumed_or_refused(old, new, state, world, shuffle, batch_size):
    """What `resume` does with a state saved under `old` (check_change, then each rank's load_state_dict): None
    when refused, else what the `world` ranks of `new` deliver to the end of the epoch."""
    ranks = ranks_of(new, world, shuffle, batch_size)
    check_change(old.fingerprint(), ranks[0], state)
    for loader in ranks:
        loader.load_state_dict(state)
    return [pair for loader in ranks for pair in deliver(loader)]


def test_a_change_after_a_shuffled_resize_with_unequal_consumption_is_refused_or_serves_every_sample_once():
    """Issue 29's repro after a 2 -> 3 resize (78 samples served twice): two ranks that consumed different amounts,
    merged; a change inside what they trained is refused naming the change_at that fits (one past the last trained
    mixture position: under shuffle=True, the last committed loader position), which three ranks then finish with
    every position once and every sample of the new plan once."""
    src = [torch.utils.data.TensorDataset(torch.arange(10000) + 100000 * k) for k in range(2)]
    old = Mixture(src, [0.5, 0.5], 2000, seed=0, window=10)
    two = ranks_of(old, 2)
    trained = deliver(two[0], 10) + deliver(two[1], 7)
    state = merge_states([loader.state_dict() for loader in two], uneven=True)
    last = max(p for p, _ in trained)
    assert last < 200  # the positions the two ranks trained, not a shuffled order's spread over the epoch
    new = Mixture(src, [0.9, 0.1], 2000, seed=0, window=10, amends=old.plan, change_at=last // 10 * 10)
    with pytest.raises(StateError, match=rf"committed mixture position {last} .* pass change_at >= {last + 1}$"):
        resumed_or_refused(old, new, state, 3, True, 10)
    late = Mixture(src, [0.9, 0.1], 2000, seed=0, window=10, amends=old.plan, change_at=last + 1)
    served = trained + resumed_or_refused(old, late, state, 3, True, 10)
    assert sorted(p for p, _ in served) == list(range(2000))
    values = [int(sample[0]) for _, sample in served]
    assert sorted(values) == sorted(int(late[p][0]) for p in range(2000)) and len(set(values)) == 2000


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_change_is_exact_or_refused_under_any_order_and_world_sizes(data):
    """The model counts every sample: ranks at one world size consume unequal amounts under the old weights, the
    weights change at change_at, ranks at another world size finish the epoch. Refused exactly when a trained
    mixture position lies at or after the change's first window, naming one past the last as the change_at that
    fits (or none, when no whole window follows it); else every position is served once, and the samples are
    those of the changed plan, each once (a source epoch that runs out continues in its next)."""
    shuffle = data.draw(st.booleans(), label="shuffle")
    before, after = data.draw(st.integers(1, 3), label="before"), data.draw(st.integers(1, 3), label="after")
    window = data.draw(st.integers(3, 6), label="window")
    n = data.draw(st.integers(window + 1, 90), label="num_samples")
    lengths = data.draw(st.lists(st.integers(3, 40), min_size=2, max_size=2), label="lengths")
    old = mixture(lengths, [1, 2], n, window=window)
    ranks = ranks_of(old, before, shuffle, batch_size=2)
    batches = st.one_of(st.integers(0, 2), st.integers(0, n // (2 * before)))  # few: a shuffled order can fit
    trained = [pair for loader in ranks for pair in deliver(loader, data.draw(batches, label="batches"))]
    state = merge_states([loader.state_dict() for loader in ranks], uneven=True)
    last, latest = max((p for p, _ in trained), default=-1), (n - 1) // window * window
    change_at = data.draw(st.integers(0, latest) | st.integers(min(last + 1, latest), latest), label="change_at")
    new = mixture(lengths, [2, 1], n, window=window, amends=old.plan, change_at=change_at)
    if last >= -(-change_at // window) * window:
        fits = shuffle or -(-(last + 1) // window) * window < n  # shuffle=True: epoch 1 continues the stream
        held = rf"committed mixture position {last} .*: " if shuffle else rf"up to {last} under the old plan: "
        with pytest.raises(
            StateError,
            match=held + (rf"pass change_at >= {last + 1}" if fits else r"no change_at fits before epoch 0 ends"),
        ):
            resumed_or_refused(old, new, state, after, shuffle, 2)
        return
    served = trained + resumed_or_refused(old, new, state, after, shuffle, 2)
    assert sorted(p for p, _ in served) == list(range(n))
    assert Counter(sample for _, sample in served) == Counter(new[p] for p in range(n))
