"""Data parallelism at the scale of the largest published jobs: 65,536 ranks, simulated in one process.

Rank states are built directly (`rank_state`), as 65,536 ranks would each report theirs, and merged with the
public `merge_states`; what they delivered and what a resumed run serves are computed by the sampler's own
vectorised path (`EpochView.indices` over every rank at once), not by 65,536 DataLoaders. Every position of every
epoch is then counted: committed by the ranks, served after the resume, or dropped by the tail rule, exactly once.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, StateError, merge_states
from loader.core.order import Order
from loader.core.partition import EpochPlan, Layout
from loader.core.sampler import ResumableSampler
from loader.core.state import DRIFT_PER_RANK, MAX_DRIFT, Progress, drift_limit, progress_of, rank_state
from tests.conftest import IndexDataset

SEED = 3


def rank_states(n: int, layout: Layout, epochs: np.ndarray, completed: np.ndarray) -> list[dict]:
    """The states of ranks 0..W-1 of a fresh run, rank r in `epochs[r]` with `completed[r]` micro-batches of it,
    sharing one base as the ranks of one process would."""
    base = Progress(Order(n, SEED).fingerprint(), 0, {})
    pairs = zip(epochs.tolist(), completed.tolist())
    return [rank_state(base, layout, r, epoch, done, False) for r, (epoch, done) in enumerate(pairs)]


def every_batch(sampler: ResumableSampler, epoch: int, counts: np.ndarray) -> np.ndarray:
    """Dataset indices of micro-batches [0, counts[r]) of every rank r in `epoch`, as the sampler deals them."""
    ranks = np.repeat(np.arange(len(counts)), counts)
    batches = np.arange(len(ranks)) - np.repeat(np.cumsum(counts) - counts, counts)
    ids, _ = sampler.view(epoch).indices(ranks, batches)
    return ids


def delivered(n: int, layout: Layout, epochs: np.ndarray, completed: np.ndarray, epoch: int) -> np.ndarray:
    """What the ranks delivered in `epoch`: all of their share of an epoch they left, nothing of one ahead."""
    sampler = ResumableSampler(Order(n, SEED), layout, 0)
    plan = sampler.view(epoch).plan
    counts = np.where(epochs > epoch, plan.batches_per_rank, np.where(epochs == epoch, completed, 0))
    return every_batch(sampler, epoch, counts)


def positions(spans: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in spans.tolist()] + [np.zeros(0, np.int64)])


def resumed(merged: dict, n: int, layout: Layout, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(served, dropped): what every rank of `layout` serves of `epoch` after loading the merged state, and what
    the tail rule leaves out of it."""
    sampler = ResumableSampler(Order(n, SEED), layout, 0)
    sampler.load_state_dict(merged)
    view = sampler.view(epoch)
    served = every_batch(sampler, epoch, np.full(layout.world_size, view.plan.batches_per_rank))
    return served, view.order(view.remaining.positions(np.arange(view.plan.served, view.remaining.count)))


def assert_exactly_once(n, layout, epochs, completed, merged, new_layout) -> None:
    """Per epoch the ranks reached: the merge commits exactly what they delivered (of an epoch it finished: all
    but what it records as dropped), and a run resumed from it at `new_layout` serves the rest, so every index is
    committed, served, or dropped by the tail rule, once."""
    progress = progress_of(merged)
    finished = dict(progress.finished)
    for epoch in range(int(epochs.max()) + 1):
        order = Order(n, SEED).for_epoch(epoch)
        if epoch in finished:
            recorded = positions(finished[epoch])
            committed, recorded = order(np.setdiff1d(np.arange(n), recorded)), order(recorded)
        else:
            committed, recorded = order(positions(progress.committed_in(epoch))), np.zeros(0, np.int64)
        assert np.array_equal(np.sort(delivered(n, layout, epochs, completed, epoch)), np.sort(committed)), (
            f"epoch {epoch}: the merge does not commit exactly what the ranks delivered"
        )
        served, dropped = resumed(merged, n, new_layout, epoch)
        counts = np.bincount(np.concatenate((committed, served, dropped, recorded)), minlength=n)
        assert (counts == 1).all(), f"epoch {epoch}: indices {np.flatnonzero(counts != 1)[:8]} not exactly once"
        assert len(dropped) < (new_layout.global_batch if new_layout.drop_last else new_layout.world_size)


def uneven(rng: np.random.Generator, plan: EpochPlan, start: int, spread: int) -> tuple[np.ndarray, np.ndarray]:
    """(epochs, completed) of ranks that completed `start` plus 0..spread updates each, counted from the start of
    epoch 0 and on into the next epochs: ranks a few updates apart, as under DDP Join."""
    K = plan.layout.grad_accum
    per_epoch = -(-plan.batches_per_rank // K)  # updates, the epoch's last (the tail's) included
    total = start + rng.integers(0, spread + 1, plan.layout.world_size)
    epochs = np.maximum(total - 1, 0) // per_epoch  # a rank at the end of an epoch has not moved on
    return epochs, np.minimum((total - epochs * per_epoch) * K, plan.batches_per_rank)


WORLD = 65_536  # the largest published data-parallel jobs


def test_65536_ranks_a_few_micro_batches_apart_merge_and_resume_exactly_once():
    """Refused as corrupted before the drift limit grew with the world size: 65,536 ranks 3 to 5 updates into an
    epoch are about 2 * 65,536 micro-batches apart in all."""
    layout = Layout(WORLD, 2, 1, False)
    n = WORLD * 2 * 8 + 12_345  # 8 full updates and a tail
    epochs, completed = uneven(np.random.default_rng(0), EpochPlan(n, layout), 3, 2)
    merged = merge_states(rank_states(n, layout, epochs, completed), uneven=True)
    assert len(merged["committed"][0][1]) // 2 > WORLD // 2  # intervals: the holes the uneven stop left
    new_layout = Layout(48_000, 1, 3, False)
    assert_exactly_once(n, layout, epochs, completed, merged, new_layout)
    dl = ResumableDataLoader(IndexDataset(n), batch_size=3, shuffle=True, seed=SEED, rank=47_999, world_size=48_000)
    dl.load_state_dict(merged)  # one rank of the resumed run, as it loads the checkpoint
    trained = np.concatenate([batch.numpy() for batch in dl])
    served, _ = resumed(merged, n, new_layout, 0)
    assert len(trained) and np.array_equal(trained, served[-len(trained) :])  # the last rank's share, in order


def test_the_drift_limit_grows_with_the_world_size_and_still_refuses_corrupted_counts():
    world = 8192
    assert drift_limit(world) == DRIFT_PER_RANK * world > MAX_DRIFT
    layout = Layout(world, 1, 1, False)
    n = world * 40
    completed = np.full(world, DRIFT_PER_RANK)
    completed[0] = 0  # every other rank as far ahead as the limit allows: 131,056 micro-batches in all
    epochs = np.zeros(world, dtype=np.int64)
    merged = merge_states(rank_states(n, layout, epochs, completed), uneven=True)
    assert_exactly_once(n, layout, epochs, completed, merged, Layout(3, 2, 5, True))
    with pytest.raises(StateError, match="differ by 139247 or more .* beyond the 131072 .* at 8192 ranks"):
        merge_states(rank_states(n, layout, epochs, completed + (np.arange(world) > 0)), uneven=True)
    huge = rank_states(2**61, layout, epochs, np.zeros(world, dtype=np.int64))
    huge[5] = {**huge[5], "completed": 2**40}  # a corrupted count: refused before 8 TiB of batch numbers
    with pytest.raises(StateError, match="differ by 1099511627776 or more"):
        merge_states(huge, uneven=True)


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(2, 4096),
    grad_accum=st.integers(1, 3),
    batch=st.integers(1, 4),
    drop_last=st.booleans(),
    updates=st.integers(1, 6),
    leftover=st.integers(0, 10**6),
    start=st.integers(0, 8),
    spread=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
    new_world=st.integers(1, 4096),
    new_accum=st.integers(1, 3),
    new_batch=st.integers(1, 4),
    new_drop_last=st.booleans(),
)
def test_uneven_ranks_at_large_world_sizes_merge_and_resume_at_another_exactly_once(
    world,
    grad_accum,
    batch,
    drop_last,
    updates,
    leftover,
    start,
    spread,
    seed,
    new_world,
    new_accum,
    new_batch,
    new_drop_last,
):
    layout = Layout(world, grad_accum, batch, drop_last)
    n = layout.global_batch * updates + leftover % layout.global_batch
    epochs, completed = uneven(np.random.default_rng(seed), EpochPlan(n, layout), start, spread)
    merged = merge_states(rank_states(n, layout, epochs, completed), uneven=True)
    assert_exactly_once(n, layout, epochs, completed, merged, Layout(new_world, new_accum, new_batch, new_drop_last))
