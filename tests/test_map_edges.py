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
