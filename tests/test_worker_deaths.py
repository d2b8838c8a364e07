"""Worker processes SIGKILLed at random moments, map-style and streams, persistent workers or not.

torch reports such a death in several ways, by timing: "exited unexpectedly", a connection reset or closed while a
batch was on its way, or its SIGCHLD handler's error wherever the main thread happened to be. Each run kills one
worker at a seeded (batch, delay) and goes on as a loop that skips errors does; every index of the epoch must be
delivered exactly once, and a state saved after the death must resume to exactly the rest.
"""

import os
import signal
import threading
import time
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loader import ContinuedPassWarning, ResumableDataLoader
from tests.conftest import IndexDataset
from tests.streams import FORK, Plain

RUNS = 12  # per kind of loader below: 48 kills in all


class Slow(IndexDataset):
    """1 ms a sample, so that a pass lasts longer than the kill's delay."""

    def __getitem__(self, index):
        time.sleep(0.001)
        return int(index)


class SlowStream(Plain):
    def __iter__(self):
        for record in super().__iter__():
            time.sleep(0.001)
            yield record


def killer(dl, rng, killed):
    """A timer that SIGKILLs one of the loader's live workers (by pid) after a random delay (counted in `killed`)."""
    delay, which = rng.uniform(0, 0.008), int(rng.integers(2))

    def kill():
        iterator = dl._iterator if dl._iterator is not None else current[0]
        workers = getattr(getattr(iterator, "_inner", iterator), "_workers", [])
        if workers and workers[which].exitcode is None:  # not reaped: the pid is still this worker's
            os.kill(workers[which].pid, signal.SIGKILL)
            killed.append(delay)

    current = [None]
    return threading.Timer(delay, kill), current


def new_iter(dl, current):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContinuedPassWarning)
        for _ in range(3):  # a worker that dies as torch makes its iterator: that iter() raises it
            try:
                current[0] = iter(dl)
                return current[0]
            except RuntimeError as err:
                assert "DataLoader worker" in str(err)
    raise AssertionError("iter() kept failing")


def run_with_a_kill(make, persistent, rng, killed):
    """One epoch of 12 batches with a worker killed at a random moment, skipping errors as a training loop would:
    what was delivered, what a resume from a state saved at a random point after the kill delivers with the
    records delivered up to it, and the errors."""
    dl = make(persistent)
    kill_at = int(rng.integers(12))
    save_at = kill_at + int(rng.integers(13 - kill_at))
    timer, current = killer(dl, rng, killed)
    delivered, errors, state, upto = [], [], None, 0
    it = new_iter(dl, current)
    while len(errors) < 6:
        if len(delivered) // 2 == kill_at and not timer.is_alive() and not timer.finished.is_set():
            timer.start()
        if state is None and len(delivered) // 2 >= save_at:
            state, upto = dl.state_dict(), len(delivered)
        try:
            batch = next(it)
        except StopIteration:
            break
        except (RuntimeError, ConnectionError, EOFError) as err:  # the death, then the loader's word to re-iter
            errors.append(err)
            if "new iter()" in str(err):
                it = new_iter(dl, current)
            continue
        if dl._stream is None:
            assert batch == dl.last_indices().tolist(), "the batch out is not the one counted"
        delivered += batch
    timer.join(5)
    if state is None:
        state, upto = dl.state_dict(), len(delivered)
    if dl._iterator is not None:
        dl._iterator._shutdown_workers()
    resumed = make(False)  # in new workers
    resumed.load_state_dict(state)
    return delivered, delivered[:upto] + [r for batch in resumed for r in batch], errors


def map_loader(persistent):
    return ResumableDataLoader(
        Slow(24),
        batch_size=2,
        shuffle=True,
        seed=0,
        collate_fn=list,
        num_workers=2,
        persistent_workers=persistent,
        **FORK,
    )


def stream_loader(persistent):
    return ResumableDataLoader(
        SlowStream(24), batch_size=2, collate_fn=list, num_workers=2, persistent_workers=persistent, **FORK
    )


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("make", [map_loader, stream_loader], ids=["map", "stream"])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_killed_at_a_random_moment_loses_and_repeats_nothing(make, persistent):
    """A death torch reported otherwise than "exited unexpectedly" went on as a failed batch (the iterator not
    stopped) or was raised by the SIGCHLD handler in the loader's own counting or the loop's code; persistent
    workers reset with a dying one made the next iter() raise."""
    rng = np.random.default_rng(29)
    kinds, killed = Counter(), []
    for run in range(RUNS):
        delivered, resumed, errors = run_with_a_kill(make, persistent, rng, killed)
        for name, records in (("delivered", delivered), ("resumed", resumed)):
            assert Counter(records) == Counter(range(24)), f"run {run}: {name} {sorted(records)}"
        kinds.update(type(err).__name__ for err in errors)
    print(f"{len(killed)} of {RUNS} kills landed; torch reported them as {dict(kinds)}")
    assert len(killed) >= RUNS // 3  # the kills did land while the loader read


@pytest.mark.slow  # starts worker processes
def test_a_death_seen_nowhere_but_in_the_loaders_next_leaves_nothing_that_fires_later():
    """torch watched a loader's worker pids for their whole life: a worker that died while the main thread did
    something else (here: waited for that very death, unreaped) raised torch's SIGCHLD error there, in code that
    has nothing to do with the loader, and an iterator kept after a death raised it later again (in another loader's
    sampler, at interpreter exit)."""
    dl = ResumableDataLoader(
        IndexDataset(24),
        batch_size=2,
        shuffle=True,
        seed=1,
        collate_fn=list,
        num_workers=2,
        persistent_workers=True,
        **FORK,
    )
    it = iter(dl)
    delivered = next(it) + next(it)
    pid = it._workers[0].pid
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # the death has come, and the main thread is elsewhere
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {pid}\) exited unexpectedly"):
        for batch in it:  # what was fetched before the death, up to the dead worker's batch
            delivered += batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContinuedPassWarning)
        delivered += [i for batch in dl for i in batch]
    assert Counter(delivered) == Counter(range(24))
    other = DataLoader(IndexDataset(10), batch_size=2, num_workers=2, **FORK)
    assert [i for batch in other for i in batch.tolist()] == list(range(10))
    torch._C._error_if_any_worker_fails()  # nothing of the killed worker is watched any more
    dl._iterator._shutdown_workers()
