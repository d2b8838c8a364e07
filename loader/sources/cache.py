"""A bounded cache of whole files on node-local disk, shared by every process of a node (workers and ranks).

Everything under the directory counts against the limit: complete copies, indexes, downloads in progress (at
their full size from the moment they start: room is made before a byte is written, never after), plans and the
counters. Every change happens under one ``flock`` on ``.lock``, so any process that sees the directory agrees on
what is there. A download writes ``partial/<name>.<bytes>.part`` while holding an exclusive ``flock`` on it: the
lock says its writer is alive (another process wanting the same file waits for it instead of downloading it
twice), and a partial file nobody holds is a crashed download, removed. Complete files appear by rename only.

Readers pin a copy with a shared ``flock`` taken under the cache lock; eviction skips pinned copies, so the space
of a file still being read is never "freed" while its blocks stay on disk. What to evict comes from the plans:
each process that knows its upcoming files publishes them in order (``plans/``, held by a shared ``flock`` while
its writer lives). Files no live plan names go first (copies before indexes, oldest first), then those needed
latest. A prefetch never evicts a file needed sooner than the one it fetches.

Why not a library's cache: fsspec's ``filecache``/``simplecache``/``blockcache`` have no size limit (only an
expiry time), no lock between processes (two workers download one file twice, both writing the final name) and
write the final name directly (a crash leaves a partial file that is served later); ``simplecache`` never checks
the remote version. webdataset's ``FileCache`` and wids evict by recency after downloading (the limit is
exceeded first), count neither partial downloads nor other processes' files, and cannot know the next files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

__all__ = ["CacheFullError", "ShardCache", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_POLL_S = (0.005, 0.2)  # first and longest pause between looks while waiting for another process
COPY, INDEX, PARTIAL, OTHER = "copy", "index", "partial", "other"


_HELD: set[int] = set()  # descriptors whose flocks this process holds for a moment (the cache lock, a download, its
# plan): a child forked meanwhile (a DataLoader worker) would keep them locked forever through its copies, so it closes
# them (closing a copy never releases the parent's lock)


def _close_inherited() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)


def _open_held(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
    _HELD.add(fd)
    return fd


def _close_held(fd: int) -> None:
    """Release the descriptor's lock, then close it. Closing alone releases a flock only with the last descriptor of
    its open file: a child forked by another thread in between (before `_HELD` names the descriptor, or after it no
    longer does) would hold a copy, and the lock, for its whole life (a DataLoader worker, then waiting on it)."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    _HELD.discard(fd)
    os.close(fd)


class CacheFullError(RuntimeError):
    """The cache cannot make room: what it must hold at once (files being read, the one needed) exceeds its limit."""


def parse_bytes(limit: int | str) -> int:
    """Bytes from an int or a string such as ``"50GB"`` (50·10^9) or ``"50GiB"`` (50·2^30)."""
    if isinstance(limit, int) and not isinstance(limit, bool):
        value = limit
    elif isinstance(limit, str) and (match := _SIZE.fullmatch(limit)) and match.group(2).upper() in _UNITS:
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    else:
        raise ValueError(f"cache_limit must be an int of bytes or a string such as '50GB' or '50GiB', got {limit!r}")
    if value <= 0:
        raise ValueError(f"cache_limit must be positive, got {limit!r}")
    return value


def human(nbytes: int) -> str:
    """A byte count as people read it (GB = 10^9), with the exact count."""
    for unit in ("TB", "GB", "MB", "KB"):
        if nbytes >= _UNITS[unit]:
            return f"{nbytes / _UNITS[unit]:.2f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


def disk_bytes(st: os.stat_result) -> int:
    """Space a file takes: its size, or its allocated blocks when more (block rounding, preallocation)."""
    return max(st.st_size, st.st_blocks * 512)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as exn:
        if exn.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


class _File(NamedTuple):
    path: str
    name: str
    kind: str
    nbytes: int
    ctime_ns: int


class Fetched(NamedTuple):
    """A complete copy: its path, a descriptor pinning it (None unless asked for) and whether this call fetched it."""

    path: str
    fd: int | None
    fetched: bool


class ShardCache:
    """Whole files under ``directory``, never more than ``limit`` bytes in all (see the module docstring).

    Picklable (directory and limit only), so DataLoader workers share it through the file system.
    ``wait_s`` bounds how long a process waits for room or for another process's stalled download.
    """

    def __init__(self, directory: str | os.PathLike, limit: int | str, wait_s: float = 300.0) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.limit = parse_bytes(limit)
        self.wait_s = wait_s
        for sub in ("shards", "index", "partial", "plans"):
            os.makedirs(os.path.join(self.directory, sub), exist_ok=True)
        self._block = max(4096, os.statvfs(self.directory).f_frsize)  # the allocation unit a file takes
        self._plan_fd: int | None = None
        self._plan_pid = -1
        with self._locked():
            self.count()  # the counters' file exists before any download needs its room

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "limit": self.limit, "wait_s": self.wait_s, "_block": self._block}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _plan_fd=None, _plan_pid=-1)

    def footprint(self, nbytes: int) -> int:
        """Space a file of ``nbytes`` takes: whole allocation blocks (a partial download is reserved at this)."""
        return -(-nbytes // self._block) * self._block

    # -- paths and the lock ----------------------------------------------------------------------------------------

    def copy_path(self, name: str) -> str:
        return os.path.join(self.directory, "shards", name)

    def index_path(self, name: str) -> str:
        return os.path.join(self.directory, "index", name)

    def _partial_path(self, name: str, nbytes: int) -> str:
        return os.path.join(self.directory, "partial", f"{name}.{nbytes}.part")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = _open_held(os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close_held(fd)

    # -- what is there ---------------------------------------------------------------------------------------------

    def _scan(self) -> list[_File]:
        """Every file under the directory with the space it takes (a download in progress: its full size). Under
        the lock; crashed downloads and plans of dead processes are removed on the way."""
        files = []
        for root, _, names in os.walk(self.directory):
            kind = {"shards": COPY, "index": INDEX, "partial": PARTIAL}.get(os.path.basename(root), OTHER)
            for name in names:
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                nbytes = disk_bytes(st)
                if kind == PARTIAL:
                    if not self._held(path):
                        os.unlink(path)  # its writer died: nobody will finish it
                        continue
                    name, _, reserved = name[: -len(".part")].rpartition(".")
                    nbytes = max(nbytes, self.footprint(int(reserved)))
                files.append(_File(path, name, kind, nbytes, st.st_ctime_ns))
        return files

    @staticmethod
    def _held(path: str) -> bool:
        """Whether some process holds a lock on the file (a live download or plan)."""
        try:
            fd = _open_held(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return not _try_lock(fd, fcntl.LOCK_EX)
        finally:
            _close_held(fd)

    def usage(self) -> int:
        """Bytes everything under the directory takes now, downloads in progress at their full size."""
        with self._locked():
            return sum(f.nbytes for f in self._scan())

    def _plan_ranks(self) -> dict[str, int]:
        """Each planned file's earliest place in any live process's plan; dead processes' plans are removed."""
        ranks: dict[str, int] = {}
        plans = os.path.join(self.directory, "plans")
        for name in os.listdir(plans):
            path = os.path.join(plans, name)
            if not self._held(path):
                os.unlink(path)
                continue
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for rank, planned in enumerate(json.loads(text) if text else []):
                ranks[planned] = min(rank, ranks.get(planned, rank))
        return ranks

    def publish_plan(self, names: list[str]) -> None:
        """This process's upcoming files, soonest first: eviction keeps them, and the soonest longest."""
        data = json.dumps(names).encode()
        with self._locked():
            if self._plan_fd is None or self._plan_pid != os.getpid():
                self._room_for(self.footprint(len(data)), "a plan")
                path = os.path.join(self.directory, "plans", f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json")
                self._plan_fd = _open_held(path, os.O_RDWR | os.O_CREAT)
                self._plan_pid = os.getpid()
                fcntl.flock(self._plan_fd, fcntl.LOCK_SH)  # alive while this process holds it
            elif (grow := self.footprint(len(data)) - disk_bytes(os.fstat(self._plan_fd))) > 0:
                self._room_for(grow, "a plan")
            os.ftruncate(self._plan_fd, 0)
            os.pwrite(self._plan_fd, data, 0)

    # -- room ------------------------------------------------------------------------------------------------------

    def _make_room(self, nbytes: int, rank: int | None) -> tuple[bool, int]:
        """Evict until ``nbytes`` more fit; ``rank`` None: needed now (anything unpinned may go), else its place in
        a plan (only files needed later, or not at all, may go). Returns whether it fits, and the bytes that could
        not be evicted (pinned, or needed sooner). Under the lock; evicts nothing unless enough can go."""
        files = self._scan()
        used = sum(f.nbytes for f in files)
        if used + nbytes <= self.limit:
            return True, used
        ranks = self._plan_ranks()
        unplanned = math.inf  # later than any place in any plan

        def order(f: _File) -> tuple:
            return -ranks.get(f.name, unplanned), f.kind == INDEX, f.ctime_ns

        candidates = [f for f in files if f.kind in (COPY, INDEX)]
        if rank is not None:
            candidates = [f for f in candidates if ranks.get(f.name, unplanned) > rank]
        chosen: list[tuple[_File, int | None]] = []
        freed = 0
        try:
            for f in sorted(candidates, key=order):
                if used - freed + nbytes <= self.limit:
                    break
                fd = None
                if f.kind == COPY:  # a reader holds a shared lock on a copy it reads: leave that one
                    fd = _open_held(f.path, os.O_RDONLY)
                    if not _try_lock(fd, fcntl.LOCK_EX):
                        _close_held(fd)
                        continue
                chosen.append((f, fd))
                freed += f.nbytes
            fits = used - freed + nbytes <= self.limit
            if fits:
                for f, _ in chosen:
                    os.unlink(f.path)
            return fits, used - freed
        finally:
            for _, fd in chosen:
                if fd is not None:
                    _close_held(fd)

    def _room_for(self, nbytes: int, what: str) -> None:
        """Make room for a small file the cache writes itself (index, plan, counters), or refuse. Under the lock."""
        fits, kept = self._make_room(nbytes, None)
        if not fits:
            raise CacheFullError(
                f"cache_limit {human(self.limit)} cannot hold {what} ({human(nbytes)}) next to {human(kept)} in use "
                f"in {self.directory}; raise cache_limit"
            )

    # -- files -----------------------------------------------------------------------------------------------------

    def _pin(self, path: str) -> int:
        """A descriptor holding a shared lock on ``path``: eviction leaves it until the descriptor is closed."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def fetch(
        self, name: str, nbytes: int, fill: Callable[[str], None], *, rank: int | None = None, pin: bool = False
    ) -> Fetched | None:
        """The complete copy ``name`` (``nbytes``), made by ``fill(partial_path)`` unless it is there already.

        ``rank`` None: needed now; waits (bounded) for room or for another process downloading the same file.
        Otherwise a prefetch at that place of the plan: returns None at once when it would have to wait.
        ``pin``: also return a descriptor that keeps the copy from eviction until it is closed.
        """
        path, partial = self.copy_path(name), self._partial_path(name, nbytes)
        deadline, pause, seen = time.monotonic() + self.wait_s, _POLL_S[0], None
        while True:
            with self._locked():
                if os.path.exists(path):
                    return Fetched(path, self._pin(path) if pin else None, False)
                if self._held(partial):
                    waiting = os.stat(partial).st_size  # another process is downloading it: wait while it grows
                    if waiting != seen:
                        deadline, seen = time.monotonic() + self.wait_s, waiting
                else:
                    fits, kept = self._make_room(self.footprint(nbytes), rank)
                    if fits:
                        lock = _open_held(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
                        fcntl.flock(lock, fcntl.LOCK_EX)
                        break
                    if rank is None and time.monotonic() > deadline:
                        raise CacheFullError(
                            f"cache_limit {human(self.limit)} cannot hold {name} ({human(nbytes)}) next to what "
                            f"this node is reading ({human(kept)} pinned) in {self.directory}: raise cache_limit to "
                            f"at least {human(kept + self.footprint(nbytes))}, or lower prefetch / num_workers"
                        )
            if rank is not None:
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.wait_s:.0f} s for another process's download of {name} to progress")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
        try:
            fill(partial)
            with self._locked():
                os.replace(partial, path)
                self.count(downloads=1, downloaded_bytes=nbytes)
                if not pin:
                    return Fetched(path, None, True)
                fcntl.flock(lock, fcntl.LOCK_SH)  # the writer's lock becomes the reader's pin
                _HELD.discard(lock)  # a pin is closed by its reader, also in a forked child
                pinned, lock = lock, None
                return Fetched(path, pinned, True)
        finally:
            if lock is not None:
                if os.path.exists(partial):
                    os.unlink(partial)  # fill failed: drop what it wrote (only its writer holds this name)
                _close_held(lock)

    def discard(self, name: str) -> None:
        """Remove the copy ``name`` (corrupt or truncated): the next fetch downloads it again."""
        with self._locked():
            try:
                os.unlink(self.copy_path(name))
            except FileNotFoundError:
                pass

    def load_index(self, name: str) -> bytes | None:
        try:
            with open(self.index_path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def store_index(self, name: str, data: bytes) -> None:
        """Write an index file atomically, after making room for it."""
        with self._locked():
            self._room_for(self.footprint(len(data)), f"the index {name}")
            partial = self._partial_path(name, len(data))
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, self.index_path(name))

    # -- counters --------------------------------------------------------------------------------------------------

    def count(self, **amounts: int) -> None:
        """Add to the node's counters (bytes downloaded, downloads, bytes read to index). Under the lock."""
        path = os.path.join(self.directory, "stats.json")
        counters = self._read_stats()
        for key, amount in amounts.items():
            counters[key] = counters.get(key, 0) + amount
        data = json.dumps(counters).encode()
        if not os.path.exists(path) or self.footprint(len(data)) > disk_bytes(os.stat(path)):
            self._room_for(self.footprint(len(data)), "the counters")
        with open(path, "wb") as f:  # in place: no second file while it is rewritten
            f.write(data)

    def add_counts(self, **amounts: int) -> None:
        with self._locked():
            self.count(**amounts)

    def _read_stats(self) -> dict[str, int]:
        try:
            with open(os.path.join(self.directory, "stats.json"), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def stats(self) -> dict[str, int]:
        """The node's counters: ``downloads``, ``downloaded_bytes`` (whole copies), ``indexes_built`` and
        ``index_bytes`` (ranged reads to index), across every process using the directory."""
        with self._locked():
            return self._read_stats()
