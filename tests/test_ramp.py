"""Batch-size ramps: a global batch schedule by optimizer step (`BatchPolicy(global_batch=[(step, G), ...])`).

Every step trains the samples of an uninterrupted run's step, across restarts at 4 -> 3 -> 2 ranks mid-stretch and
exactly at a change of the global batch, over an epoch boundary inside a stretch; with unequal consumption every
sample of every epoch is trained exactly once; a changed schedule is refused unless amended."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from loader import ResumableDataLoader, merge_states
from loader.core.batch_policy import BatchPolicy
from loader.core.partition import Layout, plan_at
from loader.core.state import StateError
from loader.dataloader import ContinuedPassWarning

N, EPOCHS = 300, 2
SCHEDULE = [(0, 12), (4, 24), (7, 48), (12, 96)]  # epoch 0: steps 0-10 (4 + 3 + 3 full + 1 short); epoch 1 starts
# at step 11, inside the stretch of 48, and changes to 96 at step 12
DATASET = TensorDataset(torch.arange(N))


def loaders(world_size: int, schedule=SCHEDULE, state=None, workers: int = 0, **policy) -> list[ResumableDataLoader]:
    ranks = [
        ResumableDataLoader(
            DATASET,
            batch_size=1,
            shuffle=True,
            seed=0,
            rank=r,
            world_size=world_size,
            num_workers=workers,
            batch_policy=BatchPolicy(schedule, 1, **policy),
        )
        for r in range(world_size)
    ]
    for dl in ranks:
        if state is not None:
            dl.load_state_dict(state)
    return ranks


class Run:
    """Ranks driven in lockstep: the samples of each completed update, and every (epoch, index) delivered."""

    def __init__(self):
        self.steps: list[list[int]] = []
        self.trained: list[tuple[int, int]] = []

    def drive(self, ranks: list[ResumableDataLoader], until: int) -> None:
        """Until `until` updates are done in all (or every epoch up to EPOCHS is)."""
        if ranks[0].exhausted and ranks[0].epoch + 1 >= EPOCHS:  # resumed at the end of the last epoch
            return
        iters, current = [iter(dl) for dl in ranks], []
        while len(self.steps) < until:
            batches = [next(it, None) for it in iters]
            if batches[0] is None:  # every rank's share ends at the same micro-batch
                assert batches == [None] * len(ranks)
                if ranks[0].epoch + 1 >= EPOCHS:
                    break
                iters = [iter(dl) for dl in ranks]
                continue
            for dl, (xs,) in zip(ranks, batches):
                self.trained += [(dl.epoch, i) for i in xs.tolist()]
                current += xs.tolist()
            assert len({dl.update_complete for dl in ranks}) == 1
            if ranks[0].update_complete:
                self.steps.append(sorted(current))
                current = []
        for dl in ranks:
            dl.close()

    def one_more_update(self, dl: ResumableDataLoader) -> None:
        """Rank `dl` alone delivers the next update (unequal consumption, as under DDP Join): a new iter() continues
        its pass, which is what it warns about."""
        with pytest.warns(ContinuedPassWarning):
            it = iter(dl)
        while True:
            (xs,) = next(it)
            self.trained += [(dl.epoch, i) for i in xs.tolist()]
            if dl.update_complete:
                return

    def check_exactly_once(self) -> None:
        for epoch in range(EPOCHS):
            assert sorted(i for e, i in self.trained if e == epoch) == list(range(N))


def reference(schedule=SCHEDULE) -> list[list[int]]:
    run = Run()
    run.drive(loaders(1, schedule), 10**9)
    return run.steps


REFERENCE = reference()


def test_the_reference_follows_the_schedule():
    """G(s) samples per step, the epoch's tail rule at its end; each epoch's samples once."""
    assert [len(s) for s in REFERENCE] == [12] * 4 + [24] * 3 + [48] * 3 + [36] + [48] + [96] * 2 + [60]
    assert sorted(i for s in REFERENCE[:11] for i in s) == list(range(N))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("first, second", [(2, 7), (4, 12), (9, 11)])
def test_every_step_as_uninterrupted_across_4_3_2_ranks(workers, first, second):
    """Restarts mid-stretch (2, 9), exactly where the global batch changes (4, 7, 12), at the epoch's start (11)."""
    run = Run()
    run.drive(ranks := loaders(4), first)
    state = merge_states([dl.state_dict() for dl in ranks])
    assert state["step"] == first
    run.drive(ranks := loaders(3, state=state, workers=workers), second)
    state = ranks[0].state_dict()  # one rank's state stands for all in lockstep
    run.drive(loaders(2, state=state), 10**9)
    assert run.steps == REFERENCE
    run.check_exactly_once()


@pytest.mark.parametrize("workers", [0, 2])
def test_unequal_consumption_trains_every_sample_once(workers):
    """Ranks that consumed different amounts (one more update on some) merge; the resumed ranks deal the rest."""
    run = Run()
    run.drive(ranks := loaders(4), 3)
    for dl in ranks[:2]:
        run.one_more_update(dl)  # ranks 0 and 1 take step 3 (G 12) alone, then 4 and 5 (G 24) ...
    run.one_more_update(ranks[0])
    state = merge_states([dl.state_dict(check_lockstep=False) for dl in ranks], uneven=True)
    assert state["step"] == 5  # the most any rank completed: under Join, the others stepped with it
    run.drive(ranks := loaders(3, state=state, workers=workers), 10**9 if workers else 9)
    if not workers:
        run.one_more_update(ranks[2])
        state = merge_states([dl.state_dict(check_lockstep=False) for dl in ranks], uneven=True)
        run.drive(loaders(2, state=state), 10**9)
    run.check_exactly_once()


def test_grad_accum_follows_the_step_and_the_world_size():
    ranks = loaders(3)
    seen = []
    for _ in zip(*ranks):
        if ranks[0].update_complete:
            seen.append(ranks[0].grad_accum)  # K of the next update
    assert seen[:10] == [4] * 3 + [8] * 3 + [16] * 4  # G / (3 · 1): 12 → 4, 24 → 8, 48 → 16
    assert ranks[0].metrics()["batches"] == 12  # the monitor closed the short update at the epoch's end: 36 / 3


def test_a_world_size_that_cannot_serve_a_later_global_batch_is_refused_up_front():
    with pytest.raises(ValueError, match=r"global_batch=20 \(from step 5\) cannot be served at world_size=8"):
        loaders(8, [(0, 16), (5, 20)])
    with pytest.raises(ValueError, match="allow_global_batch_change=True"):
        loaders(1, allow_global_batch_change=True)


def test_a_changed_schedule_is_refused_unless_amended():
    run = Run()
    run.drive(ranks := loaders(4), 5)
    state = merge_states([dl.state_dict() for dl in ranks])
    changed = [(0, 12), (4, 36)]
    with pytest.raises(
        StateError,
        match=r"state.batch_schedule is \[\[0, 12\], \[4, 24\].* in the saved state but "
        r"\[\[0, 12\], \[4, 36\]\] in this loader",
    ):
        loaders(3, changed, state)
    with pytest.raises(StateError, match="pass change_at >= 5"):
        loaders(3, changed, state, amends=SCHEDULE, change_at=4)
    fixed = ResumableDataLoader(DATASET, batch_size=1, shuffle=True, seed=0, grad_accum=12)
    with pytest.raises(StateError, match="in this loader: a step would train other samples"):
        fixed.load_state_dict(state)
    ranks = loaders(3, changed, state, amends=SCHEDULE, change_at=6)
    run.drive(ranks, 7)
    assert [len(s) for s in run.steps] == [12] * 4 + [24] * 2 + [36]  # the new schedule from step 6
    state = ranks[0].state_dict()
    assert state["base"]["batch_schedule"] == [[0, 12], [4, 24], [6, 36]]
    run.drive(loaders(2, changed, state, amends=SCHEDULE, change_at=6), 10**9)  # the amended run resumes as itself
    assert [len(s) for s in run.steps[6:12]] == [36] * 5 + [24]  # and the epoch's tail
    run.check_exactly_once()


schedules = st.lists(st.tuples(st.integers(1, 6), st.sampled_from([12, 24, 36, 48])), min_size=1, max_size=3).map(
    lambda gaps: [(0, 12)] + [(sum(g for g, _ in gaps[: i + 1]), batch) for i, (_, batch) in enumerate(gaps)]
)


@settings(max_examples=8, deadline=None)
@given(schedule=schedules, cuts=st.tuples(st.integers(0, 20), st.integers(0, 20)).map(sorted))
def test_any_schedule_and_restart_points(schedule, cuts):
    expected = reference(schedule)
    run = Run()
    run.drive(ranks := loaders(4, schedule), cuts[0])
    state = merge_states([dl.state_dict() for dl in ranks])
    run.drive(ranks := loaders(3, schedule, state), cuts[1])
    run.drive(loaders(2, schedule, ranks[0].state_dict()), 10**9)
    assert run.steps == expected
    run.check_exactly_once()


@settings(max_examples=200, deadline=None)
@given(
    remaining=st.integers(0, 200),
    world_size=st.integers(1, 4),
    batch_size=st.integers(1, 3),
    drop_last=st.booleans(),
    ks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    gaps=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    step=st.integers(0, 12),
)
def test_the_plan_deals_each_update_its_global_batch(remaining, world_size, batch_size, drop_last, ks, gaps, step):
    """Update u covers [P(u), P(u) + G(u)) of the remaining indices, until the tail rule takes over."""
    per_step = world_size * batch_size
    firsts = [0] + list(np.cumsum(gaps[: len(ks) - 1]))
    schedule = tuple((int(f), k * per_step) for f, k in zip(firsts, ks))
    plan = plan_at(remaining, Layout(world_size, 1, batch_size, drop_last), schedule, step)
    starts, stops = zip(*(plan.batch_bounds(r, np.arange(plan.batches_per_rank)) for r in range(world_size)))
    served = sorted(i for a, b in zip(starts, stops) for s, t in zip(a.tolist(), b.tolist()) for i in range(s, t))
    assert served == list(range(plan.served))
    position, batch = 0, 0
    for u in range(plan.full_updates):
        k = dict(schedule)[max(f for f, _ in schedule if f <= step + u)] // per_step
        update = sorted(
            i
            for a, b in zip(starts, stops)
            for s, t in zip(a[batch : batch + k].tolist(), b[batch : batch + k].tolist())
            for i in range(s, t)
        )
        if batch + k <= plan.tail.first_batch:
            assert update == list(range(position, position + k * per_step))
        assert plan.completed(batch + k) == min(batch + k, plan.batches_per_rank)
        assert plan.updates_in(batch) == u
        position, batch = position + k * per_step, batch + k


def positions_of(dl: ResumableDataLoader, epoch: int, spans) -> list[int]:
    """The dataset indices at skipped position intervals of `epoch`."""
    positions = np.concatenate([np.arange(a, b) for a, b in np.asarray(spans).reshape(-1, 2)])
    return dl.resumable_sampler.order.for_epoch(epoch)(positions).tolist()


def test_skip_by_updates_skips_the_samples_of_those_steps_across_4_3_2_ranks():
    """skip(updates=4) at step 2 under the ramp skips what steps 2-5 of an uninterrupted run train (12 + 12 + 24 +
    24 samples: the schedule's sum, not 4 x G); a skipped update steps no optimizer, so the next update is step 2
    again, G 12, and the schedule goes on from there. A skip of a range of updates in epoch 1 after a restart at 3
    ranks with unequal consumption, then 2 ranks: every index of both epochs trained once or skipped once."""
    run = Run()
    run.drive(ranks := loaders(4), 2)
    skipped = {0: positions_of(ranks[0], 0, [dl.skip(updates=4) for dl in ranks][0])}
    assert sorted(skipped[0]) == sorted(i for s in REFERENCE[2:6] for i in s)
    assert ranks[0].resumable_sampler.standing().step == 2 and ranks[0].grad_accum == 3  # 12 over 4 ranks
    run.drive(ranks, 5)
    assert [len(s) for s in run.steps] == [12] * 4 + [24]  # steps 2, 3 (12) and 4 (24) after the skip
    run.one_more_update(ranks[1])
    state = merge_states([dl.state_dict(check_lockstep=False) for dl in ranks], uneven=True)
    run.drive(ranks := loaders(3, state=state), 10)  # steps 6-9 (epoch 0's tail: 30) and 10 (epoch 1's first)
    assert ranks[0].epoch == 1 and [len(s) for s in run.steps[5:]] == [24, 48, 48, 30, 48]
    with pytest.raises(ValueError, match=r"epoch=2\) under a global batch schedule: the updates of epoch 2"):
        ranks[0].skip(updates=1, epoch=2)
    step = ranks[0].resumable_sampler.standing().step
    skipped[1] = positions_of(ranks[0], 1, [dl.skip(updates=range(1, 3)) for dl in ranks][0])
    assert step == 11 and len(skipped[1]) == 2 * 96  # steps 12 and 13, after the next one (step 11, G 48)
    with pytest.raises(ValueError, match=r"updates from step \d+ of the global batch schedule at most"):
        ranks[0].skip(updates=10**6)
    run.drive(loaders(2, state=ranks[0].state_dict()), 10**9)
    for epoch in range(EPOCHS):
        trained = [i for e, i in run.trained if e == epoch]
        assert len(trained) == len(set(trained)) and not set(trained) & set(skipped[epoch])
        assert sorted(trained + skipped[epoch]) == list(range(N))


def test_a_skip_under_the_ramp_is_in_the_ledger_and_the_audit(tmp_path, capsys):
    """The skipped updates' samples are committed as skipped on request: the ledger records them, the audit counts
    them in their own column, every other index seen once."""
    from loader.checkpoint.audit import main as audit_main
    from loader.checkpoint.ledger import Ledger

    (dl,) = loaders(1)
    dl.ledger = Ledger.open(tmp_path, 0, N)
    it = iter(dl)
    for _ in range(36):  # steps 0, 1 and 2 of 12 samples, as micro-batches of 1
        next(it)
    skipped = positions_of(dl, 0, dl.skip(updates=range(0, 3)))  # steps 3, 4, 5: 12 + 24 + 24
    for _ in dl:
        pass
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    assert len(skipped) == 60 and audit_main(str(tmp_path), describe=str) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:4] == ["0", "finished", str(N), str(N - 60)] and row[-2:] == ["60", "0"]


def test_skip_by_positions_under_the_ramp_stays_exact():
    """Skipped positions stay out of every step; the steps keep the schedule's sizes."""
    (dl,) = loaders(1)
    skipped = dl.skip(positions=range(0, 6))
    run = Run()
    run.drive([dl], 10**9)
    assert [len(s) for s in run.steps[:5]] == [12] * 4 + [24]
    at_skipped = set(dl.resumable_sampler.order.for_epoch(0)(np.arange(6)).tolist())
    assert skipped.tolist() == [[0, 6]]
    assert sorted(i for e, i in run.trained if e == 0) == sorted(set(range(N)) - at_skipped)


def test_save_checkpoint_and_resume_carry_the_ramp(tmp_path):
    """resume validated the checkpoint's progress on a sampler without the loader's schedule, so every checkpoint
    of a ramp was refused ("batch_schedule ... but 'none (a fixed grad_accum)' in this loader"): now it resumes at
    its step, and the steps after it are the uninterrupted run's."""
    from loader.checkpoint.save import resume, save_checkpoint

    def objects():
        model = torch.nn.Linear(1, 1)
        return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=loaders(1)[0])

    run, saved = Run(), objects()
    run.drive([saved["loader"]], 5)
    save_checkpoint(tmp_path, 5, **saved)
    resumed = objects()
    assert resume(tmp_path, **resumed) == 5 and resumed["loader"].grad_accum == 24
    run.drive([resumed["loader"]], 10**9)
    assert run.steps == REFERENCE
