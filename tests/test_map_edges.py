"""Exactly once at the map-style loader's edges that the training-loop paths (test_every_path) do not take: a worker
process that dies, a pass whose index lists end before the rank's share does, and operation sequences that
interleave iterators, states, epochs and world sizes.

Every test counts each index of the epoch: delivered exactly once, or refused loudly.
"""

import itertools
import os
import signal
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from loader import ContinuedPassWarning, ResumableDataLoader, merge_states
from loader.dataloader import WorkerInitError
from tests.conftest import IndexDataset


def assert_each_once(n, batches):
    counts = Counter(itertools.chain.from_iterable(batches))
    assert max(counts.values(), default=1) == 1, f"repeated: {sorted(i for i, c in counts.items() if c > 1)}"
    assert set(counts) == set(range(n)), f"skipped: {sorted(set(range(n)) - set(counts))}"


def kill(worker):
    try:
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
    except RuntimeError:  # torch's SIGCHLD handler may report the death here already
        pass
    assert not worker.is_alive()


@pytest.mark.slow  # starts worker processes
def test_an_iterator_whose_worker_died_stops_and_a_new_iter_serves_each_batch_once():
    """torch goes on past the tasks of a worker it found dead: next() on the same iterator returned later batches,
    which the loader counted as the ones it had dealt, so last_indices() named other samples and the state committed
    the dead worker's batches, never trained, in place of delivered ones."""
    n = 60
    dl = ResumableDataLoader(
        IndexDataset(n), batch_size=3, shuffle=True, seed=2, num_workers=2, multiprocessing_context="fork"
    )
    it = iter(dl)
    delivered = [next(it).tolist() for _ in range(4)]
    kill(it._workers[0])
    errors = []
    while len(errors) < 5:
        try:
            batch = next(it)
        except StopIteration:
            break
        except RuntimeError as err:  # torch's own, then: take a new iter()
            errors.append(str(err))
            if "new iter()" in str(err):
                with pytest.warns(ContinuedPassWarning):
                    it = iter(dl)
            continue
        assert batch.tolist() == dl.last_indices().tolist(), "the batch out is not the one counted"
        delivered.append(batch.tolist())
    assert_each_once(n, delivered)
    assert len(errors) == 2 and "worker process of this iterator died" in errors[1]
    assert dl.state_dict()["completed"] == len(delivered)


@pytest.mark.slow  # starts worker processes
def test_a_new_iter_after_a_persistent_worker_died_starts_new_workers_and_continues_exactly():
    """torch resets persistent workers at a new iter(); a killed one never acknowledges, so every later iter()
    raised 'exited unexpectedly' (or waited out `timeout`): the loader could never deliver again."""
    n = 60
    dl = ResumableDataLoader(
        IndexDataset(n),
        batch_size=3,
        shuffle=True,
        seed=2,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    it = iter(dl)
    delivered = [next(it).tolist() for _ in range(4)]
    kill(it._workers[0])
    with pytest.warns(ContinuedPassWarning):
        it = iter(dl)
    delivered += [batch.tolist() for batch in it]
    assert dl.exhausted
    assert_each_once(n, delivered)
    assert all(w.is_alive() for w in dl._iterator._workers)
    dl._iterator._shutdown_workers()


class PlanThatFails(IndexDataset):
    """A dataset whose `planned` hook (reading ahead in the index lists, as remote shards do) raises once."""

    def __init__(self, n: int, at: int):
        super().__init__(n)
        self.at = at

    def planned(self, batches, in_flight):
        for i, batch in enumerate(batches):
            if i == self.at:
                self.at = None
                raise OSError("prefetching a shard failed")
            yield batch


@pytest.mark.parametrize("workers", [dict(), dict(num_workers=2, multiprocessing_context="fork")])
def test_index_lists_that_end_short_are_refused_and_a_new_iter_serves_the_rest(workers):
    """A generator that raised is over: torch then ended the pass after what it had dispatched, the loader marked
    the epoch ended, and the next pass started the next epoch, skipping the rest of this one without a word."""
    n = 45
    dl = ResumableDataLoader(PlanThatFails(n, at=6), batch_size=3, shuffle=True, seed=4, **workers)
    delivered, failed, refused = [], [], 0
    it = iter(dl)
    while True:
        upcoming = dl.resumable_sampler.next_indices().tolist()
        try:
            delivered.append(next(it).tolist())
        except StopIteration:
            break
        except OSError:
            failed.append(upcoming)  # consumed and recorded as failed, as a batch whose loading raised
        except RuntimeError as err:
            assert "index lists ended" in str(err)
            refused += 1
            with pytest.warns(ContinuedPassWarning):
                it = iter(dl)
    assert_each_once(n, delivered + failed)
    assert refused == 1 and len(failed) == 1 and dl.epoch == 0 and dl.exhausted


class InitFailingOnce:
    """A worker_init_fn that raises `error` in worker 1 the first time (a file marks it: workers are processes)."""

    def __init__(self, mark, error=ConnectionError):
        self.mark, self.error = mark, error

    def __call__(self, worker_id):
        if worker_id == 1 and not self.mark.exists():
            self.mark.touch()
            raise self.error("could not open the database")


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_init_fn_that_raises_consumes_no_batch(tmp_path, persistent):
    """torch hands a worker whose init raised its first batch as that error and every later one as an
    UnboundLocalError: half the epoch counted as failed batches, whose data was never read."""
    n = 30
    dl = ResumableDataLoader(
        IndexDataset(n),
        batch_size=3,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=InitFailingOnce(tmp_path / "failed"),
        persistent_workers=persistent,
    )
    delivered, errors, it = [], [], iter(dl)
    while len(errors) < 5:
        try:
            delivered.append(next(it).tolist())
        except StopIteration:
            break
        except Exception as err:  # the loop that skips a bad batch
            errors.append(err)
            if "new iter()" in str(err):
                with pytest.warns(ContinuedPassWarning):
                    it = iter(dl)
    assert_each_once(n, delivered)
    assert isinstance(errors[0], WorkerInitError) and "could not open the database" in str(errors[0])
    assert isinstance(errors[0], ConnectionError)  # its own type too, as torch re-raises it
    assert len(errors) == 2 and dl.metrics()["total/failed_batches"] == 0
    if persistent:
        dl._iterator._shutdown_workers()


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("caught", [ValueError, WorkerInitError])
def test_a_worker_init_fn_error_is_caught_as_its_own_type_too(tmp_path, caught):
    """torch's DataLoader re-raises a worker_init_fn's exception as its own type: a loop written for it (`except
    ValueError:`) let the loader's WorkerInitError, a RuntimeError only, through."""
    n = 30
    dl = ResumableDataLoader(
        IndexDataset(n),
        batch_size=3,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=InitFailingOnce(tmp_path / "failed", ValueError),
    )
    delivered, errors, it = [], [], iter(dl)
    while len(errors) < 3:
        try:
            delivered.append(next(it).tolist())
        except StopIteration:
            break
        except caught as err:
            errors.append(err)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ContinuedPassWarning)  # worker 0 may have delivered a batch
                it = iter(dl)
    assert_each_once(n, delivered)
    (error,) = errors
    assert isinstance(error, ValueError) and isinstance(error, WorkerInitError)
    assert type(error).__name__ == "WorkerInitError[ValueError]" and "could not open the database" in str(error)


class Growing(Dataset):
    """A dataset of a list that grows: an index past its length raises, as a real one does."""

    def __init__(self, n: int):
        self.items = list(range(n))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


@pytest.mark.slow  # starts worker processes
def test_persistent_workers_start_anew_when_the_dataset_grew_between_epochs():
    """Persistent workers hold the dataset as it was when they started: the next epoch was dealt at the new length,
    and every batch holding a new index failed in them (consumed, never trained)."""
    dataset = Growing(12)
    dl = ResumableDataLoader(
        dataset,
        batch_size=3,
        shuffle=True,
        seed=1,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    assert_each_once(12, [batch.tolist() for batch in dl])
    dataset.items += range(12, 20)
    assert_each_once(20, [batch.tolist() for batch in dl])
    assert dl.epoch == 1
    dl._iterator._shutdown_workers()


class Seeded(IndexDataset):
    def __getitem__(self, index):
        return torch.tensor([int(index), index.seed % 2**31])


@pytest.mark.parametrize("batch_size", [3, None])
def test_peek_hands_the_dataset_the_sample_seeds_a_delivery_would(batch_size):
    """peek() fetched plain ints, so a dataset with sample_seeds=True (augmentations seeded by `index.seed`)
    failed, or showed another batch than the one delivered next."""
    dl = ResumableDataLoader(Seeded(7), batch_size=batch_size, shuffle=True, seed=3, sample_seeds=True)
    it, delivered = iter(dl), []
    for _ in range(2 * len(dl)):  # past the epoch's end: peeked there, the next epoch's first batch and seeds
        peeked = dl.peek()
        try:
            batch = next(it)
        except StopIteration:
            batch = next(it := iter(dl))
        assert torch.equal(peeked, batch)
        delivered.append(batch.reshape(-1, 2)[:, 0].tolist())
    assert_each_once(7, delivered[: len(dl)])
    assert_each_once(7, delivered[len(dl) :])


# -- operation sequences -------------------------------------------------------------------------------------------


class LockstepJob:
    """W ranks stepping together, as under DDP: each op is one a training script performs alike on every rank. The
    model is the test's own: what each epoch committed (delivered in completed updates), as of now and as of each
    checkpoint, so that a rewind to a checkpoint forgets exactly what came after it."""

    def __init__(self, n, kw, world):
        self.n, self.kw = n, kw
        self.start(world, None)

    def start(self, world, state):
        self.loaders = [
            ResumableDataLoader(IndexDataset(self.n), rank=r, world_size=world, **self.kw) for r in range(world)
        ]
        self.pending = [[] for _ in self.loaders]  # delivered micro-batches of an update not completed yet
        if state is not None:
            for dl in self.loaders:
                dl.load_state_dict(state)
        self.iterators = [None] * world

    def step(self, committed, dropped, micro_batches=None):
        """Micro-batches on every rank, up to the end of the update (the epoch's last may be short) or of the pass:
        `micro_batches` of them at most. Those of a completed update are committed; the others wait."""
        ends = set()
        for r, dl in enumerate(self.loaders):
            if self.iterators[r] is None:
                self.iterators[r] = iter(dl)
            for _ in itertools.count() if micro_batches is None else range(micro_batches):
                upcoming = dl.peek().tolist() if dl.batches_left else None
                try:
                    batch = next(self.iterators[r]).tolist()
                except StopIteration:
                    self.iterators[r] = None
                    break
                assert batch == upcoming == dl.last_indices().tolist()
                self.pending[r].append((dl.epoch, batch))
                if dl.update_complete:
                    for epoch, done in self.pending[r]:
                        committed.setdefault(epoch, Counter()).update(done)
                    self.pending[r] = []
                    break
            ends.add(self.iterators[r] is None)
        assert len(ends) == 1, "ranks in lockstep end their pass together"
        self.record_dropped(dropped)

    def record_dropped(self, dropped):
        """The positions dropped by the tail rule, per finished epoch: a merge lists the epochs it finished, or
        (finishing none) those its base lists, which loading a state at an epoch's end finished."""
        states = [dl.state_dict() for dl in self.loaders]
        for record in states[0]["base"]["finished"] + merge_states(states)["finished"]:
            dropped[record["epoch"]] = record["dropped"]

    def new_iterators(self):
        """A new iter() on every rank: within a pass it continues it, so a state taken before its first next()
        is the state before it (after an ended pass, the next epoch's start, which the final check covers)."""
        before = [None if dl.resumable_sampler.ended else dl.state_dict() for dl in self.loaders]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ContinuedPassWarning)
            self.iterators = [iter(dl) for dl in self.loaders]
        assert all(state in (None, dl.state_dict()) for state, dl in zip(before, self.loaders))


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 40),
    batch_size=st.integers(1, 4),
    grad_accum=st.integers(1, 3),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    world=st.integers(1, 3),
)
def test_operation_sequences_commit_every_index_exactly_once(
    data, n, batch_size, grad_accum, shuffle, drop_last, world
):
    """Updates and single micro-batches (a checkpoint may fall inside an update), new iterators, peeks, set_epoch
    (the current epoch, or the next after a whole share), states taken between iter() and next(), and rewinds to a
    checkpoint (into the live loaders, or at a new world size), interleaved at random: at the end each epoch holds
    every index once, committed or dropped by the tail rule."""
    kw = dict(batch_size=batch_size, grad_accum=grad_accum, shuffle=shuffle, drop_last=drop_last, seed=n)
    job = LockstepJob(n, kw, world)
    committed, dropped = {}, {}
    checkpoint = (job.loaders[0].state_dict(), {})
    ops = st.sampled_from(["step", "step", "micro", "micro", "iter", "set_epoch", "save", "rewind", "restart"])
    for op in data.draw(st.lists(ops, max_size=30), label="ops"):
        if op in ("step", "micro"):
            job.step(committed, dropped, 1 if op == "micro" else None)
        elif op == "iter":
            job.new_iterators()
        elif op == "set_epoch":  # the current epoch (a resumed loop's first call), or the next after a whole share
            advance = job.loaders[0].exhausted
            for dl in job.loaders:
                dl.set_epoch(dl.epoch + advance)
            if advance:  # a new epoch supersedes the iterators
                job.iterators = [None] * len(job.loaders)
        elif op == "save":  # rank 0's state stands for every rank in lockstep
            checkpoint = (job.loaders[0].state_dict(), {e: Counter(c) for e, c in committed.items()})
        else:
            state, snapshot = checkpoint
            committed = {e: Counter(c) for e, c in snapshot.items()}
            if op == "rewind":
                for dl in job.loaders:
                    dl.load_state_dict(state)
                job.iterators, job.pending = [None] * len(job.loaders), [[] for _ in job.loaders]
            else:
                job.start(data.draw(st.integers(1, 3), label="new world"), state)
    last = job.loaders[0].epoch
    while job.loaders[0].epoch == last:
        job.step(committed, dropped)
    for epoch in range(last + 1):
        counts = committed.get(epoch, Counter())
        assert max(counts.values(), default=1) == 1, (
            f"epoch {epoch}: repeated {[i for i, c in counts.items() if c > 1]}"
        )
        spans = np.asarray(dropped[epoch], dtype=np.int64).reshape(-1, 2)
        positions = np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])
        dropped_ids = set(job.loaders[0].resumable_sampler.order.for_epoch(epoch)(positions).tolist())
        assert not dropped_ids & set(counts), f"epoch {epoch}: a sample recorded as dropped was delivered"
        assert dropped_ids | set(counts) == set(range(n)), f"epoch {epoch}: skipped"


class Carried(IndexDataset):
    """Each sample: its index and what the index carries (-1: nothing)."""

    def __getitem__(self, index):
        seed = getattr(index, "seed", None)
        return torch.tensor([int(index), -1 if seed is None else seed % 2**31, getattr(index, "epoch", -1)])


def _zero_seed_carries_seeds(batch_size):
    from loader.core.order import sample_seed

    dl = ResumableDataLoader(Carried(10), batch_size=batch_size, shuffle=True, sample_seeds=True)  # seed=0
    peeked, batches = dl.peek(), list(dl)
    assert torch.equal(peeked, batches[0])
    rows = torch.cat([b.reshape(-1, 3) for b in batches]).tolist()
    assert sorted(i for i, _, _ in rows) == list(range(10))
    assert [s for _, s, _ in rows] == [int(sample_seed(0, 0, i)) % 2**31 for i, _, _ in rows]


class EpochAware(Carried):
    epoch_aware = True


def _epoch_0_is_carried():
    rows = torch.cat(list(ResumableDataLoader(EpochAware(10), batch_size=3, shuffle=True))).tolist()
    assert sorted(i for i, _, _ in rows) == list(range(10)) and {(s, e) for _, s, e in rows} == {(-1, 0)}


def _zero_seed_is_a_seed_of_the_fingerprint():
    from loader.core.state import StateError

    state = ResumableDataLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=0).state_dict()
    with pytest.raises(StateError, match="seed"):
        ResumableDataLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=3).load_state_dict(state)


def _rank_0_is_a_rank():
    batches = [list(ResumableDataLoader(IndexDataset(10), batch_size=2, rank=r, world_size=2)) for r in (0, 1)]
    assert_each_once(10, [b.tolist() for rank in batches for b in rank])


def _change_at_0_changes_from_the_first_window():
    from torch.utils.data import TensorDataset

    from loader.sources import Mixture

    sources = [TensorDataset(torch.arange(100)), TensorDataset(torch.arange(100))]
    old = Mixture(sources, [0.5, 0.5], 40, window=10)
    new = Mixture(sources, [0.9, 0.1], 40, window=10, amends=old.plan, change_at=0)
    assert np.bincount(new.plan.source_of(np.arange(10)), minlength=2).tolist() == [9, 1]


ZERO_CASES = {
    "sample_seeds with seed=0": lambda: _zero_seed_carries_seeds(3),
    "sample_seeds with seed=0, batch_size=None": lambda: _zero_seed_carries_seeds(None),
    "epoch 0 of an epoch-aware dataset": _epoch_0_is_carried,
    "seed=0 in the order's fingerprint": _zero_seed_is_a_seed_of_the_fingerprint,
    "rank=0 given": _rank_0_is_a_rank,
    "Mixture change_at=0": _change_at_0_changes_from_the_first_window,
}


@pytest.mark.parametrize("case", ZERO_CASES)
def test_options_at_zero_are_values_not_off(case):
    """0 is the default seed and epoch, and a valid rank and change_at: each must act as that value, never as the
    option left out (`sample_seeds=True` with seed 0 handed the dataset plain ints)."""
    ZERO_CASES[case]()
