"""The loader under torchft: each step's block dealt over the quorum of that step, exactly once across any sequence
of quorum changes and failed commits. First the pure deal (the production composition, StepDeal and the loader's
sampler, without a Manager), then the state torchft transfers, then real processes: a lighthouse and replica groups
on gloo, one SIGKILLed mid-epoch and restarted, one added later (tests/torchft_job.py)."""

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.core.order import Order
from loader.core.sampler import ResumableSampler
from loader.core.state import StateError

torchft = pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[torchft]' (CI does)")

from loader.integrations.torchft import StepDeal, check_step_state, step_state  # noqa: E402


def dealt(deal: StepDeal, order: Order, step: int, replicas: int, group_size: int) -> list[list[list[int]]]:
    """Each data-parallel rank's micro-batches of `step` under a quorum of `replicas` groups, as ManagedLoader
    deals them: the loader's sampler, loaded with the step's progress and laid out for the quorum."""
    block = deal.block(step)
    layout = deal.layout(block, replicas * group_size)
    out = []
    for dp_rank in range(replicas * group_size):
        sampler = ResumableSampler(order, layout, 0 if layout.world_size == 1 else dp_rank)
        sampler.load_state_dict(deal.progress(order.fingerprint(), block))
        sampler.relayout(layout, dp_rank)
        out.append([list(batch) for batch in sampler])
    return out


def run(deal: StepDeal, order: Order, events: list[tuple[int, bool]], group_size: int) -> dict[int, tuple]:
    """(samples, data-parallel ranks) of each committed step, for a sequence of (replica groups in the quorum,
    commit succeeded)."""
    step, committed = 0, {}
    for replicas, ok in events:
        samples = [i for rank in dealt(deal, order, step, replicas, group_size) for batch in rank for i in batch]
        counts = Counter(len(rank) for rank in dealt(deal, order, step, replicas, group_size))
        assert len(counts) == 1, f"ranks got unequal numbers of micro-batches: {counts}"
        if ok:
            committed[step] = samples, replicas * group_size
            step += 1
    return committed


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 60), global_batch=st.integers(4, 12), micro=st.integers(1, 4), group_size=st.integers(1, 2),
       drop_last=st.booleans(), events=st.lists(st.tuples(st.integers(1, 2), st.booleans()), min_size=1, max_size=40))
def test_every_sample_once_and_every_step_as_uninterrupted_across_quorum_changes_and_failed_commits(
        n, global_batch, micro, group_size, drop_last, events):
    deal = StepDeal(n, global_batch, micro, drop_last) if drop_last <= (n >= global_batch) else None
    if deal is None:
        with pytest.raises(ValueError, match="drops them all"):
            StepDeal(n, global_batch, micro, drop_last)
        return
    order = Order(n, 7, "global")
    steps = run(deal, order, events, group_size)
    uninterrupted = run(deal, order, [(1, True)] * len(steps), 1)
    for step, (samples, ranks) in steps.items():  # a failed commit's block dealt again, to the next quorum
        block = deal.block(step)  # an epoch's last block of fewer samples than ranks: dropped by policy (below)
        expected = [] if block.size < ranks else sorted(uninterrupted[step][0])
        assert sorted(samples) == expected, f"step {step}"
    per_epoch = deal.steps_per_epoch
    for epoch in range(len(steps) // per_epoch):  # each finished epoch: every sample once, or dropped by policy
        seen = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in steps[s][0]]
        last = (epoch + 1) * per_epoch - 1
        a, b = deal.dropped(deal.block(last), steps[last][1])
        positions = order.for_epoch(epoch)(np.arange(n))
        assert b == n and sorted(seen) == sorted(positions[:a].tolist())
        assert len(seen) == len(set(seen)) and set(positions[a:].tolist()) == set(range(n)) - set(seen)


def test_a_step_deals_its_block_near_evenly_over_the_quorum():
    deal, order = StepDeal(100, 12, 2), Order(100, 0, "none")
    assert deal.steps_per_epoch == 9 and deal.block(9) == (1, 0, 0, 12) and deal.block(8) == (0, 8, 96, 4)
    sizes = [[len(b) for b in rank] for rank in dealt(deal, order, 0, 5, 1)]  # 12 over 5 ranks: 3, 3, 2, 2, 2
    assert sizes == [[3], [3], [2], [2], [2]]
    sizes = [[len(b) for b in rank] for rank in dealt(deal, order, 0, 3, 1)]  # 12 = 3 ranks x 2 micro x 2
    assert sizes == [[2, 2]] * 3
    assert [len(b) for rank in dealt(deal, order, 8, 5, 1) for b in rank] == []  # 4 left, 5 ranks: dropped
    assert deal.dropped(deal.block(8), 5) == (96, 100) and deal.dropped(deal.block(8), 2) == (100, 100)
    with pytest.raises(ValueError, match="more than the global batch"):
        deal.layout(deal.block(0), 13)


def test_the_transferred_state_is_small_plain_and_checked_field_by_field():
    deal, order = StepDeal(50, 8, 2), Order(50, 3, "global")
    state = json.loads(json.dumps(step_state(order.fingerprint(), deal)))
    assert len(json.dumps(state)) < 400
    check_step_state(state, order.fingerprint(), deal)
    for field, value, message in (("global_batch", 16, "global_batch is 16"), ("drop_last", 1, "drop_last is 1"),
                                  ("version", 2, "version is 2"), ("format", "x", "not a 'loader.torchft'")):
        with pytest.raises(StateError, match=message):
            check_step_state({**state, field: value}, order.fingerprint(), deal)
    with pytest.raises(StateError, match="fingerprint.seed is 4"):
        check_step_state({**state, "fingerprint": {**state["fingerprint"], "seed": 4}}, order.fingerprint(), deal)
    with pytest.raises(StateError, match="global_batch is 8 but 16"):
        check_step_state(state, order.fingerprint(), StepDeal(50, 16, 2))
