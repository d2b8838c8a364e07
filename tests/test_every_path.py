"""Exactly once on the paths a real training loop takes: a batch that fails to load, a state loaded or an epoch set
while an iterator is active, both sides of an epoch boundary, a peeked batch, one rank's state in the checkpoint.

Every test counts each index of the epoch: delivered (trained) exactly once, or recorded by a documented policy.
"""

import gc
import itertools
import os
import signal
import time
import warnings
import weakref
from collections import Counter
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from loader import AbandonedEpochWarning, ContinuedPassWarning, ResumableDataLoader, StateError, merge_states
from loader.checkpoint.audit import audit
from loader.checkpoint.ledger import Ledger
from loader.checkpoint.lockstep import LockstepWarning
from loader.checkpoint.save import global_progress
from tests.conftest import IndexDataset
from tests.distributed import run_group
from tests.streams import Plain

WORKERS = [dict(), dict(num_workers=2, multiprocessing_context="fork")]


class FailingDataset(IndexDataset):
    """Raises for the given indices, as a corrupt record would."""

    def __init__(self, n: int, bad: set[int]):
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index):
        if int(index) in self.bad:
            raise ValueError(f"corrupt record {int(index)}")
        return int(index)


def train_skipping_bad_batches(iterator, dl, limit=None):
    """The usual skip-a-bad-batch loop on one iterator: (batches delivered, errors caught)."""
    delivered, errors = [], 0
    while limit is None or len(delivered) < limit:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except ValueError:
            errors += 1
            continue
        assert batch.tolist() == dl.last_indices().tolist(), "last_indices must name the batch just delivered"
        delivered.append(batch.tolist())
    return delivered, errors


def failed_batches(dl_kwargs, n, bad):
    """The batches of a clean pass that contain a bad index: the ones whose loading raises."""
    clean = ResumableDataLoader(IndexDataset(n), **dl_kwargs)
    return [b.tolist() for b in clean if set(b.tolist()) & bad]


def assert_exactly_once(n, delivered_batches, failed=()):
    counts = Counter(itertools.chain.from_iterable(delivered_batches))
    assert max(counts.values(), default=1) == 1, f"duplicated: {[i for i, c in counts.items() if c > 1]}"
    failed = set(itertools.chain.from_iterable(failed))
    assert not failed & set(counts), "a sample of a failed batch was delivered"
    assert set(counts) | failed == set(range(n)), f"skipped: {sorted(set(range(n)) - set(counts) - failed)}"


# -- 1. an exception inside next() --------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
def test_a_failed_batch_is_consumed_and_the_same_iterator_goes_on_exactly(workers):
    n, bad, kw = 60, {7, 31, 32}, dict(batch_size=4, shuffle=True, seed=3, **workers)
    dl = ResumableDataLoader(FailingDataset(n, bad), **kw)
    delivered, errors = train_skipping_bad_batches(iter(dl), dl)
    failed = failed_batches(kw, n, bad)
    assert errors == len(failed) > 0 and dl.exhausted
    assert_exactly_once(n, delivered, failed)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_collate_fn_that_raises_fails_only_its_batch(workers):
    def collate(items):
        if 13 in items:
            raise ValueError("bad batch")
        return torch.tensor(items)

    n, kw = 40, dict(batch_size=5, shuffle=True, seed=1, collate_fn=collate, **workers)
    dl = ResumableDataLoader(IndexDataset(n), **kw)
    delivered, errors = train_skipping_bad_batches(iter(dl), dl)
    assert errors == 1
    assert_exactly_once(n, delivered, failed_batches(dict(batch_size=5, shuffle=True, seed=1), n, {13}))


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("stop", [1, 3, 6, 9])
def test_a_resume_after_a_failed_batch_neither_skips_nor_repeats(workers, stop):
    n, bad, kw = 48, {5, 20}, dict(batch_size=4, shuffle=True, seed=7, **workers)
    dl = ResumableDataLoader(FailingDataset(n, bad), **kw)
    before, _ = train_skipping_bad_batches(iter(dl), dl, limit=stop)
    resumed = ResumableDataLoader(FailingDataset(n, bad), **kw)
    resumed.load_state_dict(dl.state_dict())
    after, _ = train_skipping_bad_batches(iter(resumed), resumed)
    assert_exactly_once(n, before + after, failed_batches(kw, n, bad))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_new_iter_after_a_failed_batch_continues_after_it(workers):
    n, bad, kw = 40, {9}, dict(batch_size=4, **workers)
    dl = ResumableDataLoader(FailingDataset(n, bad), **kw)
    it = iter(dl)
    delivered = [next(it).tolist(), next(it).tolist()]
    with pytest.raises(ValueError, match="corrupt record 9"):
        next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContinuedPassWarning)
        rest, _ = train_skipping_bad_batches(iter(dl), dl)
    assert_exactly_once(n, delivered + rest, [[8, 9, 10, 11]])


def test_an_interrupt_inside_next_is_not_counted_and_a_new_iter_serves_the_batch_again():
    class Interrupting(IndexDataset):
        armed = True

        def __getitem__(self, index):
            if index == 3 and self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return int(index)

    dl = ResumableDataLoader(Interrupting(12), batch_size=3)
    it = iter(dl)
    delivered = [next(it).tolist()]
    with pytest.raises(KeyboardInterrupt):
        next(it)
    with pytest.raises(RuntimeError, match="interrupted"):
        next(it)
    with pytest.warns(ContinuedPassWarning):
        delivered += [b.tolist() for b in dl]
    assert delivered == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_the_ledger_and_the_audit_list_failed_samples_in_their_own_column(tmp_path, capsys):
    from loader.checkpoint.audit import main as audit_main

    n, bad = 30, {4, 17}
    dl = ResumableDataLoader(FailingDataset(n, bad), batch_size=5, shuffle=True, seed=2, drop_last=False)
    dl.ledger = Ledger.open(tmp_path, 0, n)
    delivered, _ = train_skipping_bad_batches(iter(dl), dl)
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    (report,) = audit(tmp_path)
    failed = failed_batches(dict(batch_size=5, shuffle=True, seed=2), n, bad)
    assert sorted(report.failed.tolist()) == sorted(itertools.chain.from_iterable(failed))
    assert report.seen_once == n - 5 * len(failed) and not len(report.duplicated) and report.finished
    assert audit_main(str(tmp_path)) == 0
    assert "failed to load" in capsys.readouterr().out


# -- 2. load_state_dict() / set_epoch() while an iterator is active -----------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
def test_load_state_dict_supersedes_the_active_iterator(workers):
    n, kw = 40, dict(batch_size=4, shuffle=True, seed=4, **workers)
    saved = ResumableDataLoader(IndexDataset(n), **kw)
    first = [b.tolist() for b in itertools.islice(iter(saved), 3)]
    dl = ResumableDataLoader(IndexDataset(n), **kw)
    active = iter(dl)
    next(active)  # a batch of a pass that the loaded state replaces
    dl.load_state_dict(saved.state_dict())
    with pytest.raises(RuntimeError, match="superseded"):
        next(active)
    assert_exactly_once(n, first + [b.tolist() for b in dl])


@pytest.mark.parametrize("workers", WORKERS)
def test_set_epoch_to_another_epoch_supersedes_the_active_iterator(workers):
    n, kw = 30, dict(batch_size=3, shuffle=True, seed=4, **workers)
    dl = ResumableDataLoader(IndexDataset(n), **kw)
    active = iter(dl)
    next(active)
    with pytest.warns(AbandonedEpochWarning):
        dl.sampler.set_epoch(2)  # through the DistributedSampler idiom, too
    with pytest.raises(RuntimeError, match="superseded"):
        next(active)
    epoch_two = [b.tolist() for b in dl]
    assert dl.epoch == 2
    assert_exactly_once(n, epoch_two)


def test_set_epoch_to_the_current_epoch_leaves_the_active_iterator_alone():
    dl = ResumableDataLoader(IndexDataset(12), batch_size=3)
    active = iter(dl)
    first = next(active).tolist()
    dl.set_epoch(0)
    assert_exactly_once(12, [first] + [b.tolist() for b in active])


# -- 3. the end of an epoch ------------------------------------------------------------------------------------------


def observe(dl):
    return dict(
        epoch=dl.epoch,
        exhausted=dl.exhausted,
        len=len(dl),
        update_complete=dl.update_complete,
        sampler_len=len(dl.sampler),
    )


def drive(steps, **kw):
    """A loader taken `steps` deliveries into a run of passes, each pass ending with its StopIteration (which
    counts as one step): the state after a step is a state at every point, both sides of each epoch boundary."""
    dl = ResumableDataLoader(IndexDataset(10), batch_size=4, shuffle=True, seed=9, **kw)
    it = iter(dl)
    for _ in range(steps):
        try:
            next(it)
        except StopIteration:
            it = iter(dl)
    return dl


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_a_restored_loader_is_indistinguishable_from_the_live_one_at_every_point(grad_accum):
    for steps in range(0, 13):  # three batches and a StopIteration per epoch: three epochs and a bit
        live = drive(steps, grad_accum=grad_accum)
        if not live.update_complete and steps:
            continue  # states are taken after whole updates
        restored = ResumableDataLoader(IndexDataset(10), batch_size=4, shuffle=True, seed=9, grad_accum=grad_accum)
        restored.load_state_dict(live.state_dict())
        assert observe(restored) == observe(live), f"after {steps} steps"
        for _ in range(2):  # the next two passes are the same
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ContinuedPassWarning)
                assert [b.tolist() for b in restored] == [b.tolist() for b in live], f"after {steps} steps"


@pytest.mark.parametrize(
    "save_point",
    ["every step, saving the loop's epoch", "after each epoch, saving epoch + 1", "after each epoch, saving epoch"],
)
@pytest.mark.parametrize("workers", WORKERS)
def test_the_set_epoch_loop_resumed_at_every_checkpoint_trains_each_epoch_once(save_point, workers):
    n, epochs, kw = 10, 3, dict(batch_size=4, shuffle=True, seed=5, **workers)

    def run(start, state, crash_after):
        """The DistributedSampler idiom; returns (per-epoch trained samples, checkpoints, crashed)."""
        dl = ResumableDataLoader(IndexDataset(n), **kw)
        if state is not None:
            dl.load_state_dict(state)
        trained, checkpoints = [], []
        for epoch in range(start, epochs):
            dl.set_epoch(epoch)
            for batch in dl:
                trained.append((dl.epoch, batch.tolist()))
                if save_point.startswith("every step"):
                    checkpoints.append((epoch, dl.state_dict()))
                if len(trained) == crash_after:
                    return trained, checkpoints, True
            if save_point == "after each epoch, saving epoch + 1":
                checkpoints.append((epoch + 1, dl.state_dict()))
            elif save_point == "after each epoch, saving epoch":
                checkpoints.append((epoch, dl.state_dict()))
        return trained, checkpoints, False

    reference, checkpoints, _ = run(0, None, None)
    assert [e for e, _ in reference] == [0] * 3 + [1] * 3 + [2] * 3
    for crash_after in range(1, len(reference)):
        trained, saved, crashed = run(0, None, crash_after)
        assert crashed
        if not saved:
            continue
        start, state = saved[-1]
        committed = trained[: sum(1 for _ in saved) if save_point.startswith("every") else 3 * len(saved)]
        resumed, _, _ = run(start, state, None)
        assert committed + resumed == reference, f"crash after {crash_after} batches, resumed from epoch {start}"


# -- 7. a new iter() in the middle of an epoch -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
def test_peek_looks_without_consuming(workers):
    n, kw = 24, dict(batch_size=5, shuffle=True, seed=2, **workers)
    dl = ResumableDataLoader(IndexDataset(n), **kw)
    peeked = dl.peek()
    trained = [b.tolist() for b in dl]
    assert peeked.tolist() == trained[0]
    assert_exactly_once(n, trained)
    assert dl.peek().tolist() == next(iter(dl)).tolist()  # the first batch of the next epoch
    assert ResumableDataLoader(IndexDataset(n), batch_size=None).peek() == 0


def test_a_peek_through_a_new_iterator_is_loud_and_break_then_continue_is_exact():
    dl = ResumableDataLoader(IndexDataset(20), batch_size=4, shuffle=True, seed=1)
    peeked = next(iter(dl)).tolist()
    with pytest.warns(ContinuedPassWarning, match="1 batch\\(es\\) the previous iterator delivered count as consumed"):
        it = iter(dl)
    trained = [peeked]
    for batch in it:
        trained.append(batch.tolist())
        if len(trained) == 3:
            break  # e.g. an evaluation in the middle of the epoch
    with pytest.warns(ContinuedPassWarning):
        trained += [b.tolist() for b in dl]
    assert_exactly_once(20, trained)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContinuedPassWarning)
        assert len([b for b in dl]) == 5  # a pass that ended is followed by the next epoch, without a warning


# -- 5. one rank's state in the checkpoint ---------------------------------------------------------------------------


@pytest.mark.parametrize("old_world, new_world", [(2, 2), (2, 3), (3, 2), (4, 1), (1, 3)])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_rank_zeros_state_of_a_lockstep_run_resumes_exactly_at_any_world_size(old_world, new_world, grad_accum):
    n, kw = 101, dict(batch_size=3, shuffle=True, seed=8, grad_accum=grad_accum, drop_last=True)
    ranks = [ResumableDataLoader(IndexDataset(n), rank=r, world_size=old_world, **kw) for r in range(old_world)]
    iterators = [iter(dl) for dl in ranks]
    trained = []
    for _ in range(3 * grad_accum):  # lockstep: every rank one micro-batch per micro-step
        trained += [next(it).tolist() for it in iterators]
    checkpoint = {"loader": ranks[0].state_dict()}  # what scripts and frameworks save: rank 0's state
    resumed = [ResumableDataLoader(IndexDataset(n), rank=r, world_size=new_world, **kw) for r in range(new_world)]
    for dl in resumed:
        dl.load_state_dict(checkpoint["loader"])
    for dl in resumed:
        trained += [b.tolist() for b in dl]
    merged = merge_states([dl.state_dict() for dl in resumed])
    dropped = np.asarray(merged["finished"][0]["dropped"]).reshape(-1, 2)
    dropped_ids = ranks[0].resumable_sampler.order.for_epoch(0)(np.concatenate([np.arange(a, b) for a, b in dropped]))
    assert_exactly_once(n, trained, [dropped_ids.tolist()])
    assert len(dropped_ids) < new_world * grad_accum * 3  # drop_last: less than one global batch


LOCKSTEP_KW = dict(batch_size=2, shuffle=True, seed=5, grad_accum=2)


def _take_updates(it, dl, updates):
    """Deliver `updates` whole optimizer updates; the indices trained."""
    trained = []
    for _ in range(updates * dl.grad_accum):
        trained.append(next(it).tolist())
    assert dl.update_complete
    return trained


def _ddp_like_job(rank, world_size):
    """Lockstep as under DDP: an all_reduce ends every update. Rank 1 runs one update ahead while rank 0 takes its
    state (the moment a rank-0-only save sees): rank 0's state must not be marked, and alone it resumes exactly."""
    dl = ResumableDataLoader(IndexDataset(60), **LOCKSTEP_KW)
    it, trained = iter(dl), []
    store = dist.distributed_c10d._get_default_store()
    for _ in range(3):
        trained += _take_updates(it, dl, 1)
        dist.all_reduce(torch.zeros(1))  # the gradient all-reduce of the update
    if rank == 1:
        trained += _take_updates(it, dl, 1)  # the next update's batches, before rank 0 has saved
    else:
        store.wait(["rank 1 ahead"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = dl.state_dict()  # rank 0: after its step; rank 1: before the step of the update it delivered
    if rank == 1:
        store.set("rank 1 ahead", "1")
    else:
        trained += _take_updates(it, dl, 1)
    dist.all_reduce(torch.zeros(1))
    return state, trained, [w.category for w in caught]


def test_rank_zeros_state_in_a_real_lockstep_group_is_not_marked_and_resumes_exactly():
    results = run_group(_ddp_like_job, 2)
    saved, _, warned = results[0]
    assert "lockstep" not in saved and warned == []
    # rank 1 took its state before the optimizer step of an update it delivered: incoherent with any model, and
    # indistinguishable from ranks out of lockstep, so it is marked
    assert results[1][0]["lockstep"] == {"rank": 0, "updates": 3, "own_updates": 4}
    assert results[1][2] == [LockstepWarning]
    trained = [batch for _, batches, _ in results for batch in batches[:6]]  # the 3 updates rank 0's state covers
    resumed = [ResumableDataLoader(IndexDataset(60), rank=r, world_size=3, **LOCKSTEP_KW) for r in range(3)]
    for dl in resumed:
        dl.load_state_dict(saved)
        trained += [b.tolist() for b in dl]
    assert_exactly_once(60, trained)


def _stale_store_job(rank, world_size):
    """The store still holds a count of an earlier use of these keys (a store shared across launches): the first
    publication replaces it, so lockstep ranks are not marked."""
    dl = ResumableDataLoader(IndexDataset(60), **LOCKSTEP_KW)
    generation, digest = dl.resumable_sampler.progress_id
    store = dist.distributed_c10d._get_default_store()
    store.set(dl._lockstep._key(rank), f"{generation}:{digest}:99")
    dist.barrier()
    it = iter(dl)
    for _ in range(3):
        _take_updates(it, dl, 1)
        dist.all_reduce(torch.zeros(1))
    return dl.state_dict()


def test_counts_left_in_the_store_by_an_earlier_launch_are_replaced():
    assert ["lockstep" in state for state in run_group(_stale_store_job, 2)] == [False, False]


def _store_gone_job(rank, world_size):
    """Rank 0, which serves the store, is gone when rank 1 takes its state: the check is dropped with a warning,
    the state is taken all the same."""
    dl = ResumableDataLoader(IndexDataset(60), **LOCKSTEP_KW)
    it = iter(dl)
    _take_updates(it, dl, 2)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        return None
    dist.distributed_c10d._get_default_store().set_timeout(timedelta(seconds=5))
    deadline = time.monotonic() + 30
    while _alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = dl.state_dict()
        _take_updates(it, dl, 1)  # and training goes on, unchecked
    return state, [str(w.message) for w in caught if w.category is LockstepWarning]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[-1].startswith("Z")  # a zombie is gone too


def test_a_store_that_fails_turns_the_check_off_and_never_the_state_dict():
    _, (state, warned) = run_group(_store_gone_job, 2)
    assert "lockstep" not in state and state["completed"] == 4
    assert len(warned) == 1 and "lockstep check is off" in warned[0]


def _uneven_job(rank, world_size):
    """Ranks that are not in lockstep: rank 1 leaves its loop two updates early (a rank-local stop)."""
    dl = ResumableDataLoader(IndexDataset(60), **LOCKSTEP_KW)
    it = iter(dl)
    trained = _take_updates(it, dl, 5 if rank == 0 else 3)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alone = dl.state_dict()
    gathered = global_progress(dl)  # every rank's progress: what the warning says to save
    return alone, [str(w.message) for w in caught if w.category is LockstepWarning], gathered, trained


def test_a_state_taken_out_of_lockstep_is_marked_at_save_and_refused_alone_at_load():
    results = run_group(_uneven_job, 2)
    (alone0, warned0, gathered, trained0), (alone1, warned1, _, trained1) = results
    assert alone0["lockstep"] == {"rank": 1, "updates": 3, "own_updates": 5}
    assert alone1["lockstep"] == {"rank": 0, "updates": 5, "own_updates": 3}
    assert len(warned0) == 1 and "rank 1 had completed 3 optimizer updates" in warned0[0]
    assert "save_checkpoint" in warned0[0]
    for alone in (alone0, alone1):
        dl = ResumableDataLoader(IndexDataset(60), rank=0, world_size=2, **LOCKSTEP_KW)
        before = dl.state_dict()
        with pytest.raises(StateError, match="not in lockstep.*every rank's progress"):
            dl.load_state_dict(alone)
        assert dl.state_dict() == before
    trained = trained0 + trained1
    resumed = [ResumableDataLoader(IndexDataset(60), rank=r, world_size=3, **LOCKSTEP_KW) for r in range(3)]
    for dl in resumed:
        dl.load_state_dict(gathered)  # the fix the message names: every rank's progress, merged
        trained += [b.tolist() for b in dl]
    assert_exactly_once(60, trained)


@pytest.mark.parametrize("mark", [{"rank": 1}, {"rank": -1, "updates": 3, "own_updates": 5}, "yes"])
def test_a_corrupted_lockstep_mark_is_refused(mark):
    dl = ResumableDataLoader(IndexDataset(20), rank=0, world_size=2, **LOCKSTEP_KW)
    state = {**dl.state_dict(), "lockstep": mark}
    with pytest.raises(StateError, match="lockstep"):
        dl.load_state_dict(state)
    with pytest.raises(StateError, match="lockstep"):
        merge_states([state, {**state, "rank": 1}])


# -- drop-in gaps found by running torch's own DataLoader tests --------------------------------------------------------


def test_batch_size_none_with_drop_last_is_refused_as_in_torch():
    with pytest.raises(ValueError, match="batch_size=None .* drop_last"):
        ResumableDataLoader(IndexDataset(4), batch_size=None, drop_last=True)


def test_the_class_is_generic_like_dataloader():
    alias = ResumableDataLoader[list[torch.Tensor]]
    assert alias.__origin__ is ResumableDataLoader


def test_the_iterator_forwards_torchs_attributes():
    dl = ResumableDataLoader(IndexDataset(8), batch_size=2, num_workers=2, multiprocessing_context="fork")
    it = iter(dl)
    assert len(it._workers) == 2 and it._num_workers == 2
    assert_exactly_once(8, [b.tolist() for b in it])


@pytest.mark.parametrize(
    "dataset, batch_size",
    [(IndexDataset(40), 2), (IndexDataset(40), None), (Plain(40), 2)],
    ids=["map-style", "map-style, batch_size=None", "stream"],
)
def test_persistent_workers_end_with_the_loader_without_the_garbage_collector(dataset, batch_size):
    """torch's test_partial_workers: a loop that breaks out and drops its loader ends the persistent workers at
    once. A reference cycle through the loader (its sampler's set_epoch) left them to the garbage collector."""
    pids = []
    gc.disable()
    try:
        dl = ResumableDataLoader(
            dataset, batch_size=batch_size, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
        )
        for i, _ in enumerate(dl):
            if i == 2:
                break
        pids = [worker.pid for worker in dl._iterator._workers]
        assert len(dl.sampler) > 0 if dl._stream is None else dl.state_dict()["batches"] == 3
        gone = weakref.ref(dl)
        del dl
        leaked = gone() is not None  # not in the assert: pytest would keep the loader in the failing frame
        assert not leaked, "something keeps the loader alive: only the garbage collector would free it"
        deadline = time.monotonic() + 30
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, pids)), "the persistent workers outlived their loader"
    finally:
        gc.enable()
        gc.collect()  # a loader left in a cycle shuts its workers down now; any still running are killed
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)


def test_states_of_different_steps_do_not_merge_unless_the_run_was_uneven():
    n, kw = 40, dict(batch_size=2, shuffle=True, seed=3)
    ranks = [ResumableDataLoader(IndexDataset(n), rank=r, world_size=2, **kw) for r in range(2)]
    iterators = [iter(dl) for dl in ranks]
    files = {}
    for step in range(1, 4):  # lockstep: each step, one micro-batch per rank; per-rank files saved every step
        for rank, it in enumerate(iterators):
            next(it)
            files[rank, step] = ranks[rank].state_dict()
    assert merge_states([files[0, 3], files[1, 3]])["committed"] == [[0, [0, 12]]]
    with pytest.raises(
        StateError,
        match="rank 0 completed 3 micro-batches of epoch 0, rank 1 2: the states come "
        "from different steps.*uneven=True",
    ):
        merge_states([files[0, 3], files[1, 2]])
    dl = ResumableDataLoader(IndexDataset(n), **kw)
    with pytest.raises(StateError, match="different steps"):
        dl.load_state_dict([files[0, 3], files[1, 2]])
    assert dl.state_dict() == ResumableDataLoader(IndexDataset(n), **kw).state_dict()
    uneven = merge_states([files[0, 3], files[1, 2]], uneven=True)  # e.g. rank 1 joined early (DDP Join)
    assert uneven["committed"] == [[0, [0, 10]]]  # rank 0: [0, 2) [4, 6) [8, 10); rank 1: [2, 4) [6, 8)


def test_ranks_on_both_sides_of_an_epoch_boundary_are_one_step():
    """One rank already took the next iter() (its new epoch has nothing delivered), the other not: same step."""
    kw = dict(batch_size=2, shuffle=True, seed=3, world_size=2)
    ranks = [ResumableDataLoader(IndexDataset(12), rank=r, **kw) for r in range(2)]
    for dl in ranks:
        list(dl)
    iter(ranks[0])
    assert (ranks[0].epoch, ranks[1].epoch) == (1, 0)
    merged = merge_states([dl.state_dict() for dl in ranks])
    assert merged["epoch"] == 1 and merged["committed"] == []


# -- a dataset that grows between epochs ------------------------------------------------------------------------------


def test_a_dataset_that_grows_between_epochs_is_served_whole_from_the_next_epoch():
    dataset, kw = IndexDataset(20), dict(batch_size=3, shuffle=True, seed=2)
    ranks = [ResumableDataLoader(dataset, rank=r, world_size=2, **kw) for r in range(2)]
    epoch_zero = [b.tolist() for dl in ranks for b in itertools.islice(dl, 2)]
    dataset.n = 23  # appended during the epoch: the epoch goes on with the length it started with
    with pytest.warns(ContinuedPassWarning):  # each rank's pass continued by a new iterator
        epoch_zero += [b.tolist() for dl in ranks for b in dl]
    assert_exactly_once(20, epoch_zero)
    dataset.n = 27  # appended between passes: the next epoch deals all 27
    assert [len(dl) for dl in ranks] == [5, 5]  # len() describes the next pass, which reads the new length
    first = [[b.tolist() for b in itertools.islice(dl, 2)] for dl in ranks]
    assert [dl.epoch for dl in ranks] == [1, 1] and [len(dl) for dl in ranks] == [5, 5]
    merged = merge_states([dl.state_dict() for dl in ranks])  # every rank moved to the same new progress
    assert merged["fingerprint"]["num_samples"] == 27 and merged["epoch"] == 1
    resumed = [ResumableDataLoader(IndexDataset(27), rank=r, world_size=3, **kw) for r in range(3)]
    for dl in resumed:
        dl.load_state_dict(merged)
    assert_exactly_once(27, first[0] + first[1] + [b.tolist() for dl in resumed for b in dl])
    with pytest.raises(StateError, match="num_samples is 27 in the saved state but 20"):
        ResumableDataLoader(IndexDataset(20), **kw).load_state_dict(merged)  # another length stays refused


@pytest.mark.parametrize("batch_size", [3, None])
@pytest.mark.parametrize("workers", WORKERS)
def test_len_after_the_dataset_grew_is_what_the_next_pass_yields(batch_size, workers):
    dataset = IndexDataset(10)
    dl = ResumableDataLoader(dataset, batch_size=batch_size, shuffle=True, seed=1, rank=1, world_size=2, **workers)
    list(dl)
    dataset.n = 18
    length, left, samples = len(dl), dl.batches_left, len(dl.sampler)
    assert dl.state_dict()["base"]["fingerprint"]["num_samples"] == 10  # asking changed nothing
    mine, other = (
        [],
        ResumableDataLoader(IndexDataset(18), batch_size=batch_size, shuffle=True, seed=1, rank=0, world_size=2),
    )
    other.set_epoch(1)
    for i, _ in enumerate(dl):
        mine.append(dl.last_indices().tolist())
        if i == 0:
            dataset.n = 30  # appended during the pass: it goes on with the length it started with
            assert len(dl) == length and dl.batches_left == left - 1
    assert dl.epoch == 1 and len(mine) == length == left and sum(map(len, mine)) == samples
    assert_exactly_once(18, mine + [other.last_indices().tolist() for _ in other])


@pytest.mark.parametrize("shuffle_blocks, workers", [(None, {}), (4, WORKERS[1])])
def test_the_order_is_rebuilt_for_the_new_length(shuffle_blocks, workers):
    dataset = IndexDataset(10)
    dl = ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=1, shuffle_blocks=shuffle_blocks, **workers)
    list(dl)
    dataset.n = 14
    grown = [b.tolist() for b in dl]
    fresh = ResumableDataLoader(IndexDataset(14), batch_size=4, shuffle=True, seed=1, shuffle_blocks=shuffle_blocks)
    fresh.set_epoch(1)
    assert grown == [b.tolist() for b in fresh]  # as a loader built for 14 samples serves epoch 1
    assert dl.state_dict() == fresh.state_dict()


def test_a_length_change_is_refused_where_progress_of_the_old_length_is_committed():
    dataset = IndexDataset(20)
    saved = ResumableDataLoader(dataset, batch_size=4, shuffle=True)
    first = next(iter(saved)).tolist()
    dl = ResumableDataLoader(dataset, batch_size=4, shuffle=True)
    dl.load_state_dict(saved.state_dict())  # resumed inside epoch 0
    before = dl.state_dict()
    dataset.n = 24
    with pytest.raises(
        ValueError,
        match="length changed from 20 to 24 before epoch 0 started, but epoch 0 has "
        "progress committed under 20 samples.*resume with the dataset of 20",
    ):
        iter(dl)
    assert dl.state_dict() == before
    dataset.n = 20
    assert_exactly_once(20, [first] + [b.tolist() for b in dl])  # as it was, once the length is back


def test_a_length_change_with_block_sizes_given_is_refused():
    dataset = IndexDataset(10)
    dl = ResumableDataLoader(dataset, batch_size=4, shuffle=True, shuffle_blocks=[5, 5])
    list(dl)
    dataset.n = 12
    for refused in (iter, len):  # len() describes that pass
        with pytest.raises(
            ValueError,
            match="length changed from 10 to 12 before epoch 1 started, but "
            "shuffle_blocks was given as block sizes summing to 10.*block sizes "
            "for 12",
        ):
            refused(dl)
