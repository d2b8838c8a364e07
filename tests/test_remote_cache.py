"""The node cache of remote shards: the limit holds at every write, one download per file at a time across
processes, eviction by the plan, pins, crashed downloads."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import pickle
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from loader.sources import cache as cache_module
from loader.sources.cache import CacheFullError, ShardCache, disk_bytes, parse_bytes

CHUNK = 4096


def du(directory) -> int:
    """Space everything under a cache's directory takes, measured under its lock: a file being renamed from
    partial/ to shards/ would otherwise be counted twice (or not at all) by a walk that meets it in both."""
    with ShardCache(directory, 1)._locked():
        total = 0
        for root, _, names in os.walk(directory):
            for name in names:
                try:
                    total += disk_bytes(os.stat(os.path.join(root, name)))
                except FileNotFoundError:
                    pass
        return total


def content(name: str, nbytes: int) -> bytes:
    return (name.encode() * (nbytes // len(name) + 1))[:nbytes]


def writer(name: str, nbytes: int, measured: list[int] | None = None, calls: str | None = None):
    """A fill that writes ``name``'s bytes a chunk at a time, measuring the whole cache after every chunk."""

    def fill(dest: str) -> None:
        if calls is not None:
            with open(calls, "a") as log:
                log.write(name + "\n")
        data = content(name, nbytes)
        with open(dest, "wb") as f:
            for start in range(0, nbytes, CHUNK):
                f.write(data[start : start + CHUNK])
                f.flush()
                if measured is not None:
                    measured.append(du(os.path.dirname(os.path.dirname(dest))))  # the cache holding ``dest``

    return fill


@pytest.mark.parametrize(
    "text, expected",
    [
        (123, 123),
        ("50GB", 50 * 10**9),
        ("50GiB", 50 * 2**30),
        ("1.5 MB", 1_500_000),
        ("7", 7),
        ("2kib", 2048),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["50XB", "-5GB", 0, "GB", True, 1.5])
def test_parse_bytes_refuses(bad):
    with pytest.raises(ValueError, match="cache_limit"):
        parse_bytes(bad)


def test_room_is_made_before_writing_so_the_limit_holds_at_every_chunk(tmp_path):
    limit = 100_000
    cache = ShardCache(tmp_path / "cache", limit)
    measured: list[int] = []
    names = [f"shard-{i}" for i in range(12)]

    def read(worker: int) -> None:
        for name in names[worker::3]:
            got = cache.fetch(name, 30_000, writer(name, 30_000, measured), pin=True)
            with open(got.path, "rb") as f:
                assert f.read() == content(name, 30_000)
            os.close(got.fd)

    with ThreadPoolExecutor(3) as pool:  # three downloads at once: 90 KB
        for done in [pool.submit(read, w) for w in range(3)]:
            done.result(timeout=60)
    assert len(measured) == 12 * -(-30_000 // CHUNK)  # every chunk of every file was measured
    assert max(measured) <= limit
    assert max(measured) > limit - 2 * 30_000  # the bound was approached: evictions happened
    stats = cache.stats()
    assert stats.pop("evictions") > 0 and stats.pop("evicted_bytes") > 0
    assert stats == {"downloads": 12, "downloaded_bytes": 12 * 30_000, "cache_misses": 12}


def _fetch_in_process(directory, name, nbytes, calls, barrier):
    cache = ShardCache(directory, 10**6)
    barrier.wait(timeout=30)
    got = cache.fetch(name, nbytes, writer(name, nbytes, calls=calls))
    with open(got.path, "rb") as f:
        assert f.read() == content(name, nbytes)


def test_processes_wanting_one_file_download_it_once(tmp_path):
    calls = str(tmp_path / "calls.txt")
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(4)
    procs = [
        ctx.Process(target=_fetch_in_process, args=(str(tmp_path / "c"), "same", 200_000, calls, barrier))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with open(calls) as f:
        assert f.read().split() == ["same"]  # one fill; the other three waited for it and used the copy


def test_a_crashed_download_is_removed_and_not_served(tmp_path):
    cache = ShardCache(tmp_path / "c", 50_000)
    orphan = os.path.join(cache.directory, "partial", "a.40000.part")  # nobody holds its lock: its writer died
    with open(orphan, "wb") as f:
        f.write(b"torn")
    got = cache.fetch("a", 40_000, writer("a", 40_000))
    with open(got.path, "rb") as f:
        assert f.read() == content("a", 40_000)
    assert not os.path.exists(orphan)


def test_a_failed_fill_leaves_nothing(tmp_path):
    cache = ShardCache(tmp_path / "c", 50_000)

    def failing(dest):
        with open(dest, "wb") as f:
            f.write(b"half")
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        cache.fetch("a", 40_000, failing)
    assert not os.path.exists(cache.copy_path("a")) and os.listdir(os.path.join(cache.directory, "partial")) == []


def test_eviction_follows_the_plan_and_spares_pins(tmp_path):
    cache = ShardCache(tmp_path / "c", 74_000)  # 4 copies of 3 blocks and a checksum, the plan and the counters
    for name in ("done", "soon", "later"):
        cache.fetch(name, 10_000, writer(name, 10_000))
    cache.publish_plan(["soon", "new", "later"])
    assert cache.fetch("new", 10_000, writer("new", 10_000), rank=1) is not None  # room was there
    # full now: a prefetch at place 1 may evict what is unplanned ("done"), never "soon" (place 0)
    cache.publish_plan(["soon", "next", "new", "later"])
    assert cache.fetch("next", 10_000, writer("next", 10_000), rank=1) is not None
    assert not os.path.exists(cache.copy_path("done")) and os.path.exists(cache.copy_path("soon"))
    # again full: for place 3, only "later" (place 4 now) may go
    cache.publish_plan(["soon", "next", "new", "last", "later"])
    assert cache.fetch("last", 10_000, writer("last", 10_000), rank=3) is not None
    assert not os.path.exists(cache.copy_path("later"))
    # nothing is needed later than place 4: a prefetch there gets no room and returns at once
    cache.publish_plan(["soon", "next", "new", "last", "first"])
    assert cache.fetch("first", 10_000, writer("first", 10_000), rank=4) is None
    # a reader needing a file now evicts the one needed latest, unless it is pinned by another reader
    pin = cache.fetch("last", 10_000, writer("last", 10_000), pin=True).fd
    assert cache.fetch("now", 10_000, writer("now", 10_000)) is not None
    assert os.path.exists(cache.copy_path("last")) and not os.path.exists(cache.copy_path("new"))
    os.close(pin)
    assert du(cache.directory) <= cache.limit


def test_a_cache_full_of_pinned_files_names_the_minimum(tmp_path):
    cache = ShardCache(tmp_path / "c", 40_000, wait_s=0.2)
    pins = [cache.fetch(n, 10_000, writer(n, 10_000), pin=True).fd for n in ("a", "b")]
    with pytest.raises(CacheFullError, match=r"at least 53.25 KB"):  # 3 copies of 3+1 blocks and the counters
        cache.fetch("c", 10_000, writer("c", 10_000))
    for fd in pins:
        os.close(fd)
    assert cache.fetch("c", 10_000, writer("c", 10_000)).fresh


def test_plans_of_dead_processes_are_dropped(tmp_path):
    directory = str(tmp_path / "c")
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=lambda: ShardCache(directory, 30_000).publish_plan(["a", "b"]))
    proc.start()
    proc.join(timeout=30)
    cache = ShardCache(directory, 40_000)
    for name in ("a", "b"):
        cache.fetch(name, 10_000, writer(name, 10_000))
    assert cache.fetch("c", 10_000, writer("c", 10_000), rank=1) is not None  # a live plan would keep both
    assert os.listdir(os.path.join(directory, "plans")) == []


def test_a_lock_is_released_even_where_a_forked_child_holds_a_copy_of_its_descriptor(tmp_path):
    """A child forked by another thread just when the descriptor is not listed as held (a DataLoader worker
    started while the prefetch thread closes the cache lock) keeps a copy; releasing must not wait for its exit."""
    path = str(tmp_path / "lock")
    fd = cache_module._open_held(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    cache_module._HELD.discard(fd)  # the window: listed no longer, not yet closed
    child = os.fork()
    if child == 0:  # a long-lived worker that never touches the lock
        time.sleep(30)
        os._exit(0)
    try:
        cache_module._close_held(fd)
        other = os.open(path, os.O_RDWR)
        try:
            assert cache_module._try_lock(other, fcntl.LOCK_EX)  # free although the child lives
        finally:
            os.close(other)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_reader_releases_its_own_pins_before_waiting_for_room(tmp_path):
    """Two copies pinned by the reader itself and room for one more only without them: it drops its pins and goes
    on at once, where it waited for room its own pins held (``wait_s``, 300 s by default), then failed."""
    cache = ShardCache(tmp_path / "c", 45_000, wait_s=2)  # 2.5 copies of 3 blocks and a checksum, the counters
    held = [cache.fetch(n, 10_000, writer(n, 10_000), pin=True).fd for n in ("a", "b")]
    released = []

    def release() -> None:
        while held:
            os.close(held.pop())
        released.append(True)

    got = cache.fetch("c", 10_000, writer("c", 10_000), pin=True, release=release)
    assert released == [True] and got.fresh
    with open(got.path, "rb") as f:
        assert f.read() == content("c", 10_000)
    os.close(got.fd)
    assert du(cache.directory) <= cache.limit


def test_a_wait_for_room_that_nothing_can_end_fails_at_once_naming_the_minimum(tmp_path):
    """Nothing pinned, nothing downloading: no wait can make room for a copy larger than the limit allows next to
    the cache's own files, so the reader is told at once (not after ``wait_s``) what limit would hold it."""
    cache = ShardCache(tmp_path / "c", 20_000, wait_s=5)
    with pytest.raises(CacheFullError, match=r"next to the cache's own files .* at least 28.67 KB"):
        cache.fetch("big", 17_000, writer("big", 17_000))  # 5 blocks, a checksum and the counters: 7 blocks


def test_a_copy_made_since_the_cache_was_opened_is_fresh_in_every_process_of_the_run(tmp_path):
    """Fresh: the process that made it checked the server's version then, so its readers need not ask again
    (RemoteShards.open_copy); a copy made before a cache was opened (a restart's) is not."""
    cache = ShardCache(tmp_path / "c", 100_000)
    cache.opened_ns -= 10**9  # opened a second ago: a file's time is a clock tick coarse
    worker = pickle.loads(pickle.dumps(cache))  # as a DataLoader worker gets it: opened with its loader's cache
    assert cache.fetch("a", 10_000, writer("a", 10_000)).fresh  # made here
    assert worker.fetch("a", 10_000, writer("a", 10_000)).fresh  # made by another process of the run
    restarted = ShardCache(tmp_path / "c", 100_000)
    assert not restarted.fetch("a", 10_000, writer("a", 10_000)).fresh
    assert cache.stats()["downloads"] == 1


def test_a_copy_whose_bytes_changed_on_disk_fails_its_check_in_another_process(tmp_path):
    cache = ShardCache(tmp_path / "c", 100_000)
    got = cache.fetch("a", 30_000, writer("a", 30_000), pin=True)
    assert cache.verify("a", got.fd)
    with open(got.path, "r+b") as f:  # one byte of the payload, in place: same size
        f.seek(20_000)
        f.write(bytes([content("a", 30_000)[20_000] ^ 0x10]))
    other = pickle.loads(pickle.dumps(cache))  # as a DataLoader worker gets it
    assert not other.verify("a", got.fd)
    os.close(got.fd)
    other.discard("a")
    again = other.fetch("a", 30_000, writer("a", 30_000), pin=True)
    assert again.fresh and other.verify("a", again.fd)
    os.close(again.fd)
    assert cache.stats() == {"downloads": 2, "downloaded_bytes": 60_000, "damaged_copies": 1, "cache_misses": 2}
