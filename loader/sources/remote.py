"""Shards in object storage or behind HTTP, read through fsspec: their version, their index, verified local copies.

A remote shard is pinned to the version it was indexed at: its size, its modification time and a version tag
the server gives (ETag, GCS generation; Last-Modified when there is nothing else). The index records them (in
the fields that hold a local shard's size, mtime and identity), and every use checks them again: building the
index (before and after its ranged reads), downloading a copy (before and after the transfer, then every tar
header of the copy against the index) and opening a copy made before the node's cache was opened (a HEAD
request; a copy made since was checked by the download that made it, moments before). A shard changed on the
server is refused with ``StaleIndexError`` naming its URL, also when an older copy is still in the cache: copies
are named by URL and version, so another version is never taken for this one.

The index comes from ranged reads of the tar headers through fsspec's ``readahead`` cache (a window of
``INDEX_READ_BYTES`` past each header: members larger than the window are skipped, smaller ones are read
through), or from ``<url>.idx.npz`` next to the shard when ``python -m loader index`` wrote one for this version.

fsspec (and s3fs for S3) are optional dependencies: ``pip install -e ".[remote]"``. Transient errors (timeouts,
connection errors, HTTP 408/429/5xx, a transfer cut short: found anywhere in the exception chain, by class name
where the class is an optional client's) are retried with exponential backoff, ``retries`` times, each logged, all
within ``RETRY_DEADLINE_S`` of the first attempt: an asynchronous file system's call in progress is cancelled at
it, so a server that never answers is reported then, whatever the client's own timeouts and retries multiply to.
A download cut short starts again into the same partial file, never served. What stays unavailable raises
``ShardUnavailableError`` naming the URL, the attempts and the time spent; a full local disk is not retried
(``DiskFullError``, from the cache).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import logging
import os
import re
import sys
import time
import weakref
from collections.abc import Callable
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO, NamedTuple, TypeVar, cast

from loader.sources.cache import ShardCache, disk_full
from loader.sources.tar_index import (
    BLOCK,
    ShardFormatError,
    ShardIndex,
    StaleIndexError,
    assemble_index,
    build_index,
    describes_file,
    digest,
    group_samples,
    index_bytes,
    load_index,
    same_layout,
    scan_tar,
)

__all__ = ["RemoteShard", "RemoteShards", "ShardUnavailableError", "is_remote", "local_path"]

log = logging.getLogger(__name__)
NO_CACHE = "only publish_index runs without a cache (cache=None)"
INDEX_READ_BYTES = 256 * 1024
RETRY_DELAY_S = 0.5  # the first pause; it doubles up to RETRY_MAX_DELAY_S
RETRY_MAX_DELAY_S = 8.0
RETRY_DEADLINE_S = 300.0  # one operation on a shard (a look-up, its index, a download): all its attempts together
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_VERSION_FIELDS = ("ETag", "etag", "generation")  # S3, HTTP, Azure; GCS
_MTIME_FIELDS = ("LastModified", "Last-Modified", "last_modified", "updated", "mtime")
_RETRIED_STATUS = (408, 425, 429)
_TRANSIENT_ERRORS = frozenset(
    {  # by class name (or a base's): the clients are optional, so never imported here
        # aiohttp: a response cut short (ClientPayloadError around ContentLengthError or TransferEncodingError), a
        # connection closed, refused or timed out
        "ClientPayloadError",
        "ContentLengthError",
        "TransferEncodingError",
        "ClientConnectionError",
        "ServerTimeoutError",
        # botocore: no connection, a connection closed, a read or connect timed out, a body cut short
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ProxyConnectionError",
        # http.client and urllib3 (file systems built on requests)
        "IncompleteRead",
        "ProtocolError",
    }
)
T = TypeVar("T")


_PARENTS_FILE_SYSTEMS: list = []  # fsspec's instances at a fork: in the child, never to be freed there


def _hold_file_systems() -> None:
    """Before a fork: the fsspec instances now cached, which fsspec drops from its cache in the child."""
    fsspec = sys.modules.get("fsspec")
    classes = [fsspec.AbstractFileSystem] if fsspec is not None else []
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        _PARENTS_FILE_SYSTEMS.extend(vars(cls).get("_cache", {}).values())


def _leave_parents_sessions_alone() -> None:
    """In a forked child (a DataLoader worker): the fsspec file systems inherited from the parent are not the
    child's to close. Their sockets and their event loop's epoll instance are the parent's too, so closing their
    sessions here (fsspec's finalizers and aiohttp's __del__ do, once fsspec drops the parent's instances from its
    cache in the child) removes the parent's sockets from the parent's loop, and the parent's next request on such
    a connection waits for its timeout (aiohttp's: 300 s). So the child keeps them referenced (a worker leaves by
    os._exit, without closing them) and detaches their finalizers."""
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        info = finalizer.peek()
        if info and getattr(info[1], "__name__", "") == "close_session":
            finalizer.detach()


os.register_at_fork(
    before=_hold_file_systems, after_in_parent=_PARENTS_FILE_SYSTEMS.clear, after_in_child=_leave_parents_sessions_alone
)


class ShardUnavailableError(OSError):
    """A remote shard could not be read: not found, access denied, or still failing after the retries."""


class _CopyMismatch(OSError):
    """A downloaded copy's tar headers are not the indexed ones: the transfer was corrupted; retried."""


def is_remote(url: str) -> bool:
    """A URL for fsspec (``s3://``, ``gs://``, ``http://``...) rather than a local path or ``file://`` URL."""
    match = _URL.match(url)
    return match is not None and match.group(1).lower() not in ("file", "local")


def local_path(url: str) -> str:
    """The path a ``file://`` URL names; anything else unchanged."""
    match = _URL.match(url)
    return url[match.end() :] if match is not None and match.group(1).lower() in ("file", "local") else url


class RemoteShard(NamedTuple):
    """A remote shard as the server describes it now."""

    url: str
    size: int
    mtime_ns: int
    version: str

    @property
    def identity(self) -> int:
        return digest(b"remote " + self.version.encode())

    def indexed_by(self, index: ShardIndex) -> bool:
        """Whether ``index`` was built for this very version."""
        return (index.shard_bytes, index.shard_mtime_ns, index.shard_identity) == (
            self.size,
            self.mtime_ns,
            self.identity,
        )

    def copy_name(self) -> str:
        """The cache name of a copy of this version: another version never has this name."""
        tag = hashlib.sha256(f"{self.url}\0{self.version}\0{self.size}".encode()).hexdigest()[:20]
        return f"{_basename(self.url)}.{tag}"


def _basename(url: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]


def index_name(url: str) -> str:
    return f"{_basename(url)}.{hashlib.sha256(url.encode()).hexdigest()[:16]}.idx.npz"


def _mtime_ns(value: Any) -> int:
    if isinstance(value, str):
        try:
            value = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, datetime):
        return int(value.timestamp()) * 10**9 + value.microsecond * 1000
    return int(float(value) * 1e9)


def describe(url: str, info: dict) -> RemoteShard:
    """The shard as fsspec's ``info()`` reports it: size, modification time and version tag."""
    mtime = next((info[f] for f in _MTIME_FIELDS if info.get(f) is not None), None)
    mtime_ns = 0 if mtime is None else _mtime_ns(mtime)
    version = next((f"{f}={info[f]}" for f in _VERSION_FIELDS if info.get(f) is not None), None)
    if version is None:
        if mtime is None:
            raise ShardUnavailableError(
                f"{url}: the server reports no ETag, generation or Last-Modified, so a shard changed on the server "
                "could not be told from the one indexed; serve the shards from a store that does"
            )
        version = f"mtime={mtime_ns}"
    if info.get("size") is None:
        raise ShardUnavailableError(f"{url}: the server reports no size")
    return RemoteShard(url, int(info["size"]), mtime_ns, version)


def _transient(exn: BaseException | None) -> bool:
    """Worth retrying: timeouts, connection errors, HTTP 408/425/429/5xx (also under a FileNotFoundError, which
    fsspec's HTTP info raises for any failed request), a transfer cut short. The first that decides, in the whole
    chain: a connection lost in the middle of a download surfaces as the error of the request that resumes it
    (botocore's EndpointConnectionError, no OSError) with the payload error as its context. Not a full disk."""
    if disk_full(exn):
        return False
    seen = set()
    while exn is not None and id(exn) not in seen:
        seen.add(id(exn))
        if isinstance(exn, (ShardUnavailableError, StaleIndexError, ShardFormatError)):
            return False
        status = getattr(exn, "status", None)
        if isinstance(status, int):
            return status in _RETRIED_STATUS or status >= 500
        if isinstance(exn, (TimeoutError, ConnectionError)) or any(
            cls.__name__ in _TRANSIENT_ERRORS for cls in type(exn).__mro__
        ):
            return True
        if isinstance(exn, OSError) and not isinstance(exn, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return True
        exn = exn.__cause__ or exn.__context__
    return False


def _within(fs: Any, method: str, deadline: float, *args: Any, **kwargs: Any) -> Any:
    """``fs.<method>(*args, **kwargs)``, cancelled at ``deadline`` where ``fs`` is asynchronous (fsspec runs its
    coroutine under ``asyncio.wait_for``): no client's timeouts times its retries (botocore's read_timeout, its
    attempts, then s3fs's) hold one attempt past the deadline. A synchronous file system is cut between attempts."""
    from fsspec.asyn import AsyncFileSystem, sync

    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the retry deadline passed")
    if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
        return sync(fs.loop, getattr(fs, "_" + method), *args, timeout=left, **kwargs)
    return getattr(fs, method)(*args, **kwargs)


class _Ranges:
    """A remote file as ``scan_tar`` reads it (seek, read), by ranges through fsspec's readahead cache
    (``INDEX_READ_BYTES`` past each read), each range a request bounded by the deadline."""

    def __init__(self, fs: Any, path: str, shard: RemoteShard, deadline: float) -> None:
        from fsspec.caching import ReadAheadCache

        self.fs, self.path, self.url, self.deadline, self.pos = fs, path, shard.url, deadline, 0
        self.cache = ReadAheadCache(INDEX_READ_BYTES, self._fetch, shard.size)

    def _fetch(self, start: int, end: int) -> bytes:
        data = _within(self.fs, "cat_file", self.deadline, self.path, start=start, end=end)
        if len(data) != end - start:
            raise ShardUnavailableError(
                f"{self.url}: a read of bytes {start}-{end} got {len(data)} bytes; the "
                "server must honour Range requests"
            )
        return data

    def seek(self, offset: int) -> None:
        self.pos = offset

    def read(self, nbytes: int) -> bytes:
        data = self.cache._fetch(self.pos, self.pos + nbytes)
        self.pos += len(data)
        return data


def _matching(data: bytes | None, shard: RemoteShard) -> ShardIndex | None:
    """The index in ``data`` if it was built for this version of the shard."""
    index = None if data is None else load_index(io.BytesIO(data))
    return index if index is not None and shard.indexed_by(index) else None


def _stale(expected: RemoteShard, now: RemoteShard) -> StaleIndexError:
    return StaleIndexError(
        f"{expected.url} changed on the server since it was indexed (size {expected.size}, {expected.version} -> "
        f"size {now.size}, {now.version}); create the WebDatasetSource again to index the new version. "
        "Sample numbering may change with it: check fingerprint() before resuming."
    )


class RemoteShards:
    """The remote shards of a source: fsspec access with retries, indexes and copies in a node's ``ShardCache``.

    Picklable (storage options, the cache's directory and limit), so DataLoader workers open their own clients.
    """

    def __init__(self, storage_options: dict | None, cache: ShardCache | None, retries: int = 5) -> None:
        """``cache`` None: only for writing indexes next to the shards (``publish_index``)."""
        if importlib.util.find_spec("fsspec") is None:
            raise ImportError('remote shards need fsspec (and s3fs for s3://): pip install -e ".[remote]"')
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.storage_options = dict(storage_options or {})
        self.cache, self.retries = cache, retries

    def _fs(self, url: str) -> tuple[Any, str]:
        """fsspec's file system and path for ``url`` (fsspec keeps one instance per process and options)."""
        import fsspec

        return fsspec.core.url_to_fs(url, **self.storage_options)

    def _retry(self, call: Callable[[float], T], url: str, what: str) -> T:
        """``call(deadline)``, retried with exponential backoff while it fails transiently: at most ``retries``
        times, and all attempts within ``RETRY_DEADLINE_S`` (``call`` bounds its requests by ``deadline``). A full
        local disk is raised as it is: the cache reports it."""
        start, delay, attempts = time.monotonic(), RETRY_DELAY_S, 0
        deadline = start + RETRY_DEADLINE_S
        while True:
            try:
                return call(deadline)
            except (StaleIndexError, ShardFormatError, ShardUnavailableError):
                raise
            except Exception as exn:
                attempts += 1
                if disk_full(exn):
                    raise
                if not _transient(exn):
                    raise ShardUnavailableError(f"{what} {url} failed: {exn!r}") from exn
                if attempts > self.retries or deadline - time.monotonic() <= delay:
                    raise ShardUnavailableError(
                        f"{what} {url} still failed after {attempts} attempt{'s' * (attempts > 1)} over "
                        f"{time.monotonic() - start:.1f} s "
                        f"(at most {self.retries + 1} attempts within {RETRY_DEADLINE_S:.0f} s; last error: "
                        f"{exn!r}); the shard stays unavailable"
                    ) from exn
                log.warning("%s %s failed (%r); retry %d/%d in %.1f s", what, url, exn, attempts, self.retries, delay)
                time.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_DELAY_S)

    # -- versions --------------------------------------------------------------------------------------------------

    def _now(self, url: str, deadline: float) -> RemoteShard:
        fs, path = self._fs(url)
        fs.invalidate_cache(path)  # a listing cached earlier would report the old version
        return describe(url, _within(fs, "info", deadline, path))

    def stat(self, url: str) -> RemoteShard:
        """The shard as the server describes it now (a HEAD request)."""
        return self._retry(lambda deadline: self._now(url, deadline), url, "looking up")

    def _check(self, expected: RemoteShard, deadline: float) -> None:
        now = self._now(expected.url, deadline)
        if now != expected:
            raise _stale(expected, now)

    def check_current(self, expected: RemoteShard) -> None:
        """Refuse a shard whose server version is no longer ``expected``."""
        self._retry(lambda deadline: self._check(expected, deadline), expected.url, "looking up")

    # -- indexes ---------------------------------------------------------------------------------------------------

    def _build(self, shard: RemoteShard, deadline: float) -> tuple[ShardIndex, int]:
        fs, path = self._fs(shard.url)
        self._check(shard, deadline)
        f = _Ranges(fs, path, shard, deadline)
        head = f.read(BLOCK)
        f.seek(0)
        reads = cast(BinaryIO, f)  # scan_tar only seeks and reads, given the size
        samples = list(group_samples(scan_tar(reads, shard.url, shard.size), shard.url))
        self._check(shard, deadline)  # the ranged reads all saw this version
        index = assemble_index(samples, shard.size, shard.mtime_ns, shard.identity, head)
        return index, f.cache.total_requested_bytes

    def _stored_index(self, url: str, deadline: float) -> bytes | None:
        """``<url>.idx.npz`` next to the shard, if ``python -m loader index`` wrote one."""
        fs, path = self._fs(url)
        try:
            return _within(fs, "cat_file", deadline, path + ".idx.npz")
        except FileNotFoundError as exn:
            if _transient(exn.__cause__ or exn.__context__):
                raise
            return None

    def index(self, shard: RemoteShard, rebuild: bool = False) -> tuple[ShardIndex, bool]:
        """The index of this version of the shard: cached, stored next to it, or built by ranged reads (and
        cached); also whether it was built."""
        name = index_name(shard.url)
        assert self.cache is not None, NO_CACHE
        if not rebuild:
            if (index := _matching(self.cache.load_index(name), shard)) is not None:
                return index, False
            data = self._retry(
                lambda deadline: self._stored_index(shard.url, deadline), shard.url, "reading the index of"
            )
            if data is not None and (index := _matching(data, shard)) is not None:
                self.cache.store_index(name, data)
                return index, False
        index, fetched = self._retry(lambda deadline: self._build(shard, deadline), shard.url, "indexing")
        self.cache.store_index(name, index_bytes(index))
        self.cache.add_counts(indexes_built=1, index_bytes=fetched)
        return index, True

    def publish_index(self, url: str, rebuild: bool = False) -> tuple[int, bool]:
        """Write ``<url>.idx.npz`` next to the shard for later jobs; returns its samples and whether it was built."""
        shard = self.stat(url)
        if not rebuild:
            data = self._retry(lambda deadline: self._stored_index(url, deadline), url, "reading the index of")
            if (index := _matching(data, shard)) is not None:
                return len(index), False
        index, _ = self._retry(lambda deadline: self._build(shard, deadline), url, "indexing")
        fs, path = self._fs(url)
        data = index_bytes(index)
        self._retry(
            lambda deadline: _within(fs, "pipe_file", deadline, path + ".idx.npz", data), url, "writing the index of"
        )
        return len(index), True

    # -- copies ----------------------------------------------------------------------------------------------------

    def _download(self, shard: RemoteShard, index: ShardIndex, dest: str, deadline: float) -> None:
        fs, path = self._fs(shard.url)
        self._check(shard, deadline)
        _within(fs, "get_file", deadline, path, dest)  # from the start again after a cut: it truncates ``dest``
        self._check(shard, deadline)  # the transfer read this version
        os.utime(dest, ns=(shard.mtime_ns, shard.mtime_ns))  # a copy keeps the shard's size and mtime (rsync -t)
        if os.path.getsize(dest) != shard.size or not same_layout(build_index(dest), index):
            raise _CopyMismatch(f"the copy of {shard.url} does not have the indexed tar headers")

    def download(self, shard: RemoteShard, index: ShardIndex, dest: str) -> None:
        """Write the shard's bytes to ``dest``, checked: this version throughout, every tar header as indexed."""
        self._retry(lambda deadline: self._download(shard, index, dest, deadline), shard.url, "downloading")

    def prefetch(self, shard: RemoteShard, index: ShardIndex, rank: int) -> bool:
        """Have a copy in the cache ahead of its readers (``rank``: its place in the plan); False when the cache has
        no room without evicting a shard needed sooner."""
        fill = lambda dest: self.download(shard, index, dest)  # noqa: E731
        assert self.cache is not None, NO_CACHE
        return self.cache.fetch(shard.copy_name(), shard.size, fill, rank=rank) is not None

    def open_copy(
        self, shard: RemoteShard, index: ShardIndex, release: Callable[[], None] | None = None
    ) -> tuple[int, str]:
        """A descriptor (pinned against eviction) and path of a verified copy of this version; ``release`` drops
        the caller's open copies when the cache has no room for this one without their space.

        A copy made before the cache was opened is used only while the server still has this version (one HEAD
        request; one made since, ``Fetched.fresh``, was checked against the server by its download, during this
        run: a worker asking again would pay a session of its own before its first batch, 1 s here), and every
        copy only while its size, mtime, first block and a spread of member headers read back as indexed, and while
        its bytes have the checksum taken at its download (read once per process: ``ShardCache.verify``);
        otherwise it is discarded (``damaged_copies`` in the cache's stats) and fetched again.
        """
        name, fill = shard.copy_name(), lambda dest: self.download(shard, index, dest)
        assert self.cache is not None, NO_CACHE
        for _ in range(2):
            copy = self.cache.fetch(name, shard.size, fill, pin=True, release=release)
            assert copy is not None and copy.fd is not None, "a reader's fetch waits for its copy, pinned"
            path, fd, fresh = copy.path, copy.fd, copy.fresh
            try:
                if not fresh:  # made before the cache was opened: the server may have another version since
                    self.check_current(shard)
                if describes_file(index, fd) and self.cache.verify(name, fd):
                    return fd, path
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            log.warning("the cached copy %s of %s is damaged, rotten or truncated: fetching it again", path, shard.url)
            self.cache.discard(name)
        raise ShardFormatError(f"{shard.url}: its copy in {self.cache.directory} failed its checks twice in a row")

    def discard_copy(self, shard: RemoteShard) -> None:
        """Drop a copy found damaged while reading: the next open fetches it again."""
        log.warning("a read of the cached copy of %s failed its checks: fetching it again", shard.url)
        assert self.cache is not None, NO_CACHE
        self.cache.discard(shard.copy_name())
