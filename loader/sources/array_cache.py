"""Arrays computed once from a large input and kept on disk as memory-mapped .npy files, for the sources whose
construction is O(N) (`TokenBudgetBatches`' bucket index, `PackedSource(keep=)`'s kept documents).

Why a key and digests: a restart must never reuse arrays made from other inputs or parameters, nor arrays damaged
since. Each entry is a JSON header, `NAME-KEY.json` (KEY: a digest of the inputs' own digests and the parameters,
written out in full in the header and compared whole), and one `NAME-KEY.FIELD.npy` per array, whose SHA-256 the
header holds and which is checked on every load: a truncated, edited or swapped file fails the check, is named in a
warning and rebuilt. Files are written to a temporary name and renamed (the header last), so a crashed or
concurrent writer never leaves a torn entry. Nothing is unpickled (`allow_pickle=False`); a file crafted with
matching digests is trusted, as the inputs themselves are: keep the cache where only the job writes.

Why reads go through the file, not the map: a pass over a memory-mapped array through its map leaves every page
resident in the process (its RSS grows to the file's size); `chunks` reads a mapped array's file with `pread` into
a bounded buffer instead, so a process's memory follows what it maps and touches, not N.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeGuard

import numpy as np

FORMAT = 1  # the layout of an entry: a key of another format is another entry
CHUNK = 1 << 22  # entries read per step: bounded temporaries for memory-mapped arrays


class CacheWarning(UserWarning):
    """A cache entry that could not be used (damaged, or of other inputs) or written: rebuilt or kept in memory."""


def is_mapped(array: Any) -> TypeGuard[np.memmap]:
    """Whether `array` is a whole memory-mapped file (not a view of one, whose offset its attributes do not tell)
    whose file holds its content (not a copy-on-write map, whose writes stay in the process)."""
    return (
        isinstance(array, np.memmap)
        and isinstance(array.base, mmap.mmap)
        and array.flags.c_contiguous
        and array.mode != "c"
    )


def chunks(array: np.ndarray, size: int = CHUNK) -> Iterator[tuple[int, np.ndarray]]:
    """(first index, entries) of an array in chunks of `size` rows; a memory-mapped array read from its file."""
    if is_mapped(array):
        row = int(np.prod(array.shape[1:]))
        with open(str(array.filename), "rb") as f:
            for low in range(0, len(array), size):
                count = min(size, len(array) - low)
                f.seek(array.offset + low * row * array.itemsize)
                chunk = np.fromfile(f, array.dtype, count * row).reshape(-1, *array.shape[1:])
                if len(chunk) != count:
                    raise ValueError(f"truncated ({len(chunk)} of {count} entries read at {low})")
                yield low, chunk
        return
    for low in range(0, len(array), size):
        yield low, np.asarray(array[low : low + size])


def digest(array: np.ndarray) -> str:
    """SHA-256 of the array's bytes as stored (read in chunks)."""
    hashed = hashlib.sha256()
    for _, chunk in chunks(array):
        hashed.update(np.ascontiguousarray(chunk).tobytes())
    return hashed.hexdigest()


def _paths(directory: str, name: str, key: dict) -> tuple[str, Callable[[str], str]]:
    tag = hashlib.sha256(json.dumps({"format": FORMAT, **key}, sort_keys=True).encode()).hexdigest()[:16]
    stem = os.path.join(directory, f"{name}-{tag}")
    return f"{stem}.json", lambda field: f"{stem}.{field}.npy"


def _atomic(path: str, write: Callable[[Any], None]) -> None:
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _save(f: Any, array: np.ndarray) -> None:
    np.save(f, array, allow_pickle=False)


def load(directory: str, name: str, key: dict, fields: dict[str, np.dtype]) -> dict[str, np.ndarray] | None:
    """The arrays of entry (`name`, `key`), memory-mapped read-only, or None where there is none; an entry that
    fails a check (its header's key, a field's dtype, shape or digest) is named in a CacheWarning and None is
    returned, so that the caller rebuilds it."""
    header_path, path_of = _paths(directory, name, key)
    if not os.path.exists(header_path):
        return None
    path = header_path
    try:
        with open(header_path, encoding="utf-8") as f:
            header = json.load(f)
        if not isinstance(header, dict) or header.get("key") != {"format": FORMAT, **key}:
            raise ValueError("its key is not this one (another input or parameters, or edited)")
        arrays = {}
        for field, dtype in fields.items():
            path = path_of(field)
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            if array.dtype != dtype or array.ndim not in (1, 2):
                raise ValueError(f"{array.dtype} of shape {array.shape}, not {np.dtype(dtype)}")
            if digest(array) != header.get("digests", {}).get(field):
                raise ValueError("its content does not match the digest its header holds (damaged or edited)")
            arrays[field] = array
        return arrays
    except (OSError, ValueError, json.JSONDecodeError) as err:
        warnings.warn(f"the cached {name} is not usable, rebuilding it: {path}: {err}", CacheWarning, stacklevel=3)
        return None


def store(directory: str, name: str, key: dict, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write entry (`name`, `key`) atomically (the arrays, then the header that names their digests) and return its
    arrays memory-mapped; where the directory cannot be written, a CacheWarning says so and the arrays are returned
    as they are."""
    header_path, path_of = _paths(directory, name, key)
    try:
        os.makedirs(directory, exist_ok=True)
        for field, array in arrays.items():
            _atomic(path_of(field), partial(_save, array=array))
        digests = {field: digest(array) for field, array in arrays.items()}
        header = json.dumps({"key": {"format": FORMAT, **key}, "digests": digests}, indent=1).encode()
        _atomic(header_path, lambda f: f.write(header))
    except OSError as err:
        warnings.warn(f"could not cache the {name} in {directory} ({err}): kept in memory", CacheWarning, stacklevel=3)
        return arrays
    return {field: np.load(path_of(field), mmap_mode="r", allow_pickle=False) for field in arrays}


def cached(
    directory: str | os.PathLike | None,
    name: str,
    key: dict,
    fields: dict[str, np.dtype],
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], bool]:
    """The arrays `fields` (name: dtype) of (`name`, `key`): loaded from `directory` where a valid entry is there,
    else built and stored there (None: built, kept in memory). Also whether they were built."""
    if directory is None:
        return build(), True
    directory = os.fspath(directory)
    arrays = load(directory, name, key, fields)
    if arrays is not None:
        return arrays, False
    return store(directory, name, key, build()), True


class Mapped:
    """A memory-mapped array as it travels to a spawned worker: its file and layout, mapped again there (a
    `np.memmap` pickles its whole content)."""

    def __init__(self, array: np.memmap) -> None:
        self.filename, self.offset, self.dtype, self.shape = str(array.filename), array.offset, array.dtype, array.shape

    def open(self) -> np.ndarray:
        return np.memmap(self.filename, self.dtype, "r", self.offset, self.shape)


def to_state(state: dict) -> dict:
    """`state` with its memory-mapped arrays as `Mapped` (for `__getstate__`)."""
    return {k: Mapped(v) if is_mapped(v) else v for k, v in state.items()}


def from_state(state: dict) -> dict:
    """`state` with its `Mapped` arrays mapped again (for `__setstate__`)."""
    return {k: v.open() if isinstance(v, Mapped) else v for k, v in state.items()}
