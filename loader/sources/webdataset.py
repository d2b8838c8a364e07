"""WebDataset tar shards as a map-style dataset, so they shuffle, partition and resume like any other.

Samples are numbered shard by shard in shard-list order, and ``__getitem__``
returns what ``webdataset.WebDataset(urls, shardshuffle=False)`` (plus the same
``.decode(...)`` and ``.to_tuple(...)``) yields at that position, including the
``__key__``, ``__url__`` and ``__local_path__`` entries.  Shards are uncompressed
tar files: local paths (``__url__`` and ``__local_path__`` are both the path) or
URLs that fsspec opens (``s3://``, ``gs://``, ``http(s)://``...; ``__url__`` is
the URL and, as webdataset streams them, there is no ``__local_path__``), read
from verified copies in a bounded node-local cache (``remote.py``, ``cache.py``)
that the loader's plan fills ahead of the readers (``prefetch.py``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import multiprocessing
import operator
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeAlias, TypeVar

import numpy as np
import torch.utils.data
from torch.distributed import ProcessGroup
from webdataset import autodecode
from webdataset.shardlists import expand_urls

from loader.core.collectives import barrier, distributed, rank, world_size
from loader.sources.cache import ShardCache, human
from loader.sources.prefetch import Prefetcher
from loader.sources.remote import NO_CACHE, RemoteShard, RemoteShards, ShardUnavailableError, is_remote, local_path
from loader.sources.tar_index import (
    IndexedMember,
    ShardFormatError,
    ShardIndex,
    StaleIndexError,
    default_cache_dir,
    file_state,
    header_matches,
    load_or_build_index,
)

__all__ = [
    "MissingKeyError",
    "ShardFormatError",
    "ShardUnavailableError",
    "StaleIndexError",
    "WebDatasetSource",
    "expand_shards",
    "prepare_indexes",
]

T = TypeVar("T")
REMOTE_JOBS = 16  # concurrent requests while looking up and indexing remote shards
REMOTE_OPEN_FILES = 2  # cached copies a process keeps open: an open copy is pinned against eviction
LOCAL = "only a source with remote shards has their versions, a plan and a RemoteShards (with its cache)"

Handler = str | Callable[[str, bytes], Any]
DecodeSpec: TypeAlias = Handler | Sequence[Handler] | autodecode.Decoder | None


class MissingKeyError(KeyError):
    """A sample lacks a member that ``keys=`` asks for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def expand_shards(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Shard paths from a directory (its ``*.tar``, sorted), a brace pattern, or a list, as webdataset lists them."""
    if isinstance(urls, os.PathLike):
        urls = os.fspath(urls)
    if isinstance(urls, str) and os.path.isdir(urls):
        return [os.path.join(urls, n) for n in sorted(os.listdir(urls)) if n.endswith(".tar")]
    shards = [local_path(s) for s in (expand_urls(urls) if isinstance(urls, str) else (os.fspath(u) for u in urls))]
    other = [s for s in shards if not is_remote(s) and ":" in s.split("/", 1)[0] and not os.path.exists(s)]
    if other:
        raise ValueError(
            f"random access needs uncompressed tar files, local or at a URL fsspec opens (s3://, gs://, "
            f"http(s)://...), got {other[0]!r}; webdataset's pipe: commands can only be streamed"
        )
    return shards


def _make_decoder(decode: DecodeSpec) -> autodecode.Decoder | None:
    """Build webdataset's own Decoder from what ``WebDataset.decode(*args)`` accepts."""
    if decode is None or isinstance(decode, autodecode.Decoder):
        return decode
    handlers = [decode] if isinstance(decode, str) or callable(decode) else list(decode)
    return autodecode.Decoder([autodecode.ImageHandler(h) if isinstance(h, str) else h for h in handlers])


def _parse_keys(keys: str | Sequence[str] | None) -> tuple[tuple[str, ...], ...] | None:
    """``keys`` as webdataset's ``to_tuple`` reads its arguments: space-separated fields, ';' alternatives."""
    if keys is None:
        return None
    fields = keys.split() if isinstance(keys, str) else list(keys)
    if not fields:
        raise ValueError("keys= must name at least one field, e.g. keys=('jpg', 'cls')")
    return tuple(tuple(f.split(";")) for f in fields)


class _ShardFile:
    """One open shard, read with pread; the descriptor closes when the last reader drops the object.

    Closing by reference count (not on LRU eviction) means a thread still reading
    an evicted shard never sees its descriptor closed and reused for another file.
    """

    def __init__(self, fd: int, path: str, index: ShardIndex) -> None:
        self.fd, self.path, self.index = fd, path, index
        self.seen = self.state()

    def stale(self, change: str) -> StaleIndexError:
        return StaleIndexError(
            f"{self.path} changed after its index was built ({change}); create the WebDatasetSource again "
            "(stale indexes are rebuilt then) or pass rebuild_index=True. "
            "Sample numbering may change with it: check fingerprint() before resuming."
        )

    def state(self) -> tuple[int, int, int]:
        """Size, mtime and ctime now; a size or mtime other than indexed is refused."""
        st = os.fstat(self.fd)
        if not self.index.matches(st):
            indexed = (self.index.shard_bytes, self.index.shard_mtime_ns)
            raise self.stale(f"size, mtime_ns {indexed} -> {file_state(st)}")
        return (*file_state(st), st.st_ctime_ns)

    def read_member(self, member: IndexedMember, what: str) -> bytes:
        """A member's data, served only if its header blocks are the ones indexed at that place."""
        data = self.read(member.offset, member.size, what)
        if not header_matches(self.fd, member.header_offset, member.header_length, member.header_digest):
            raise self.stale(f"the tar header of {what} at byte {member.header_offset} is not the one indexed")
        return data

    def read_sample(self, members: list[IndexedMember], key: str) -> dict[str, bytes]:
        """The members' data by suffix, read again once if the ctime moved meanwhile.

        A ctime change is a chmod, a new hard link or a rewrite: the second read's header
        checks tell them apart, and a stable ctime around them rules out a torn read.
        """
        for _ in range(2):
            seen = self.seen
            data = {m.suffix: self.read_member(m, f"member {key}.{m.suffix}") for m in members}
            self.seen = self.state()
            if self.seen == seen:
                return data
        raise self.stale("it kept changing while it was read")

    @classmethod
    def open(cls, path: str, index: ShardIndex) -> _ShardFile:
        try:
            return cls(os.open(path, os.O_RDONLY), path, index)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"WebDataset shard {path} disappeared after it was indexed; restore it or create the "
                "WebDatasetSource again with the shards that exist"
            ) from None

    def read(self, offset: int, size: int, what: str) -> bytes:
        data = os.pread(self.fd, size, offset)
        if len(data) != size:
            raise ShardFormatError(
                f"{self.path}: {what} should have {size} bytes at byte {offset} but only {len(data)} "
                "could be read; the shard was truncated. Re-create it, then rebuild the index (rebuild_index=True)."
            )
        return data

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:  # bound early: works at interpreter exit
        _close(self.fd)


class _OpenShards:
    """Per-process LRU of open shards: bounds file descriptors; pickles and forks without them."""

    def __init__(self, max_open: int) -> None:
        if max_open < 1:
            raise ValueError(f"max_open_files must be >= 1, got {max_open}")
        self.max_open = max_open
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._files: OrderedDict[str, _ShardFile] = OrderedDict()

    def __getstate__(self) -> dict[str, int]:
        return {"max_open": self.max_open}

    def __setstate__(self, state: dict[str, int]) -> None:
        _OpenShards.__init__(self, state["max_open"])

    def __len__(self) -> int:
        return len(self._files)

    def get(self, path: str, index: ShardIndex, opener: Callable[[], _ShardFile] | None = None) -> _ShardFile:
        """The open shard at ``path``, opened by ``opener`` (default: the local file) when it is not open yet."""
        if self._pid != os.getpid():  # forked: inherited descriptors (and a possibly held lock) are the parent's
            self._reset()
        with self._lock:
            if (f := self._files.get(path)) is not None:
                self._files.move_to_end(path)
                return f
        f = _ShardFile.open(path, index) if opener is None else opener()
        with self._lock:
            self._files[path] = f
            self._files.move_to_end(path)
            while len(self._files) > self.max_open:
                self._files.popitem(last=False)
        return f

    def drop(self, path: str) -> None:
        with self._lock:
            self._files.pop(path, None)

    def clear(self) -> None:
        """Drop them all (each closes with its last reader): a reader that needs room releases its pins first."""
        with self._lock:
            self._files.clear()


def _local_ranks() -> int:
    """Ranks on this node, as torchrun says (``LOCAL_WORLD_SIZE``); 1 when it does not."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _report_progress(done: int, total: int, built: int, final: bool) -> None:
    end = "\n" if final else ""
    print(f"\rloader: indexing WebDataset shards {done}/{total} ({built} built)", end=end, file=sys.stderr, flush=True)


def index_shards(
    shards: list[str], index_of: Callable[[str], tuple[ShardIndex, bool]], progress: bool, jobs: int = 1
) -> list[ShardIndex]:
    """Each shard's index from ``index_of`` (loaded or built), in ``jobs`` threads, with a progress line while any
    is built."""
    indexes, built, last_report = [], 0, 0.0
    with ThreadPoolExecutor(jobs) as pool:
        for done, (index, was_built) in enumerate(pool.map(index_of, shards) if jobs > 1 else map(index_of, shards), 1):
            indexes.append(index)
            built += was_built
            if progress and built and (done == len(shards) or time.monotonic() - last_report > 0.5):
                _report_progress(done, len(shards), built, final=done == len(shards))
                last_report = time.monotonic()
    return indexes


def _load_or_build(task: tuple[str, str | None, bool]) -> tuple[int, bool]:
    index, built = load_or_build_index(*task)
    return len(index), built


def _remote_shards(
    shards: list[str], cache_dir: str | None, cache_limit: int | str | None, storage_options: dict | None, retries: int
) -> RemoteShards | None:
    """Access to the remote shards and the node cache they are copied into; None when every shard is local."""
    if not any(map(is_remote, shards)):
        return None
    if cache_limit is None:
        raise ValueError(
            "remote shards are read from copies in a bounded local cache: pass cache_limit= (bytes, or a string "
            "such as '50GB'), and cache_dir= on fast local disk"
        )
    directory = cache_dir or os.path.join(os.path.dirname(default_cache_dir()), "remote")
    return RemoteShards(storage_options, ShardCache(directory, cache_limit), retries)


def prepare_indexes(
    urls: str | os.PathLike | Sequence[str | os.PathLike],
    cache_dir: str | os.PathLike | None = None,
    rebuild: bool = False,
    jobs: int | None = None,
    storage_options: dict | None = None,
    cache_limit: int | str | None = None,
) -> dict[str, int]:
    """Build the shards' indexes ahead of a job, in `jobs` processes (default: one per CPU; threads of requests
    for remote shards), so that no rank of the job reads a tar header at start-up. Remote shards' indexes are
    written next to them (``<url>.idx.npz``, for every later job) or, with ``cache_dir`` and ``cache_limit``, into
    that node cache. Returns the counts of shards, samples and indexes built."""
    shards = expand_shards(urls)
    if not shards:
        raise ValueError(f"no shards found for {urls!r}")
    cache = None if cache_dir is None else os.fspath(cache_dir)
    if any(map(is_remote, shards)):
        remote = (
            RemoteShards(storage_options, None)
            if cache is None
            else _remote_shards(shards, cache, cache_limit, storage_options, retries=5)
        )
        assert remote is not None, "some shard is remote"

        def prepare(shard: str) -> tuple[int, bool]:
            if not is_remote(shard):
                return _load_or_build((shard, cache, rebuild))
            if cache is None:
                return remote.publish_index(shard, rebuild)
            index, built = remote.index(remote.stat(shard), rebuild)
            return len(index), built

        with ThreadPoolExecutor(jobs or REMOTE_JOBS) as pool:
            results = list(pool.map(prepare, shards))
    elif jobs == 1:
        results = list(map(_load_or_build, [(shard, cache, rebuild) for shard in shards]))
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as processes:
            results = list(processes.map(_load_or_build, [(shard, cache, rebuild) for shard in shards]))
    return {"shards": len(shards), "samples": sum(n for n, _ in results), "built": sum(b for _, b in results)}


class WebDatasetSource(torch.utils.data.Dataset):
    """Map-style dataset over WebDataset tar shards with random access through per-shard indexes.

    Args:
        urls: a brace pattern (``"data/train-{000000..000127}.tar"``,
            ``"s3://bucket/train-{000000..000511}.tar"``), a list of shard paths or
            URLs, or a local directory (its ``*.tar`` files, sorted). URLs are any
            fsspec opens (``s3://``, ``gs://``, ``az://``, ``http(s)://``); ``file://``
            URLs are read as the local paths they name.
        decode: what ``WebDataset(...).decode(...)`` takes: an image spec such as
            ``"torchrgb"``, a handler callable, a sequence of those, or a ready
            ``webdataset.autodecode.Decoder`` (for ``pre=``/``post=``/``only=``).
        keys: return a tuple like ``.to_tuple(*keys)`` (``"jpg;png"`` picks the
            first present); ``None`` returns the sample dict, with ``__key__``, ``__url__``
            and ``__local_path__`` as webdataset sets them.
        cache_dir: where to keep indexes; default is next to each shard, falling
            back to ``$XDG_CACHE_HOME/loader/webdataset-index`` if that is not writable.
            Remote shards: the node's cache of their indexes and copies (default
            ``$XDG_CACHE_HOME/loader/remote``), shared by every worker and rank that sees it.
        cache_limit: remote shards only, required: bytes that everything under ``cache_dir`` may take (an
            int, or ``"50GB"`` = 50·10^9, ``"50GiB"`` = 50·2^30). It must hold ``prefetch + 2`` of the largest
            shards (the one read, the next, those prefetched); a smaller one is refused here. At ``iter()`` of a
            loader, also ``2 × (readers - 1) + 1`` of them, readers = ``max(1, num_workers)`` × ranks on the node
            (``LOCAL_WORLD_SIZE``): each other reader may keep 2 copies open while one needs room for one more.
        storage_options: remote shards: fsspec's options for their file system (``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``, timeouts...), as ``fsspec.open`` takes them.
        prefetch: remote shards: shards the loader's plan downloads ahead of those being read.
        retries: remote shards: retries of a transient failure (timeouts, connection errors, HTTP 5xx), with
            exponential backoff, before the shard is reported unavailable.
        rebuild_index: ignore cached indexes and rebuild them all.
        max_open_files: open shards kept per process (LRU).
        progress: print an indexing progress line on stderr when indexes are built.
        group: a torch.distributed process group (``torch.distributed.group.WORLD`` for all ranks) whose ranks
            split the building of missing indexes: each builds every W-th shard, then all wait for each other and
            load the cached indexes, building only those they cannot see (a cache that is not shared). A
            collective: every rank of the group must construct the source. ``None``: each process indexes alone.
            For very large datasets, prebuild the indexes once with ``python -m loader index SHARDS``.
    """

    def __init__(
        self,
        urls: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        decode: DecodeSpec = None,
        keys: str | Sequence[str] | None = None,
        cache_dir: str | os.PathLike | None = None,
        rebuild_index: bool = False,
        max_open_files: int = 16,
        progress: bool = True,
        group: ProcessGroup | None = None,
        storage_options: dict | None = None,
        cache_limit: int | str | None = None,
        prefetch: int = 2,
        retries: int = 5,
    ) -> None:
        self.shards: list[str] = expand_shards(urls)
        if not self.shards:
            raise ValueError(f"no shards found for {urls!r}")
        self._decoder = _make_decoder(decode)
        self._keys = _parse_keys(keys)
        self._files = _OpenShards(max_open_files)
        self._copies = _OpenShards(REMOTE_OPEN_FILES)
        cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self._remote = _remote_shards(self.shards, cache_dir, cache_limit, storage_options, retries)
        self._versions: dict[str, RemoteShard] = {}
        jobs = 1
        if self._remote is not None:
            remote_urls = [s for s in self.shards if is_remote(s)]
            with ThreadPoolExecutor(REMOTE_JOBS) as pool:
                self._versions = dict(zip(remote_urls, pool.map(self._remote.stat, remote_urls)))
            self._check_cache_limit(prefetch)
            jobs = REMOTE_JOBS
        self._prefetch = prefetch
        self._prefetcher: Prefetcher | None = None
        if group is not None and distributed():
            index_shards(
                self.shards[rank(group) :: world_size(group)], self._index_of(cache_dir, rebuild_index), progress, jobs
            )
            barrier(group)
            rebuild_index = False  # every index was just built by some rank of the group
        self._indexes = index_shards(self.shards, self._index_of(cache_dir, rebuild_index), progress, jobs)
        self.shard_sizes: list[int] = [len(index) for index in self._indexes]
        self._fingerprint: str | None = None
        self._starts = [0]
        for size in self.shard_sizes:
            self._starts.append(self._starts[-1] + size)
        self._starts_array = np.array(self._starts, dtype=np.int64)

    def _index_of(self, cache_dir: str | None, rebuild: bool) -> Callable[[str], tuple[ShardIndex, bool]]:
        def index_of(shard: str) -> tuple[ShardIndex, bool]:
            if shard in self._versions:
                assert self._remote is not None, LOCAL
                return self._remote.index(self._versions[shard], rebuild)
            return load_or_build_index(shard, cache_dir, rebuild)

        return index_of

    def _check_cache_limit(self, prefetch: int, workers: int | None = None) -> None:
        """Refuse a cache that cannot hold the shards in use at once: read, next, and ``prefetch`` ahead; with
        ``workers`` (at a loader's ``iter()``), also those that keep every reader of the node from waiting for ever:
        each other reader's open copies (it may idle, its next batch waiting on ours) and one more."""
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        assert self._remote is not None and self._remote.cache is not None, LOCAL
        cache, largest = self._remote.cache, max(shard.size for shard in self._versions.values())
        shards, held = prefetch + 2, f"the shard being read, the next one and prefetch={prefetch} more"
        if workers is not None:
            ranks = _local_ranks()
            readers = max(1, workers) * ranks
            if (readers - 1) * REMOTE_OPEN_FILES + 1 > shards:
                shards = (readers - 1) * REMOTE_OPEN_FILES + 1
                held = (
                    f"the {REMOTE_OPEN_FILES} shards open in each but one of the {readers} processes reading "
                    f"remote shards on this node ({max(1, workers)} per rank, {ranks} ranks) and one more"
                )
        minimum = shards * cache.copy_footprint(largest) + 2 * cache.footprint(1)  # and the counters, a plan
        if cache.limit < minimum:
            raise ValueError(
                f"cache_limit {human(cache.limit)} is too small: the cache holds {held} at once, each up to "
                f"{human(largest)}: at least {human(minimum)}; raise cache_limit or lower prefetch / num_workers"
            )

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        """(shard number, sample number within the shard) of a global index."""
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def sample_key(self, index: int) -> tuple[str, str]:
        """(shard path, sample key): the identity of sample ``index``."""
        shard, local = self._locate(index)
        return self.shards[shard], self._indexes[shard].key(local)

    def fingerprint(self) -> str:
        """Digest of shard basenames, sample counts and sample keys, to tell a checkpoint it is resuming another
        dataset: positions name samples by shard and place, so a shard rewritten with other keys in the same
        count would silently resume onto other samples. Not the payloads (the same keys in another copy are the
        same dataset). Computed once: hashing every key costs about a second per 1e8 samples."""
        if self._fingerprint is None:
            layout = [
                [os.path.basename(s), n, hashlib.blake2b(index.key_blob.tobytes(), digest_size=16).hexdigest()]
                for s, n, index in zip(self.shards, self.shard_sizes, self._indexes)
            ]
            self._fingerprint = hashlib.sha256(json.dumps(layout).encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return self._fingerprint

    def _select(self, shard: str, key: str, present: list[str]) -> list[str] | None:
        """Names ``keys`` resolves to in this sample (first present alternative), or None for all."""
        if self._keys is None:
            return None
        available = {"__key__", "__url__", "__local_path__", *present}
        chosen = []
        for alternatives in self._keys:
            name = next((a for a in alternatives if a in available), None)
            if name is None:
                raise MissingKeyError(
                    f"{shard}: sample {key!r} has no {';'.join(alternatives)!r} member (it has {present}); "
                    "pass keys= that every sample has, or alternatives like 'jpg;png'"
                )
            chosen.append(name)
        return chosen

    def _read(self, shard: str, index: ShardIndex, members: list[IndexedMember], key: str) -> dict[str, bytes]:
        """The members' bytes: from the shard, or from the cache's copy of a remote one. A copy that fails its
        checks while it is read (damaged or truncated on local disk) is fetched again, once."""
        version = self._versions.get(shard)
        if version is None:
            return self._files.get(shard, index).read_sample(members, key)
        remote = self._remote
        assert remote is not None, LOCAL
        opener = lambda: _ShardFile(  # noqa: E731
            *remote.open_copy(version, index, release=self._copies.clear), index
        )
        copy = self._copies.get(shard, index, opener)  # a shard changed on the server is refused here
        try:
            return copy.read_sample(members, key)
        except (StaleIndexError, ShardFormatError):
            self._copies.drop(shard)
            remote.discard_copy(version)
        return self._copies.get(shard, index, opener).read_sample(members, key)

    def __getitem__(self, index: int) -> dict[str, Any] | tuple[Any, ...]:
        shard_no, local = self._locate(index)
        shard, shard_index = self.shards[shard_no], self._indexes[shard_no]
        key, members = shard_index.key(local), shard_index.members(local)
        chosen = self._select(shard, key, [m.suffix for m in members])
        wanted = [m for m in members if chosen is None or m.suffix in chosen]
        sample: dict[str, Any] = {"__key__": key, "__url__": shard}
        if shard not in self._versions:
            sample["__local_path__"] = shard  # webdataset sets it for local files, not for streamed URLs
        sample.update(self._read(shard, shard_index, wanted, key))
        if self._decoder is not None:
            sample = self._decoder(sample)
        return sample if chosen is None else tuple(sample[name] for name in chosen)

    # -- the loader's plan (remote shards) ----------------------------------------------------------------------------

    def before_iter(self, num_workers: int) -> None:
        """The loader's hook at ``iter()``, before any batch or worker starts: with remote shards, refuse a cache
        too small for the node's readers; with workers, this process reads no more, so its copies close."""
        if self._remote is None:
            return
        self._check_cache_limit(self._prefetch, num_workers)
        if num_workers:
            self._copies.clear()  # else they stay pinned meanwhile

    def planned(self, batches: Iterable[T], in_flight: int) -> Iterable[T]:
        """The loader's hook: ``batches`` are this rank's upcoming index lists, in dispatch order, ``in_flight`` of
        them loading at once. Returns them unchanged; with remote shards, reading ahead in them to download the
        next shards before any worker asks (``prefetch`` shards past those in flight)."""
        if self._remote is None:
            return batches
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._shards_of, self._prefetch_shard, self._publish, self._prefetch)
        return self._prefetcher.follow(batches, in_flight)

    def _shards_of(self, batch: Any) -> list[int]:
        ids = np.asarray(batch, dtype=np.int64).reshape(-1)
        return list(dict.fromkeys((np.searchsorted(self._starts_array, ids, side="right") - 1).tolist()))

    def _prefetch_shard(self, shard_no: int, rank: int) -> bool:
        version = self._versions.get(self.shards[shard_no])
        assert self._remote is not None, LOCAL
        return version is None or self._remote.prefetch(version, self._indexes[shard_no], rank)

    def _publish(self, shard_nos: list[int]) -> None:
        versions = (self._versions.get(self.shards[n]) for n in shard_nos)
        assert self._remote is not None and self._remote.cache is not None, LOCAL
        self._remote.cache.publish_plan([v.copy_name() for v in versions if v is not None])

    def cache_stats(self) -> dict[str, int]:
        """The node cache's counters (remote shards): ``downloads``, ``downloaded_bytes``, ``damaged_copies``,
        ``indexes_built``, ``index_bytes`` (read by ranged requests to index), ``cache_hits``, ``cache_misses``,
        ``evictions``, ``evicted_bytes``, across every process using ``cache_dir``."""
        if self._remote is None:
            return {}
        assert self._remote.cache is not None, NO_CACHE
        return self._remote.cache.stats()

    def metrics(self) -> dict[str, int]:
        """What a ResumableDataLoader merges into its metrics as ``source/...`` (see loader.metrics): with remote
        shards, ``remote_shards`` and the node cache's counters (``cache_stats``), cumulative since the cache
        directory was made; nothing for local shards."""
        return {} if self._remote is None else {"remote_shards": len(self._versions), **self.cache_stats()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_prefetcher": None}  # the plan is followed in the loader's process only

    def __repr__(self) -> str:
        name, shards = type(self).__name__, len(self.shards)
        return f"{name}({shards} shards, {len(self)} samples)"  # no fingerprint: it hashes every key
