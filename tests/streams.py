"""Streams for the tests: every record names itself, so a run shows exactly which records were delivered.

Each worker reads every N-th record (N workers; all of them in the main process). A `random` stream adds a draw of
each generator a dataset may use (torch, numpy, random) to every record: a resume that does not give a worker back
its exact random state changes them.
"""

import random

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

FORK = dict(multiprocessing_context="fork")


def share() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


def record(i: int, random_draws: bool):
    if not random_draws:
        return i
    return i, torch.randint(1000, ()).item(), int(np.random.randint(1000)), random.randrange(1000)


def record_id(r) -> int:
    """A record's id: the record, or its first field (recursively: DatasetState pairs records with its epoch)."""
    while not isinstance(r, int):
        r = r[0]
    return r


def ids(batches) -> list:
    """The record ids in delivered batches, in order."""
    return [record_id(r) for batch in batches for r in batch]


class Plain(IterableDataset):
    """A generator without state: resuming it replays each worker's share up to where it was."""

    def __init__(self, n: int, random_draws: bool = False):
        self.n, self.random_draws = n, random_draws

    def __iter__(self):
        worker, workers = share()
        for i in range(worker, self.n, workers):
            yield record(i, self.random_draws)


class _Cursor:
    """An iterator with its own state (StatefulDataLoader's iterator protocol)."""

    def __init__(self, records, random_draws):
        self.records, self.random_draws, self.i = records, random_draws, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.records):
            raise StopIteration
        self.i += 1
        return record(self.records[self.i - 1], self.random_draws)

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        """As a careful stream does: a state it cannot resume from raises here, where the loader can ask."""
        if not (isinstance(state["i"], int) and 0 <= state["i"] <= len(self.records)):
            raise ValueError(f"no record {state['i']!r} in this worker's {len(self.records)}")
        self.i = state["i"]


class IteratorState(Plain):
    """Its __iter__ returns an iterator with state_dict / load_state_dict."""

    def __iter__(self):
        worker, workers = share()
        return _Cursor(list(range(worker, self.n, workers)), self.random_draws)


# What the k-th record of a worker draws (k modulo 8): nothing; one generator's words alone (torch, numpy, random); a
# gaussian of numpy, then its cached one alone, which leaves numpy's words as they were; the same with random's.
NOW_AND_THEN = (
    None,
    lambda: torch.rand(()).item(),
    lambda: float(np.random.rand()),
    random.random,
    np.random.randn,
    np.random.randn,
    lambda: random.gauss(0, 1),
    lambda: random.gauss(0, 1),
)


class NowAndThen(Plain):
    """An iterator with state whose records draw random numbers now and then, one generator at a time
    (`NOW_AND_THEN`): at batch_size=1, each batch changes one part of its worker's random state, or none."""

    def __iter__(self):
        worker, workers = share()
        return _NowAndThenCursor(list(range(worker, self.n, workers)), random_draws=False)


class _NowAndThenCursor(_Cursor):
    def __next__(self):
        draw = NOW_AND_THEN[self.i % len(NOW_AND_THEN)]
        i = super().__next__()
        return i, None if draw is None else float(draw())


class DatasetState(Plain):
    """state_dict / load_state_dict on the dataset, a generator __iter__ that resumes from what was loaded, and an
    epoch counter it keeps itself (advanced when its pass ends)."""

    def __init__(self, n: int, random_draws: bool = False):
        super().__init__(n, random_draws)
        self.position, self.resume, self.epoch = 0, None, 0

    def __iter__(self):
        worker, workers = share()
        self.position, self.resume = self.resume or 0, None
        mine = list(range(worker, self.n, workers))
        while self.position < len(mine):
            self.position += 1
            yield record(mine[self.position - 1], self.random_draws), self.epoch
        self.position, self.epoch = 0, self.epoch + 1

    def state_dict(self):
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.resume, self.epoch = state["position"], state["epoch"]


class Continuing(Plain):
    """A dataset object that keeps its place (a file it holds open): its __iter__ goes on where the object stands,
    and starts over once its records ended. Only loading a state moves it back."""

    def __init__(self, n: int, random_draws: bool = False):
        super().__init__(n, random_draws)
        self.position = 0

    def __iter__(self):
        worker, workers = share()
        mine = list(range(worker, self.n, workers))
        while self.position < len(mine):
            self.position += 1
            yield record(mine[self.position - 1], self.random_draws)
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class SelfIterating(Plain):
    """Its own iterator, resetting itself in __iter__: its state must be loaded after __iter__ runs."""

    def __iter__(self):
        worker, workers = share()
        self.cursor = _Cursor(list(range(worker, self.n, workers)), self.random_draws)
        return self

    def __next__(self):
        return next(self.cursor)

    def state_dict(self):
        return self.cursor.state_dict()

    def load_state_dict(self, state):
        self.cursor.load_state_dict(state)


class Failing(Plain):
    """Raises instead of yielding the given records (the stream goes on after them)."""

    def __init__(self, n: int, bad: set):
        super().__init__(n)
        self.bad = bad

    def __iter__(self):
        worker, workers = share()
        return _FailingCursor(list(range(worker, self.n, workers)), self.bad)


class _FailingCursor(_Cursor):
    def __init__(self, records, bad):
        super().__init__(records, random_draws=False)
        self.bad = bad

    def __next__(self):
        value = super().__next__()
        if value in self.bad:
            raise ValueError(f"corrupt record {value}")
        return value
