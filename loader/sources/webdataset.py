"""WebDataset tar shards as a map-style dataset, so they shuffle, partition and resume like any other.

Samples are numbered shard by shard in shard-list order, and ``__getitem__``
returns what ``webdataset.WebDataset(urls, shardshuffle=False)`` (plus the same
``.decode(...)`` and ``.to_tuple(...)``) yields at that position, including the
``__key__``, ``__url__`` and ``__local_path__`` entries.  Shards must be local,
uncompressed tar files given as plain paths (no ``file:``/``pipe:``/``http:``
URLs), so ``__url__`` and ``__local_path__`` are both the shard path.
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
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch.utils.data
from webdataset import autodecode
from webdataset.shardlists import expand_urls

from loader.collectives import barrier, distributed, rank, world_size
from loader.sources.tar_index import (
    IndexedMember,
    ShardFormatError,
    ShardIndex,
    StaleIndexError,
    file_state,
    header_matches,
    load_or_build_index,
)

__all__ = [
    "MissingKeyError", "ShardFormatError", "StaleIndexError", "WebDatasetSource", "expand_shards", "prepare_indexes",
]

Handler = str | Callable[[str, bytes], Any]
DecodeSpec = Handler | Sequence[Handler] | autodecode.Decoder | None


class MissingKeyError(KeyError):
    """A sample lacks a member that ``keys=`` asks for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def expand_shards(urls: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Shard paths from a directory (its ``*.tar``, sorted), a brace pattern, or a list, as webdataset lists them."""
    if isinstance(urls, os.PathLike):
        urls = os.fspath(urls)
    if isinstance(urls, str) and os.path.isdir(urls):
        return [os.path.join(urls, n) for n in sorted(os.listdir(urls)) if n.endswith(".tar")]
    shards = expand_urls(urls) if isinstance(urls, str) else [os.fspath(u) for u in urls]
    remote = [s for s in shards if ":" in s.split("/", 1)[0] and not os.path.exists(s)]
    if remote:
        raise ValueError(
            f"random access needs local, uncompressed tar files, got {remote[0]!r}; "
            "download or mount the shards and pass their paths"
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
        self.__init__(state["max_open"])

    def __len__(self) -> int:
        return len(self._files)

    def get(self, path: str, index: ShardIndex) -> _ShardFile:
        if self._pid != os.getpid():  # forked: inherited descriptors (and a possibly held lock) are the parent's
            self._reset()
        with self._lock:
            if (f := self._files.get(path)) is not None:
                self._files.move_to_end(path)
                return f
        f = _ShardFile.open(path, index)
        with self._lock:
            self._files[path] = f
            self._files.move_to_end(path)
            while len(self._files) > self.max_open:
                self._files.popitem(last=False)
        return f


def _report_progress(done: int, total: int, built: int, final: bool) -> None:
    end = "\n" if final else ""
    print(f"\rloader: indexing WebDataset shards {done}/{total} ({built} built)", end=end, file=sys.stderr, flush=True)


def index_shards(shards: list[str], cache_dir: str | None, rebuild: bool, progress: bool) -> list[ShardIndex]:
    """Each shard's index, loaded from cache or built (and cached), with a progress line while any is built."""
    indexes, built, last_report = [], 0, 0.0
    for done, shard in enumerate(shards, 1):
        index, was_built = load_or_build_index(shard, cache_dir, rebuild)
        indexes.append(index)
        built += was_built
        if progress and built and (done == len(shards) or time.monotonic() - last_report > 0.5):
            _report_progress(done, len(shards), built, final=done == len(shards))
            last_report = time.monotonic()
    return indexes


def _load_or_build(task: tuple[str, str | None, bool]) -> tuple[int, bool]:
    index, built = load_or_build_index(*task)
    return len(index), built


def prepare_indexes(
    urls: str | os.PathLike | Sequence[str | os.PathLike],
    cache_dir: str | os.PathLike | None = None,
    rebuild: bool = False,
    jobs: int | None = None,
) -> dict[str, int]:
    """Build the shards' indexes ahead of a job, in `jobs` processes (default: one per CPU), so that no rank of
    the job reads a tar header at start-up. Returns the counts of shards, samples and indexes built."""
    shards = expand_shards(urls)
    if not shards:
        raise ValueError(f"no shards found for {urls!r}")
    cache = None if cache_dir is None else os.fspath(cache_dir)
    tasks = [(shard, cache, rebuild) for shard in shards]
    if jobs == 1:
        results = list(map(_load_or_build, tasks))
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_load_or_build, tasks))
    return {"shards": len(shards), "samples": sum(n for n, _ in results), "built": sum(b for _, b in results)}


class WebDatasetSource(torch.utils.data.Dataset):
    """Map-style dataset over WebDataset tar shards with random access through per-shard indexes.

    Args:
        urls: a brace pattern (``"data/train-{000000..000127}.tar"``), a list of
            shard paths, or a directory (its ``*.tar`` files, sorted).
        decode: what ``WebDataset(...).decode(...)`` takes: an image spec such as
            ``"torchrgb"``, a handler callable, a sequence of those, or a ready
            ``webdataset.autodecode.Decoder`` (for ``pre=``/``post=``/``only=``).
        keys: return a tuple like ``.to_tuple(*keys)`` (``"jpg;png"`` picks the
            first present); ``None`` returns the sample dict, with ``__key__``, ``__url__``
            and ``__local_path__`` as webdataset sets them.
        cache_dir: where to keep indexes; default is next to each shard, falling
            back to ``$XDG_CACHE_HOME/loader/webdataset-index`` if that is not writable.
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
        group=None,
    ) -> None:
        self.shards: list[str] = expand_shards(urls)
        if not self.shards:
            raise ValueError(f"no shards found for {urls!r}")
        self._decoder = _make_decoder(decode)
        self._keys = _parse_keys(keys)
        self._files = _OpenShards(max_open_files)
        cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        if group is not None and distributed():
            index_shards(self.shards[rank(group)::world_size(group)], cache_dir, rebuild_index, progress)
            barrier(group)
            rebuild_index = False  # every index was just built by some rank of the group
        self._indexes = index_shards(self.shards, cache_dir, rebuild_index, progress)
        self.shard_sizes: list[int] = [len(index) for index in self._indexes]
        self._starts = [0]
        for size in self.shard_sizes:
            self._starts.append(self._starts[-1] + size)

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
        """Digest of shard basenames and sample counts, to tell a checkpoint it is resuming another dataset."""
        layout = [[os.path.basename(s), n] for s, n in zip(self.shards, self.shard_sizes)]
        return hashlib.sha256(json.dumps(layout).encode("utf-8", "surrogateescape")).hexdigest()[:16]

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

    def __getitem__(self, index: int) -> dict[str, Any] | tuple[Any, ...]:
        shard_no, local = self._locate(index)
        shard, shard_index = self.shards[shard_no], self._indexes[shard_no]
        key, members = shard_index.key(local), shard_index.members(local)
        chosen = self._select(shard, key, [m.suffix for m in members])
        wanted = [m for m in members if chosen is None or m.suffix in chosen]
        sample: dict[str, Any] = {"__key__": key, "__url__": shard, "__local_path__": shard}
        sample.update(self._files.get(shard, shard_index).read_sample(wanted, key))
        if self._decoder is not None:
            sample = self._decoder(sample)
        return sample if chosen is None else tuple(sample[name] for name in chosen)

    def __repr__(self) -> str:
        name, shards = type(self).__name__, len(self.shards)
        return f"{name}({shards} shards, {len(self)} samples, fingerprint={self.fingerprint()})"
