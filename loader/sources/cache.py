"""A bounded cache of whole files on node-local disk, shared by every process of a node (workers and ranks).

Everything under the directory counts against the limit: complete copies, indexes, downloads in progress (at
their full size from the moment they start: room is made before a byte is written, never after), plans and the
counters. Every change happens under one ``flock`` on ``.lock``, so any process that sees the directory agrees on
what is there. A download writes ``partial/<name>.<bytes>.part`` while holding an exclusive ``flock`` on it: the
lock says its writer is alive (another process wanting the same file waits for it instead of downloading it
twice), and a partial file nobody holds is a crashed download, removed. Complete files appear by rename only.

Readers pin a copy with a shared ``flock`` taken under the cache lock; eviction skips pinned copies, so the space
of a file still being read is never "freed" while its blocks stay on disk. A reader short of room drops its own
pins (``release``) once nothing has moved for ``RELEASE_AFTER_S``, and a wait nothing can end (what stays is neither
pinned nor downloading) fails at once. What to evict comes from the plans:
each process that knows its upcoming files publishes them in order (``plans/``, held by a shared ``flock`` while
its writer lives). Files no live plan names go first (copies before indexes, oldest first), then those needed
latest. A prefetch never evicts a file needed sooner than the one it fetches.

Every copy has a checksum (CRC-32 of its bytes, taken from the finished download before its rename) in
``sums/<name>``, counted and evicted with it. A process opening a copy it did not download checks it once
(``verify``: one read of the copy, about 0.5 s of CPU per GB), so a copy whose bytes rot on disk is discarded and
downloaded again, never served; checking on every sample would cost that per sample. A copy without a checksum
(made by an older version) is downloaded again. A copy is *fresh* (``Fetched.fresh``) when its checksum was
recorded since the cache was opened (in this process, or in the one that started its workers): a process of the
node downloaded it during this run, checking the server's version before and after, so its readers need not ask
the server again (``RemoteShards.open_copy``).

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
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

__all__ = ["CacheFullError", "DiskFullError", "ShardCache", "disk_full", "parse_bytes"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_POLL_S = (0.005, 0.2)  # first and longest pause between looks while waiting for another process
_DOWNLOAD_POLL_S = 0.02  # the longest while another process downloads the file: its readers start this soon after
RELEASE_AFTER_S = 0.5  # a reader short of room drops its own pins after this long without progress: sooner, the
# copies it still reads would be evicted (and downloaded again) for room a prefetch about to start would have made
COPY, INDEX, PARTIAL, SUM, OTHER = "copy", "index", "partial", "sum", "other"
_KINDS = {"shards": COPY, "index": INDEX, "partial": PARTIAL, "sums": SUM}
_CHUNK = 1 << 20  # bytes read at a time to checksum a copy


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


class DiskFullError(OSError):
    """The disk under the cache ran out of space (or quota) below ``cache_limit``: not a network fault, not retried."""


def disk_full(exn: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT where a local write failed for want of space or quota, anywhere in the exception chain."""
    seen = set()
    while exn is not None and id(exn) not in seen:
        seen.add(id(exn))
        if isinstance(exn, OSError) and exn.errno in (errno.ENOSPC, errno.EDQUOT):
            return exn.errno
        exn = exn.__cause__ or exn.__context__
    return None


def _identity(st: os.stat_result) -> tuple:
    """A file as this process saw it: another file, or this one rewritten, has another."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def checksum(fd: int) -> str:
    """CRC-32 of the file open at ``fd``, with its size: catches bytes that rot on disk, at about 2 GB/s."""
    crc, offset, buf = 0, 0, bytearray(_CHUNK)
    view = memoryview(buf)
    while n := os.preadv(fd, [buf], offset):
        crc = zlib.crc32(view[:n], crc)
        offset += n
    return f"crc32 {crc:08x} {offset}"


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
    nbytes: int  # the space it takes (a download in progress: reserved for it whole; a copy: with its checksum)
    ctime_ns: int
    size: int  # bytes written
    sum_path: str | None = None  # a copy's checksum, evicted with it


class _Room(NamedTuple):
    fits: bool
    kept: int  # bytes that could not be evicted
    busy: int  # of which copies pinned and downloads in progress: what may still go away
    written: int  # bytes the downloads in progress wrote so far: a wait for room lasts while they grow


class Fetched(NamedTuple):
    """A complete copy: its path, a descriptor pinning it (None unless asked for) and whether it is fresh: made
    since the cache was opened (by this call or another process of the node), so checked when it was made."""

    path: str
    fd: int | None
    fresh: bool


class ShardCache:
    """Whole files under ``directory``, never more than ``limit`` bytes in all (see the module docstring).

    Picklable (directory and limit only), so DataLoader workers share it through the file system.
    ``wait_s`` bounds how long a process waits for room or for another process's stalled download.
    """

    def __init__(self, directory: str | os.PathLike, limit: int | str, wait_s: float = 300.0) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.limit = parse_bytes(limit)
        self.wait_s = wait_s
        for sub in ("shards", "index", "partial", "plans", "sums"):
            os.makedirs(os.path.join(self.directory, sub), exist_ok=True)
        self._block = max(4096, os.statvfs(self.directory).f_frsize)  # the allocation unit a file takes
        self._plan_fd: int | None = None
        self._plan_pid = -1
        self._verified: dict[str, tuple] = {}  # copies this process downloaded or checked: name -> their stat
        self._verified_pid = os.getpid()
        self.opened_ns = time.time_ns()  # copies whose checksum is newer are fresh (see the module docstring)
        with self._locked():
            self.count()  # the counters' file exists before any download needs its room

    def __getstate__(self) -> dict:
        return {  # a spawned worker's cache is opened when its loader's was
            "directory": self.directory,
            "limit": self.limit,
            "wait_s": self.wait_s,
            "_block": self._block,
            "opened_ns": self.opened_ns,
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _plan_fd=None, _plan_pid=-1, _verified={}, _verified_pid=os.getpid())

    def footprint(self, nbytes: int) -> int:
        """Space a file of ``nbytes`` takes: whole allocation blocks."""
        return -(-nbytes // self._block) * self._block

    def copy_footprint(self, nbytes: int) -> int:
        """Space a copy of ``nbytes`` takes with its checksum (a download is reserved at this from its start)."""
        return self.footprint(nbytes) + self._block

    # -- paths and the lock ----------------------------------------------------------------------------------------

    def copy_path(self, name: str) -> str:
        return os.path.join(self.directory, "shards", name)

    def index_path(self, name: str) -> str:
        return os.path.join(self.directory, "index", name)

    def _partial_path(self, name: str, nbytes: int) -> str:
        return os.path.join(self.directory, "partial", f"{name}.{nbytes}.part")

    def _sum_path(self, name: str) -> str:
        return os.path.join(self.directory, "sums", name)

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
        """Every file under the directory with the space it takes (a download in progress: its full size and its
        checksum's; a copy: with its checksum). Under the lock; crashed downloads and checksums without a copy (a
        crash between the two) are removed on the way."""
        files, sums = [], {}
        for root, _, names in os.walk(self.directory):
            kind = _KINDS.get(os.path.basename(root), OTHER)
            for name in names:
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                nbytes = disk_bytes(st)
                if kind == PARTIAL:  # only downloads: an index's partial file lives only under the lock
                    if not self._held(path):
                        os.unlink(path)  # its writer died: nobody will finish it
                        continue
                    name, _, reserved = name[: -len(".part")].rpartition(".")
                    nbytes = max(nbytes, self.copy_footprint(int(reserved)))
                if kind == SUM:
                    sums[name] = (path, nbytes)
                else:
                    files.append(_File(path, name, kind, nbytes, st.st_ctime_ns, st.st_size))
        for i, f in enumerate(files):
            if f.kind == COPY and f.name in sums:
                path, nbytes = sums.pop(f.name)
                files[i] = f._replace(nbytes=f.nbytes + nbytes, sum_path=path)
        for path, _ in sums.values():
            os.unlink(path)
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

    def _make_room(self, nbytes: int, rank: int | None) -> _Room:
        """Evict until ``nbytes`` more fit; ``rank`` None: needed now (anything unpinned may go), else its place in
        a plan (only files needed later, or not at all, may go). Returns whether it fits, the bytes that could not
        be evicted (pinned, downloading, or needed sooner), and of those what may still go away. Under the lock;
        evicts nothing unless enough can go."""
        files = self._scan()
        used = sum(f.nbytes for f in files)
        downloading = [f for f in files if f.kind == PARTIAL]
        busy, written = sum(f.nbytes for f in downloading), sum(f.size for f in downloading)
        if used + nbytes <= self.limit:
            return _Room(True, used, busy, written)
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
                        busy += f.nbytes
                        continue
                chosen.append((f, fd))
                freed += f.nbytes
            fits = used - freed + nbytes <= self.limit
            if fits:
                for f, _ in chosen:
                    os.unlink(f.path)
                    if f.sum_path is not None:
                        os.unlink(f.sum_path)
        finally:
            for _, fd in chosen:
                if fd is not None:
                    _close_held(fd)
        if fits and chosen:
            self.count(evictions=len(chosen), evicted_bytes=freed)
        return _Room(fits, used - freed, busy, written)

    def _room_for(self, nbytes: int, what: str) -> None:
        """Make room for a small file the cache writes itself (index, plan, counters), or refuse. Under the lock."""
        room = self._make_room(nbytes, None)
        if not room.fits:
            raise CacheFullError(
                f"cache_limit {human(self.limit)} cannot hold {what} ({human(nbytes)}) next to {human(room.kept)} in "
                f"use in {self.directory}; raise cache_limit"
            )

    # -- files -----------------------------------------------------------------------------------------------------

    def _pin(self, path: str) -> int:
        """A descriptor holding a shared lock on ``path``: eviction leaves it until the descriptor is closed."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def fetch(
        self,
        name: str,
        nbytes: int,
        fill: Callable[[str], None],
        *,
        rank: int | None = None,
        pin: bool = False,
        release: Callable[[], None] | None = None,
    ) -> Fetched | None:
        """The complete copy ``name`` (``nbytes``), made by ``fill(partial_path)`` unless it is there already.

        ``rank`` None: needed now; waits (bounded) for room or for another process downloading the same file. Short
        of room for ``RELEASE_AFTER_S`` without progress, it calls ``release`` (it drops the caller's own pins: a
        reader waiting for room its own pins hold would wait for ever). Otherwise a prefetch at that place of the
        plan: returns None at once when it would have to wait.
        ``pin``: also return a descriptor that keeps the copy from eviction until it is closed.
        """
        path, partial, need = self.copy_path(name), self._partial_path(name, nbytes), self.copy_footprint(nbytes)
        deadline, pause, seen, still_since = time.monotonic() + self.wait_s, _POLL_S[0], None, time.monotonic()
        missed = False  # a reader that found no copy at its first look, and waited for another's download
        progress: object  # what waiting watches: a download's size, or (pins, bytes written) of the room
        stalled: Exception  # raised if it stops changing
        lock: int | None  # the download's lock, until it becomes a pin
        while True:
            with self._locked():
                if os.path.exists(path):
                    if rank is None:
                        self.count(**{"cache_misses" if missed else "cache_hits": 1})
                    return Fetched(path, self._pin(path) if pin else None, self._fresh(name))
                missed = True
                downloading = self._held(partial)
                if downloading:
                    progress = os.stat(partial).st_size  # another process is downloading it: wait while it grows
                    stalled = TimeoutError(
                        f"waited {self.wait_s:.0f} s for another process's download of {name} to progress"
                    )
                else:
                    room = self._make_room(need, rank)
                    if room.fits:
                        lock = _open_held(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
                        fcntl.flock(lock, fcntl.LOCK_EX)
                        break
                    if rank is not None:
                        return None
                    stalled = self._no_room(name, nbytes, room)
                    progress = (room.busy, room.written)  # pins released, downloads growing or done
                    if release is not None and progress == seen and time.monotonic() - still_since > RELEASE_AFTER_S:
                        release()
                        release = None
                        continue  # its own pins may have been in the way
            if progress != seen:
                deadline, seen, still_since = time.monotonic() + self.wait_s, progress, time.monotonic()
            elif time.monotonic() > deadline:
                raise stalled
            time.sleep(pause)
            pause = min(2 * pause, _DOWNLOAD_POLL_S if downloading else _POLL_S[1])
        try:
            try:
                fill(partial)
                recorded = self._checksum(partial)
            except Exception as exn:
                if (code := disk_full(exn)) is not None:
                    raise self._disk_full_error(code, name, nbytes, partial) from exn
                raise
            with self._locked():
                with open(self._sum_path(name), "w", encoding="ascii") as f:  # in the room reserved with the download
                    f.write(recorded)
                os.replace(partial, path)
                self.count(downloads=1, downloaded_bytes=nbytes, **({"cache_misses": 1} if rank is None else {}))
                self._verified_copies()[name] = _identity(os.stat(path))
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

    def _no_room(self, name: str, nbytes: int, room: _Room) -> CacheFullError:
        """Raise at once when nothing can end a reader's wait for room (what stays is neither pinned nor being
        downloaded); else the error for a wait of ``wait_s`` without progress. Both name the limit that holds it."""
        need, fixed = self.copy_footprint(nbytes), room.kept - room.busy
        if fixed + need > self.limit:
            raise CacheFullError(
                f"cache_limit {human(self.limit)} cannot hold {name} ({human(nbytes)}) next to the cache's own "
                f"files ({human(fixed)}) in {self.directory}: raise cache_limit to at least {human(fixed + need)}"
            )
        return CacheFullError(
            f"cache_limit {human(self.limit)} cannot hold {name} ({human(nbytes)}) next to what this node is "
            f"reading ({human(room.kept)} pinned or downloading) in {self.directory}, and no room was made for "
            f"{self.wait_s:.0f} s: raise cache_limit to at least {human(room.kept + need)}, or lower prefetch / "
            "num_workers"
        )

    def _checksum(self, path: str) -> str:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return checksum(fd)
        finally:
            os.close(fd)

    def _disk_full_error(self, code: int, name: str, nbytes: int, partial: str) -> DiskFullError:
        os.unlink(partial)  # what it wrote is not wanted: the space free is then what the next try would have
        st = os.statvfs(self.directory)
        return DiskFullError(
            code,
            f"the disk under the cache {self.directory} is full ({os.strerror(code)}) while downloading {name}: it "
            f"needs {human(nbytes)}, the disk has {human(st.f_bavail * st.f_frsize)} free. cache_limit "
            f"({human(self.limit)}) bounds only the cache's own files: free space on that disk, set cache_limit "
            "below what it has free, or point cache_dir at a disk with room",
        )

    def _verified_copies(self) -> dict[str, tuple]:
        """This process's copies downloaded or checked (a forked child checks again: ``verify`` is per process)."""
        if self._verified_pid != os.getpid():
            self._verified, self._verified_pid = {}, os.getpid()
        return self._verified

    def _fresh(self, name: str) -> bool:
        """Whether the copy's checksum was recorded since this cache was opened (see the module docstring): a
        clock's tick either way reads as not fresh, which only asks the server once more."""
        try:
            return os.stat(self._sum_path(name)).st_mtime_ns >= self.opened_ns
        except FileNotFoundError:
            return False

    def verify(self, name: str, fd: int) -> bool:
        """Whether the copy open at ``fd`` still has the checksum taken when it was downloaded. Read once per
        process and copy: a copy this process downloaded, or checked before unchanged, is not read again."""
        st = os.fstat(fd)
        if self._verified_copies().get(name) == _identity(st):
            return True
        try:
            with open(self._sum_path(name), encoding="ascii") as f:
                recorded = f.read()
        except FileNotFoundError:
            return False  # its checksum is lost: it cannot be told from a damaged copy
        if checksum(fd) != recorded:
            return False
        self._verified_copies()[name] = _identity(st)
        return True

    def discard(self, name: str) -> None:
        """Remove the copy ``name`` (corrupt or truncated): the next fetch downloads it again. Counted as
        ``damaged_copies``."""
        with self._locked():
            for path in (self.copy_path(name), self._sum_path(name)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            self.count(damaged_copies=1)

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
        """The node's counters: ``downloads``, ``downloaded_bytes`` (whole copies), ``damaged_copies`` (found
        damaged, rotten or truncated, and discarded), ``indexes_built`` and ``index_bytes`` (ranged reads to index),
        ``cache_hits`` and ``cache_misses`` (a reader found its copy there, or waited for its download),
        ``evictions`` and ``evicted_bytes`` (copies and indexes removed for room), across every process using the
        directory since it was made. A counter that never moved is absent."""
        with self._locked():
            return self._read_stats()
