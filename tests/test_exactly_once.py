"""Exactly once across restarts: several ranks simulated by several loaders in one process.

Random dataset sizes, batch sizes, accumulation, world sizes that shrink and grow, ranks that stop at different
points (also inside an update, also right at an epoch's end, before or after its StopIteration) and at least three
restarts, batches that fail to load, and new iterators taken in the middle of a pass: over every epoch, each index
is committed exactly once, or failed to load exactly once, or was dropped by the tail rule (exactly as many as it
drops) and is recorded as such. The same holds for mixtures of sources (their positions are the indices), and with
the same global batch every update of a resized run holds the same samples, source by source, as the uninterrupted
run's.
"""

import warnings
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from loader import ContinuedPassWarning, ResumableDataLoader, merge_states
from loader.sources import Mixture
from tests.conftest import IndexDataset

SOURCE_STRIDE = 1000  # sample i of mixture source s is s * SOURCE_STRIDE + i: a batch shows source and index


class TaggedSource(IndexDataset):
    def __init__(self, n: int, number: int):
        super().__init__(n)
        self.number = number

    def __getitem__(self, index):
        return self.number * SOURCE_STRIDE + super().__getitem__(index)


def tagged_mixture(lengths, weights, num_samples, seed):
    return Mixture([TaggedSource(n, s) for s, n in enumerate(lengths)], weights, num_samples, seed)


def content_of(dataset):
    """What a batch of these dataset indices of an epoch must hold: the indices, or for a mixture the located
    samples (of the epoch's own positions, under shuffle=True)."""
    if not isinstance(dataset, Mixture):
        return lambda ids, epoch: list(ids)

    def located(ids, epoch):
        source, index = dataset.plan.locate(dataset.plan.in_epoch(ids, epoch))
        return (source * SOURCE_STRIDE + index).tolist()

    return located


class FailingCollate:
    """Collation that raises for a batch holding a bad index, remembering the batch (num_workers=0 only)."""

    def __init__(self, bad: set[int]):
        self.bad, self.last = bad, None

    def __call__(self, items):
        self.last = [int(i) for i in items]
        if self.bad & set(self.last):
            raise ValueError("a corrupt record")
        return torch.tensor(self.last)


class Keep:
    """A filter: keeps a sample by a keyed hash of its value, `fifths` of them (0: none, 5: all), remembering the
    indices it was asked about (num_workers=0 only), so a batch that failed to load is known whole."""

    def __init__(self, fifths: int, salt: int):
        self.fifths, self.salt, self.asked = fifths, salt, []

    def rule(self, sample) -> bool:
        return (int(sample) * 7919 + self.salt) % 5 < self.fifths

    def __call__(self, index, sample) -> bool:
        self.asked.append(int(index))
        return self.rule(sample)


class SimulatedRank:
    """One rank's training loop: consumes micro-batches, skips batches that fail to load, sometimes takes a new
    iterator in the middle of a pass, commits whole updates, remembers what it committed and what failed (and,
    under a filter, what the filter dropped)."""

    def __init__(self, dl, draw, keep=None):
        self.dl, self.draw, self.iterator, self.pending = dl, draw, None, []
        self.in_pass, self.share, self.keep = 0, None, keep
        self.content = content_of(dl.dataset)

    def consume(self, count, committed, failed, filtered=None):
        for _ in range(count):
            if self.iterator is None:
                self.iterator, self.in_pass, self.share = iter(self.dl), 0, self.dl.batches_left
            elif self.draw(st.integers(0, 9), label="new iterator mid-pass") == 0:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ContinuedPassWarning)
                    self.iterator = iter(self.dl)  # continues the pass
            asked = len(self.keep.asked) if self.keep else 0
            try:
                batch = next(self.iterator)
            except StopIteration:
                self.iterator = None
                continue
            except ValueError:  # skip the bad batch, keep iterating the same iterator
                self.in_pass += 1  # under a filter, collate_fn saw the kept members only: the filter saw them all
                ids = self.keep.asked[asked:] if self.keep else self.dl.collate_fn.last
                self.pending.append((self.dl.epoch, ids, failed))
            else:
                ids = self.dl.last_indices().tolist()
                # batch_size=None: a sample
                assert np.atleast_1d(np.asarray(batch)).tolist() == self.content(ids, self.dl.epoch)
                self.in_pass += 1
                self.pending.append((self.dl.epoch, ids, committed))
                if filtered is not None:  # under filter=: the members it dropped, recorded at the same update
                    self.pending.append((self.dl.epoch, self.dl.last_filtered().tolist(), filtered))
            # the test's own rule for a whole update: K micro-batches (failed ones included), or the end of the share
            whole = self.in_pass % self.dl.grad_accum == 0 or self.in_pass == self.share
            if self.pending[-1][2] is not failed:
                assert self.dl.update_complete == whole
            if whole:
                for epoch, done, into in self.pending:
                    into[epoch].update(done)
                self.pending = []

    def run_pass_to_end(self, committed, failed, filtered=None):
        """Deliver batches until this rank's current pass (or a new one) ends."""
        if self.iterator is None:
            self.iterator, self.in_pass, self.share = iter(self.dl), 0, self.dl.batches_left
        while self.iterator is not None:
            self.consume(1, committed, failed, filtered)


def simulate(data, dataset, batch_size, grad_accum, shuffle, drop_last, worlds, num_workers, keep=None):
    """Under a filter (`keep`, a Keep), each index is also recorded as filtered by it, exactly once, or else trained
    or failed exactly once; kept ones pass its rule, filtered ones do not."""
    n, seed = len(dataset), data.draw(st.integers(0, 2**32), label="seed")
    unbatched = batch_size is None  # single samples: torch refuses drop_last, and the tail rule is drop_last's
    drop_last = drop_last and not unbatched
    # FailingCollate knows a bad batch by its items, which are its indices for IndexDataset (not for a mixture)
    failures = not num_workers and not isinstance(dataset, Mixture) and not unbatched
    bad = set(data.draw(st.lists(st.integers(0, n - 1), max_size=3), label="bad indices")) if failures else set()
    orders_itself = shuffle and isinstance(dataset, Mixture)  # lanes would scatter its positions: refused
    lanes = None if orders_itself else data.draw(st.sampled_from([None, 1, 2, 3, 4]), label="lanes")
    committed, failed, state = defaultdict(Counter), defaultdict(Counter), None
    filtered = defaultdict(Counter) if keep else None

    def make(world):
        loaders = [
            ResumableDataLoader(
                dataset,
                batch_size=batch_size,
                shuffle=shuffle,
                drop_last=drop_last,
                seed=seed,
                rank=r,
                world_size=world,
                grad_accum=grad_accum,
                num_workers=num_workers,
                multiprocessing_context="fork" if num_workers else None,
                collate_fn=FailingCollate(bad) if failures else None,
                lanes=lanes,
                filter=keep,
            )
            for r in range(world)
        ]
        if state is not None:
            for dl in loaders:
                dl.load_state_dict(state)
        return [SimulatedRank(dl, data.draw, keep) for dl in loaders]

    dropped, policy = {}, {}

    def merge(ranks, world):
        """Also records, per epoch, the dropped positions and what the tail rule drops of the samples the finishing
        layout started from: R mod G with drop_last (and unbatched, where G = W * K), else nothing unless R < W."""
        merged = merge_states([rank.dl.state_dict() for rank in ranks], uneven=True)
        for record in merged["finished"]:
            if record["epoch"] not in dropped:
                dropped[record["epoch"]] = record["dropped"]
                base = dict(state["committed"]) if state else {}
                spans = np.asarray(base.get(record["epoch"], []), dtype=np.int64).reshape(-1, 2)
                left = n - int((spans[:, 1] - spans[:, 0]).sum())
                global_batch = world * grad_accum * (batch_size or 1)
                policy[record["epoch"]] = left % global_batch if drop_last or unbatched else left * (left < world)
        return merged

    for world in worlds[:-1]:
        ranks = make(world)
        for rank in ranks:  # ranks consume unequal amounts, sometimes stopping inside an update
            rank.consume(
                data.draw(st.integers(0, len(rank.dl) + 2), label="micro-batches"), committed, failed, filtered
            )
        state = merge(ranks, world)
    ranks = make(worlds[-1])
    for rank in ranks:
        rank.run_pass_to_end(committed, failed, filtered)
    last_epoch = ranks[0].dl.epoch
    assert all(rank.dl.epoch == last_epoch for rank in ranks)
    assert merge(ranks, worlds[-1])["epoch"] == last_epoch + 1

    for epoch in range(last_epoch + 1):
        counts = committed[epoch] + failed[epoch]
        if keep:
            kept, content = set(committed[epoch]), content_of(dataset)
            assert all(map(keep.rule, content(sorted(kept), epoch))), (
                f"epoch {epoch}: a sample the filter drops was trained"
            )
            assert not any(map(keep.rule, content(sorted(filtered[epoch]), epoch))), (
                f"epoch {epoch}: a kept one recorded"
            )
            counts += filtered[epoch]
        assert max(counts.values(), default=1) == 1, (
            f"epoch {epoch}: duplicated {[i for i, c in counts.items() if c > 1]}"
        )
        assert not failed[epoch] or bad & set(failed[epoch]), "only batches holding a bad index fail"
        event(f"failed samples: {'some' if failed[epoch] else 'none'}")
        assert not bad & set(committed[epoch]), f"epoch {epoch}: a bad sample was delivered"
        spans = np.asarray(dropped[epoch]).reshape(-1, 2)
        positions = np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])
        dropped_ids = set(ranks[0].dl.resumable_sampler.order.for_epoch(epoch)(positions).tolist())
        assert not dropped_ids & set(counts), f"epoch {epoch}: a sample recorded as dropped was delivered"
        assert dropped_ids | set(counts) == set(range(n)), f"epoch {epoch}: skipped samples"
        assert len(dropped_ids) == policy[epoch], f"epoch {epoch}: dropped {len(dropped_ids)}, not {policy[epoch]}"


RUNS = dict(  # a dataset size, the loader's arguments and at least three restarts at shrinking and growing sizes
    n=st.integers(1, 160),
    batch_size=st.one_of(st.integers(1, 7), st.none()),  # None: torch's unbatched mode, a sample per item
    grad_accum=st.integers(1, 3),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    worlds=st.lists(st.integers(1, 5), min_size=4, max_size=5),
)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), **RUNS)
def test_every_sample_committed_exactly_once_across_restarts(
    data, n, batch_size, grad_accum, shuffle, drop_last, worlds
):
    simulate(data, IndexDataset(n), batch_size, grad_accum, shuffle, drop_last, worlds, num_workers=0)


@pytest.mark.slow  # starts worker processes, for every example
@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    n=st.integers(20, 120),
    batch_size=st.integers(1, 5),
    grad_accum=st.integers(1, 2),
    worlds=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    num_workers=st.integers(1, 2),
)
def test_exactly_once_with_worker_processes(data, n, batch_size, grad_accum, worlds, num_workers):
    simulate(data, IndexDataset(n), batch_size, grad_accum, True, False, worlds, num_workers)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), **RUNS)
def test_mixtures_are_exactly_once_across_restarts(
    data, lengths, n, batch_size, grad_accum, shuffle, drop_last, worlds
):
    """Random weights, source lengths (sources shorter than their share repeat, epoch by epoch), world sizes and
    uneven stops: every mixture position is committed once, and each batch holds the samples located there."""
    weights = data.draw(st.lists(st.floats(0.1, 5.0), min_size=len(lengths), max_size=len(lengths)), label="weights")
    mix = tagged_mixture(lengths, weights, n, seed=data.draw(st.integers(0, 2**32), label="mixture seed"))
    simulate(data, mix, batch_size, grad_accum, shuffle, drop_last, worlds, num_workers=0)


def updates_of(mix, world, micro_batch, global_batch, state=None, updates=None):
    """Run `updates` lockstep updates (None: to the end of the epoch; never more than the epoch has left) at
    this world size with the same global batch; returns each update's samples (sorted) and the merged state."""
    accum = global_batch // (world * micro_batch)
    ranks = [
        ResumableDataLoader(mix, batch_size=micro_batch, rank=r, world_size=world, grad_accum=accum, drop_last=True)
        for r in range(world)
    ]
    iterators = []
    for dl in ranks:
        if state is not None:
            dl.load_state_dict(state)
        iterators.append(iter(dl))
    done = []
    while updates is None or len(done) < updates:
        samples = [s for dl, it in zip(ranks, iterators) for s in take_update(dl, it)]
        if not samples:
            break
        done.append(sorted(samples))
    return done, merge_states([dl.state_dict() for dl in ranks])


def take_update(dl, iterator):
    """This rank's samples of one update: micro-batches until the loader says the update is complete."""
    samples = []
    for batch in iterator:
        samples += batch.tolist()
        if dl.update_complete:
            break
    return samples


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=3),
    micro_batch=st.sampled_from([1, 2]),
    worlds=st.lists(st.sampled_from([1, 2, 3, 6]), min_size=2, max_size=4),
)
def test_a_resized_mixture_run_keeps_every_global_batch_of_the_uninterrupted_run(data, lengths, micro_batch, worlds):
    """drop_last=True, as LM pretraining runs: without it, a tail of fewer samples than ranks rides on the last full
    update (the tail rule), so only the epoch's last update could differ."""
    global_batch = 12
    weights = data.draw(st.lists(st.integers(1, 9), min_size=len(lengths), max_size=len(lengths)), label="weights")
    mix = tagged_mixture(lengths, weights, data.draw(st.integers(12, 200), label="positions"), seed=7)
    reference, _ = updates_of(mix, 1, micro_batch, global_batch)
    resized, state = [], None
    for world in worlds[:-1]:
        left = len(reference) - len(resized)
        done, state = updates_of(
            mix, world, micro_batch, global_batch, state, data.draw(st.integers(0, left), label="updates")
        )
        resized += done
    resized += updates_of(mix, worlds[-1], micro_batch, global_batch, state)[0]
    assert resized == reference
    per_source = [np.bincount(np.asarray(u) // SOURCE_STRIDE, minlength=len(lengths)).tolist() for u in reference]
    assert per_source == [np.bincount(np.asarray(u) // SOURCE_STRIDE, minlength=len(lengths)).tolist() for u in resized]


FILTERED_RUNS = dict(RUNS, batch_size=st.integers(1, 7), fifths=st.integers(0, 5))  # filter= needs batches


@settings(max_examples=60, deadline=None)
@given(data=st.data(), **FILTERED_RUNS)
def test_under_a_filter_every_sample_is_trained_or_filtered_exactly_once(
    data, n, batch_size, grad_accum, shuffle, drop_last, worlds, fifths
):
    """filter= keeps none, some or all samples: the kept ones trained exactly once, the others recorded as filtered
    exactly once (last_filtered), across restarts after uneven consumption, with batches that fail to load."""
    keep = Keep(fifths, data.draw(st.integers(0, 4), label="salt"))
    simulate(data, IndexDataset(n), batch_size, grad_accum, shuffle, drop_last, worlds, 0, keep)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), **FILTERED_RUNS)
def test_a_filtered_mixture_is_exactly_once_across_restarts(
    data, lengths, n, batch_size, grad_accum, shuffle, drop_last, worlds, fifths
):
    """The filter sees the mixture's samples (the predicate's index is the mixture position's)."""
    mix = tagged_mixture(lengths, [1.0] * len(lengths), n, seed=data.draw(st.integers(0, 2**32), label="mixture seed"))
    simulate(data, mix, batch_size, grad_accum, shuffle, drop_last, worlds, 0, Keep(fifths, 1))


@pytest.mark.slow  # starts worker processes
@settings(max_examples=3, deadline=None)
@given(data=st.data(), fifths=st.integers(0, 5))
def test_a_filter_in_worker_processes_is_exactly_once_at_4_3_2_ranks(data, fifths):
    """The verdicts made in 2 workers reach the loader with each batch, at 4, 3 and 2 ranks after uneven stops."""
    simulate(data, IndexDataset(90), 4, 2, True, False, [4, 3, 2], 2, Keep(fifths, 3))
