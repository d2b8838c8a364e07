"""Exactly once at the map-style loader's edges that the training-loop paths (test_every_path) do not take: a worker
that dies under persistent workers, a pass whose index lists end before the rank's share does, and operation
sequences that interleave iterators, states, epochs and world sizes.

Every test counts each index of the epoch: delivered exactly once, or refused loudly.
"""

import itertools
import os
import signal
from collections import Counter

import pytest

from loader import ContinuedPassWarning, ResumableDataLoader
from tests.conftest import IndexDataset


def assert_each_once(n, batches):
    counts = Counter(itertools.chain.from_iterable(batches))
    assert max(counts.values(), default=1) == 1, f"repeated: {sorted(i for i, c in counts.items() if c > 1)}"
    assert set(counts) == set(range(n)), f"skipped: {sorted(set(range(n)) - set(counts))}"


@pytest.mark.slow  # starts worker processes
def test_a_new_iter_after_a_persistent_worker_died_starts_new_workers_and_continues_exactly():
    """torch resets persistent workers at a new iter(); a killed one never acknowledges, so every later iter()
    raised 'exited unexpectedly' (or waited out `timeout`): the loader could never deliver again."""
    n = 60
    dl = ResumableDataLoader(IndexDataset(n), batch_size=3, shuffle=True, seed=2, num_workers=2,
                             multiprocessing_context="fork", persistent_workers=True)
    it = iter(dl)
    delivered = [next(it).tolist() for _ in range(4)]
    worker = it._workers[0]
    try:
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
    except RuntimeError:  # torch's SIGCHLD handler may report the death here already
        pass
    assert not worker.is_alive()
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
