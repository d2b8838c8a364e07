"""Prefetch by the plan (loader.sources.prefetch): what the prefetch thread is asked to fetch, and when."""

from __future__ import annotations

import threading

from loader.sources.prefetch import Prefetcher

WAIT_S = 30.0  # a bound for a hung prefetch thread, never for a slow one


class _Recorder:
    """The Prefetcher's callbacks: every plan published and every shard fetched, in order."""

    def __init__(self) -> None:
        self.plans: list[list[int]] = []
        self.fetched: list[int] = []
        self.changed = threading.Condition()

    def publish(self, shards: list[int]) -> None:
        with self.changed:
            self.plans.append(shards)
            self.changed.notify_all()

    def fetch(self, shard: int, rank: int) -> bool:
        with self.changed:
            self.fetched.append(shard)
            self.changed.notify_all()
        return True

    def settled(self, plan: list[int]) -> set[int]:
        """Wait until the thread published `plan` and fetched all of it; what it fetched so far."""
        with self.changed:
            done = lambda: self.plans and self.plans[-1] == plan and set(plan) <= set(self.fetched)  # noqa: E731
            assert self.changed.wait_for(done, WAIT_S), f"plan {plan} not fetched: {self.plans} / {self.fetched}"
            return set(self.fetched)


def test_nothing_is_read_ahead_until_a_batch_was_delivered():
    """A restart's first batch waits on its shard's download: until the loader asks for a batch past those in
    flight (it delivered one), the thread fetches only the shards of the batches in flight, then reads ahead."""
    recorder = _Recorder()
    prefetcher = Prefetcher(lambda batch: [batch], recorder.fetch, recorder.publish, depth=2)
    batches = prefetcher.follow(iter(range(10)), in_flight=2)  # batch k reads shard k
    assert next(batches) == 0
    assert recorder.settled([0]) == {0}
    assert next(batches) == 1
    assert recorder.settled([0, 1]) == {0, 1}  # both in flight; 2, 3, 4 not yet
    assert next(batches) == 2  # asked past the two in flight: one was delivered
    assert recorder.settled([1, 2, 3, 4]) == {0, 1, 2, 3, 4}  # depth=2 shards past those in flight
    assert list(batches) == list(range(3, 10))  # unchanged, in order, each once
