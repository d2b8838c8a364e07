"""Prefetch by the plan: a rank's upcoming batches name exactly the shards it reads next.

The loader's order is a pure function of (seed, epoch, position), so the batches it will dispatch are known
before they are. ``Prefetcher.follow`` passes them through unchanged while reading ahead in them, and a thread
keeps the copies of the shards they need in the node's cache, soonest first (``depth`` downloads at once): those
of the batches in flight (dispatched to workers, not yet delivered), then ``depth`` more. The plan it publishes tells
the cache which shards this rank needs and in what order; a shard no plan names (read already this epoch) is evicted
first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["Prefetcher"]

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_AHEAD = 1 << 16  # batches read ahead at most, whatever the shards (batch_size=None over huge shards)
NO_ROOM_RETRY_S = 0.5  # a prefetch that found no room looks again after this, or when the plan moves


class _Plan:
    """The shards to have, soonest first, as the loader moves; the prefetch thread waits on its changes."""

    def __init__(self) -> None:
        self.shards: tuple[int, ...] = ()
        self.version = 0
        self.stopped = False
        self.changed = threading.Condition()

    def set(self, shards: tuple[int, ...]) -> None:
        with self.changed:
            self.shards, self.version = shards, self.version + 1
            self.changed.notify()

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify()

    def wait(self, seen: int, timeout: float | None) -> tuple[tuple[int, ...], int, bool]:
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen or self.stopped, timeout)
            return self.shards, self.version, self.stopped


class _Counts(OrderedDict):
    """Batches per shard in a window, shards in first-use order; says when a shard enters or leaves."""

    def add(self, shards: list[int]) -> bool:
        new = False
        for s in shards:
            new |= s not in self
            self[s] = self.get(s, 0) + 1
        return new

    def remove(self, shards: list[int]) -> bool:
        gone = False
        for s in shards:
            self[s] -= 1
            if not self[s]:
                del self[s]
                gone = True
        return gone


class Prefetcher:
    """Keeps the shards a rank needs next in the cache, following its batches (see the module docstring).

    ``shards_of(batch)``: the shards a batch reads, in order; ``fetch(shard, rank)``: have a copy of the shard in
    the cache, ``rank`` its place in the plan (False: no room without evicting a shard needed sooner);
    ``publish(shards)``: tell the cache this process's plan.
    """

    def __init__(
        self,
        shards_of: Callable[[object], list[int]],
        fetch: Callable[[int, int], bool],
        publish: Callable[[list[int]], None],
        depth: int,
    ) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.shards_of, self.fetch, self.publish, self.depth = shards_of, fetch, publish, depth

    def follow(self, batches: Iterable[T], in_flight: int) -> Iterator[T]:
        """``batches`` unchanged, with the shards of the ``in_flight`` last ones and of the next ``depth`` shards'
        worth kept in the cache by a thread that lives as long as this iteration.

        Nothing is read ahead until the loader delivered a batch (it asks for one past those in flight): a download
        past the batches in flight would share the store's bandwidth and the node's CPUs with the one the first
        batch waits on, a restart's cold cache (section 14 of the benchmarks), and gains nothing before anyone
        consumes a batch."""
        plan = _Plan()
        threading.Thread(target=self._run, args=(plan,), name="loader-prefetch", daemon=True).start()
        dispatched: deque[list[int]] = deque()
        ahead: deque[tuple[T, list[int]]] = deque()
        current, upcoming = _Counts(), _Counts()
        source, exhausted = iter(batches), False
        reading_ahead = False  # past the batches in flight: only once one was delivered (see the docstring)
        try:
            while True:
                changed = False
                while not exhausted and len(upcoming) <= self.depth and len(ahead) < MAX_AHEAD:
                    try:
                        batch = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    shards = self.shards_of(batch)
                    ahead.append((batch, shards))
                    changed |= upcoming.add(shards)
                if not ahead:
                    return
                batch, shards = ahead.popleft()
                changed |= upcoming.remove(shards) | current.add(shards)
                dispatched.append(shards)
                if len(dispatched) > in_flight:  # the loader asks past those in flight once it delivered one
                    changed |= current.remove(dispatched.popleft()) | (not reading_ahead)
                    reading_ahead = True
                if changed:
                    later = tuple(s for s in upcoming if s not in current) if reading_ahead else ()
                    plan.set(tuple(current) + later)
                yield batch
        finally:
            plan.stop()

    def _run(self, plan: _Plan) -> None:
        """Fetch the plan's shards, ``depth`` at once in plan order (a store serves parallel streams faster than
        one, as webdataset's workers each stream a shard); start over when it changes; after a full cache, look
        again later."""
        seen, failed = -1, set()
        shards, version, stopped = plan.wait(seen, None)
        with ThreadPoolExecutor(max(1, self.depth), thread_name_prefix="loader-prefetch") as pool:
            while not stopped:
                if version != seen:
                    try:
                        self.publish(list(shards))
                    except Exception as exn:  # a cache too full for the plan: prefetch without telling it
                        log.warning("publishing the prefetch plan failed: %r", exn)
                    seen = version
                fetches = [
                    (s, pool.submit(self._fetch, plan, version, s, r)) for r, s in enumerate(shards) if s not in failed
                ]
                complete = True
                for shard, fetch in fetches:
                    try:
                        complete &= fetch.result()
                    except Exception as exn:  # the reader meets it again and raises it with its context
                        failed.add(shard)
                        log.warning("prefetching shard %d failed: %r", shard, exn)
                shards, version, stopped = plan.wait(seen, None if complete else NO_ROOM_RETRY_S)

    def _fetch(self, plan: _Plan, version: int, shard: int, rank: int) -> bool:
        """One shard of the plan, unless the plan moved on meanwhile (the next round looks again)."""
        return plan.version != version or plan.stopped or self.fetch(shard, rank)
