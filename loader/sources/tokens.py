"""Pre-tokenized token files as a map-style dataset of packed sequences, memory-mapped.

Why map-style: sample i is the window of seq_len + 1 tokens starting at token i * seq_len of the files'
concatenated stream, so any rank can load any sample and the loader's exactly-once progress applies unchanged.
The files are what LM preprocessing writes: raw token arrays (`.bin`: nanoGPT, Megatron), `.npy` arrays, and
LitData chunk directories (`index.json` with TokensLoader chunks). Construction reads headers and sizes only; each
process maps the files on first use (checking that each is still the one measured); every read from a map first
checks that the file still has the size measured (a mapped page past a file's end is a SIGBUS, which kills the
process), and every batch checks each file it read again after the reads, so a file that changed is never served.
"""

from __future__ import annotations

import glob
import hashlib
import json
import mmap
import os
import resource
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils.data
from numpy.typing import ArrayLike, DTypeLike

from loader.core.checks import check_positive_int
from loader.core.rows import Rows
from loader.sources.tar_index import file_state

__all__ = ["TokenFileError", "TokenSource"]

TOKEN_DTYPES = ("uint16", "uint32", "int32")
_LITDATA_DTYPES = {"no_header_tensor:15": "int32", "no_header_tensor:16": "int32", "no_header_tensor:20": "uint16"}
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequences, documents + 1 (after the magic)
_MEGATRON_DTYPES = {4: "int32", 8: "uint16"}  # megatron.core.datasets.indexed_dataset.DType codes of token dtypes

Files = str | os.PathLike | Sequence[str | os.PathLike]
GATHER_ROWS = 8  # from this many samples of one file on, one strided gather beats a copy per sample
DIGEST_BLOCK = 4096  # bytes per block a file's content digest reads
DIGEST_BLOCKS = 1024  # blocks a fingerprint reads over all its files (4 MiB): 2 to 64 per file
NAMED_GROUPS = 16  # a fingerprint carries a 4-hex tag per group of files (one file each up to 16), to name them


class TokenFileError(ValueError):
    """A token or offsets file that cannot be read as declared, or that changed after the source measured it."""


def _file_state(path: str) -> tuple[int, int, int, int]:
    """Size, mtime, inode and ctime: a rewrite in place with its mtime restored still moves the ctime (so do a chmod
    and a new hard link, refused too: nothing tells them apart without reading the whole file)."""
    st = os.stat(path)
    return (*file_state(st), st.st_ino, st.st_ctime_ns)


def _content_digest(path: str, size: int, blocks: int) -> str:
    """Digest of `blocks` evenly spaced blocks of a file, its first and last included (the whole file when that
    is smaller): what a rewrite of the same size (other tokens, other document starts) changes, at a cost bounded
    whatever the file's size: 64 reads of 4 KiB for the 8 GB offsets of 1e9 documents. A change confined to the
    bytes between the blocks goes unseen (a stat would see it, but a copy of the files to another disk changes
    every stat and must resume)."""
    digest = hashlib.blake2b(digest_size=16)
    positions = (
        range(0, size, DIGEST_BLOCK)
        if size <= blocks * DIGEST_BLOCK
        else [k * (size - DIGEST_BLOCK) // (blocks - 1) for k in range(blocks)]
    )
    with open(path, "rb") as f:
        for position in positions:
            digest.update(os.pread(f.fileno(), DIGEST_BLOCK, position))
    return digest.hexdigest()


def _digest(layout: Any) -> str:
    return hashlib.sha256(json.dumps(layout).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _changed_files(saved: str, current: str, groups: Sequence[Sequence[str]]) -> str | None:
    """The files of each group whose tag differs between two fingerprints of the form DIGEST-TAGS (`groups`: the
    paths each tag of `current` covers), as a refusal names them; None where the tags do not tell."""
    tags, mine = saved.partition("-")[2], current.partition("-")[2]
    if len(tags) != len(mine) or len(mine) != 4 * len(groups):
        return None
    changed = [
        path for k, group in enumerate(groups) if tags[4 * k : 4 * k + 4] != mine[4 * k : 4 * k + 4] for path in group
    ]
    if not changed:
        return None
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return (
        f"{', '.join(changed[:3])}{more} changed since the checkpoint was saved (size or content: the tokens or "
        "document offsets were rewritten), so its positions would name other samples"
    )


def _map_limit() -> int:
    """Files kept mapped per process: a quarter of the soft limit on open files (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 16 if soft == resource.RLIM_INFINITY else max(16, soft // 4)


class _Maps:
    """This process's mapped token (and offsets) files, at most `limit`; past it, the oldest map is let go.

    Why a bound: a map holds a file descriptor (mmap keeps a duplicate of the one it mapped), so a source over more
    files than the open-file limit (a LitData directory of thousands of chunks) would fail with EMFILE hours into
    a run, once enough files had been read. A map let go is unmapped when its last array goes (numpy views keep
    it), so a batch still copying from it is never cut off; reading the file again maps it again. Oldest first,
    not least recently used: a hit then costs nothing here, and a file in use that is let go is mapped again once
    per `limit` new maps."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._mapped: deque[_Mapped] = deque()

    def __len__(self) -> int:
        return len(self._mapped)

    def add(self, mapped: _Mapped) -> None:
        with self._lock:
            self._mapped.append(mapped)
            while len(self._mapped) > self.limit:
                self._mapped.popleft().unmap()

    def forked(self) -> None:
        """In a forked child: a new lock (another thread of the parent may have held this one at the fork)."""
        self._lock = threading.Lock()


_MAPS = _Maps(_map_limit())  # forked workers inherit the maps (valid there); spawned ones start empty
os.register_at_fork(after_in_child=lambda: _MAPS.forked())  # the current _MAPS, looked up then


@dataclass
class _Mapped:
    """`count` values of `dtype` at byte `offset` of a file (up to its end unless `ends_file` is False), mapped
    on first use in each process, one of the process's bounded set of maps (`_MAPS`); pickles without the map, so
    spawned workers map the file themselves."""

    path: str
    offset: int
    count: int
    dtype: np.dtype
    ends_file: bool = True
    state: tuple[int, int, int, int] = field(init=False)
    _map: tuple[mmap.mmap, np.ndarray] | None = field(default=None, init=False, repr=False)  # one attribute: an
    # unmap() by another thread never leaves a map without its array
    _derived: np.ndarray | None = field(default=None, init=False, repr=False)  # a view kept as long as the map

    def __post_init__(self) -> None:
        self.state = _file_state(self.path)
        end = self.offset + self.count * self.dtype.itemsize
        if (self.state[0] != end) if self.ends_file else (self.state[0] < end):
            raise TokenFileError(
                f"{self.path}: {self.state[0]} bytes, but {self.count} {self.dtype.name} values after byte "
                f"{self.offset} end at byte {end}; the file is truncated, has trailing bytes, or is not of this dtype"
            )

    def _changed(self, change: str) -> TokenFileError:
        return TokenFileError(
            f"{self.path} changed after the TokenSource was built ({change}): its samples would no longer be the "
            "ones progress was recorded for. Build the TokenSource again and compare its fingerprint() with the "
            "checkpoint's before resuming"
        )

    def check_unchanged(self) -> None:
        """Refuse to serve tokens once the file differs from what the source measured (size, mtime, inode, ctime)."""
        try:
            now = _file_state(self.path)
        except FileNotFoundError:
            raise TokenFileError(f"{self.path} disappeared after the TokenSource was built; restore it") from None
        if now != self.state:
            raise self._changed(
                f"size, mtime_ns, inode, ctime_ns {self.state} -> {now}; the ctime alone moves "
                "on a write with the mtime restored, a chmod or a new hard link"
            )

    def _check_size(self, size: int) -> None:
        if size != self.state[0]:
            raise self._changed(f"{self.state[0]} -> {size} bytes under this process's map of it")

    def array(self) -> np.ndarray:
        """The values, mapped on first use; each call first checks that the file still has the size measured, by
        an fstat of the map (~0.3 us), as reading a mapped page past a file's end (a file truncated while mapped)
        is a SIGBUS, which kills the process: Python cannot catch it. Only a truncation racing the copy that
        follows the check can still fault; the check after the copy (`check_unchanged`) catches other changes."""
        mapped = self._map
        if mapped is not None:
            self._check_size(mapped[0].size())
            return mapped[1]
        self.check_unchanged()
        if self.count == 0:
            return np.empty(0, self.dtype)
        with open(self.path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._check_size(len(buffer))  # changed since check_unchanged(): np.frombuffer would fail unclearly
        mapped = self._map = buffer, np.frombuffer(buffer, self.dtype, self.count, self.offset)
        _MAPS.add(self)
        return mapped[1]

    def derived(self, make: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """`make(array)`, a view of the map (a TokenSource's windows), made once per map and let go with it."""
        array = self.array()
        view = self._derived
        if view is None or view.base is not array:
            view = self._derived = make(array)
        return view

    def unmap(self) -> None:
        self._map = self._derived = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None, "_derived": None}


def _token_dtype(value: DTypeLike, where: str) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in TOKEN_DTYPES:
        raise ValueError(f"{where}: token dtype must be one of {TOKEN_DTYPES}, got {value!r}")
    return dtype.newbyteorder("<")


def _npy(path: str) -> tuple[int, np.dtype, int]:
    """(length, dtype, data offset) of a 1-D .npy file, from its header."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
        except ValueError as err:
            raise TokenFileError(f"{path}: not a .npy file ({err})") from None
        offset = f.tell()
    if len(shape) != 1:
        raise TokenFileError(f"{path}: expected a 1-D array, found shape {shape}")
    return shape[0], dtype, offset


def _check_declared(path: str, found: np.dtype, given: np.dtype | None) -> None:
    if given is not None and given != found:
        raise TokenFileError(
            f"{path} declares {found.name} tokens but dtype={given.name!r} was given: pass the "
            "matching dtype, or none (this format says it)"
        )


def _npy_tokens(path: str, dtype: np.dtype | None) -> _Mapped:
    count, found, offset = _npy(path)
    found = _token_dtype(found, path)
    _check_declared(path, found, dtype)
    return _Mapped(path, offset, count, found)


def _raw_tokens(path: str, dtype: np.dtype | None) -> _Mapped:
    if dtype is None:
        raise ValueError(
            f"{path}: a raw token file has no header saying its dtype: pass dtype='uint16' (nanoGPT; "
            "vocabularies below 65536) or dtype='uint32'"
        )
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise TokenFileError(
            f"{path}: {size} bytes is not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each); the file is truncated or dtype= is wrong"
        )
    return _Mapped(path, 0, size // dtype.itemsize, dtype)


def _litdata_tokens(directory: str, dtype: np.dtype | None) -> list[_Mapped]:
    """The chunks of a LitData directory written with TokensLoader, in the order its index.json lists them. A chunk
    is a uint32 item count, count + 1 uint32 offsets, then its `dim` tokens."""
    index_path = os.path.join(directory, "index.json")
    with open(index_path) as f:
        index = json.load(f)
    config = index.get("config") or {}
    formats = config.get("data_format") or []
    if config.get("compression") or len(formats) != 1 or formats[0] not in _LITDATA_DTYPES:
        raise TokenFileError(
            f"{index_path}: TokenSource reads uncompressed LitData chunks of 1-D token tensors (data_format one of "
            f"{sorted(_LITDATA_DTYPES)}), found data_format={formats}, compression={config.get('compression')!r}"
        )
    found = _token_dtype(_LITDATA_DTYPES[formats[0]], index_path)
    _check_declared(index_path, found, dtype)
    return [
        _Mapped(os.path.join(directory, c["filename"]), (2 + c["chunk_size"]) * 4, c["dim"], found)
        for c in index["chunks"]
    ]


def _check_named_ids(files: list[_Mapped], eos_id: int | None, vocab_size: int | None) -> None:
    """The ids the caller named must be ones the files' tokens can hold: a raw file's dtype is only what dtype=
    says, and a uint32 file read as uint16 holds a whole number of tokens all the same."""
    named = [] if eos_id is None else [("eos_id", eos_id, eos_id)]
    if vocab_size is not None:
        if eos_id is not None and eos_id >= vocab_size:
            raise ValueError(f"eos_id={eos_id} is not an id below vocab_size={vocab_size}")
        named.append(("vocab_size", vocab_size, vocab_size - 1))
    narrowest = min(files, key=lambda f: np.iinfo(f.dtype).max)
    limit = np.iinfo(narrowest.dtype).max
    for name, value, largest in named:
        if largest > limit:
            raise TokenFileError(
                f"{narrowest.path} holds {narrowest.dtype.name} tokens (ids up to {limit}), which {name}={value} "
                f"does not fit: the files hold wider tokens (pass the dtype= they were written with, e.g. "
                f"'uint32'), or {name} is wrong"
            )


def _expand(files: Files, what: str) -> list[str]:
    """Paths in order: a glob sorted, a list as given, a LitData directory as itself."""
    if isinstance(files, (str, os.PathLike)):
        pattern = os.fspath(files)
        if os.path.isdir(pattern) and not os.path.exists(os.path.join(pattern, "index.json")):
            raise ValueError(
                f"{pattern} is a directory without a LitData index.json: pass a glob of its {what}, "
                f"e.g. {os.path.join(pattern, '*.bin')!r}"
            )
        paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    else:
        paths = [os.fspath(p) for p in files]
    if not paths:
        raise ValueError(f"no {what} match {files!r}")
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what[:-1]} {path} does not exist")
    return paths


def _token_files(paths: list[str], dtype: np.dtype | None) -> list[_Mapped]:
    files: list[_Mapped] = []
    for path in paths:
        if os.path.isdir(path):
            files += _litdata_tokens(path, dtype)
        else:
            files.append((_npy_tokens if path.endswith(".npy") else _raw_tokens)(path, dtype))
    return files


class _DocumentStarts:
    """Where documents start in one token file, from its offsets file: a `.npy` of increasing token offsets, or
    Megatron's `.idx` (sequence pointers in bytes, and the document index into the sequences). Read by binary
    search on the mapped arrays: O(log documents) per sample, nothing loaded."""

    documents: _Mapped | None  # Megatron's document index into its sequences; None for a .npy

    def __init__(self, path: str, tokens: _Mapped):
        self.path, self.itemsize, self.documents = path, tokens.dtype.itemsize, None
        if path.endswith(".idx"):
            self._megatron(path, tokens)
        else:
            count, dtype, offset = _npy(path)
            if dtype.kind not in "iu":
                raise TokenFileError(f"{path}: document offsets must be integers, found {dtype}")
            self.starts = _Mapped(path, offset, count, dtype)
            starts = self.starts.array()
            if count and (int(starts[0]) < 0 or int(starts[-1]) >= tokens.count):
                raise TokenFileError(
                    f"{path}: document offsets must lie in [0, {tokens.count}) (the tokens of "
                    f"{tokens.path}), found {int(starts[0])} ... {int(starts[-1])}"
                )

    def _megatron(self, path: str, tokens: _Mapped) -> None:
        with open(path, "rb") as f:
            magic, header = f.read(len(_MEGATRON_MAGIC)), f.read(_MEGATRON_HEADER.size)
        if magic != _MEGATRON_MAGIC or len(header) != _MEGATRON_HEADER.size:
            raise TokenFileError(f"{path}: not a Megatron .idx file (no MMIDIDX header)")
        version, code, sequences, documents = _MEGATRON_HEADER.unpack(header)
        if version != 1 or _MEGATRON_DTYPES.get(code) != tokens.dtype.name:
            raise TokenFileError(
                f"{path}: version {version}, dtype code {code}; expected version 1 and the dtype "
                f"of {tokens.path} ({tokens.dtype.name})"
            )
        pointers_at = len(_MEGATRON_MAGIC) + _MEGATRON_HEADER.size + 4 * sequences  # after the int32 lengths
        self.starts = _Mapped(path, pointers_at, sequences, np.dtype("<i8"), ends_file=False)
        self.documents = _Mapped(path, pointers_at + 8 * sequences, documents, np.dtype("<i8"))
        if sequences and int(self.starts.array()[-1]) >= tokens.count * self.itemsize:
            raise TokenFileError(f"{path} points past the end of {tokens.path}: it describes another file")

    def within(self, low: int, high: int) -> np.ndarray:
        """Token offsets in [low, high) where a document starts."""
        starts = self.starts.array()
        if self.documents is None:
            return starts[np.searchsorted(starts, low) : np.searchsorted(starts, high)]
        documents = self.documents.array()
        first, last = np.searchsorted(starts, [low * self.itemsize, high * self.itemsize])
        lo, hi = np.searchsorted(documents, [first, last])
        return starts[documents[lo:hi]] // self.itemsize

    def check_unchanged(self) -> None:
        self.starts.check_unchanged()


class TokenSource(torch.utils.data.Dataset):
    """Packed LM sequences over pre-tokenized files: sample i is the int64 tensor of the seq_len + 1 tokens that
    start at token i * seq_len of the files' concatenated stream (inputs x[:-1], targets x[1:]), across file
    boundaries; len = (total tokens - 1) // seq_len.

    Args:
        files: a glob (files sorted by name), a list of paths (in that order), one path, or a LitData directory
            (its index.json's chunks). `.npy` files and LitData chunks carry their dtype; raw files need `dtype`.
        seq_len: tokens per sample, plus the one target token that overlaps the next sample.
        dtype: "uint16" or "uint32" (or "int32") for raw files; checked against the header of the others.
        eos_id: documents end with this token: samples become dicts {"tokens", "doc_ids"}.
        vocab_size: token ids are below it: every token served is checked (a batch holding another is refused).
        doc_offsets: one offsets file per token file, same order (a glob, sorted, or a list): a `.npy` of the
            token offsets where documents start in that file, or Megatron's `.idx`. Samples become dicts as with
            `eos_id`; a file boundary is a document boundary too.

    `doc_ids[t]` numbers the document of token t within the sample (0 for the first one): attend from q to k only
    where k <= q and doc_ids[k] == doc_ids[q]. Identity: `sample_key(i)` = (file, token offset in that file).

    A raw file has no header, so a wrong `dtype` is refused only where something contradicts it: a size that is not
    a whole number of tokens, a Megatron `.idx` of another dtype, `.npy` document offsets past the file's tokens,
    an `eos_id` or `vocab_size` the dtype cannot hold, and with `vocab_size` a token served that is no id below it
    (a uint16 file read as uint32 pairs its tokens into ids of 65536 and more). Nothing contradicts a uint32 file of
    ids below 65536 read as uint16 without a Megatron `.idx`: every other token is 0, a valid id.
    """

    _documents: list[_DocumentStarts] | None  # one per token file, with doc_offsets=
    _fingerprint: str | None  # computed at the first fingerprint()
    _groups: list[list[str]]  # the files each tag of the fingerprint covers

    def __init__(
        self,
        files: Files,
        seq_len: int,
        dtype: str | np.dtype | None = None,
        *,
        eos_id: int | None = None,
        doc_offsets: Files | None = None,
        vocab_size: int | None = None,
    ) -> None:
        check_positive_int("seq_len", seq_len)
        if vocab_size is not None:
            check_positive_int("vocab_size", vocab_size)
        if eos_id is not None and doc_offsets is not None:
            raise ValueError("pass eos_id= or doc_offsets= for document boundaries, not both")
        if eos_id is not None and (not isinstance(eos_id, int) or eos_id < 0):
            raise ValueError(f"eos_id must be a non-negative int token id, got {eos_id!r}")
        self.seq_len, self.eos_id, self.vocab_size, self._span = seq_len, eos_id, vocab_size, seq_len + 1
        declared = None if dtype is None else _token_dtype(dtype, "dtype=")
        self._files = _token_files(_expand(files, "token files"), declared)
        counts = np.array([f.count for f in self._files], dtype=np.int64)
        self._starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.tokens = int(self._starts[-1])
        self._len = max(0, (self.tokens - 1) // seq_len)
        if not self._len:
            raise ValueError(
                f"{len(self._files)} token file(s) hold {self.tokens} tokens: too few for one sample of "
                f"seq_len + 1 = {seq_len + 1}"
            )
        _check_named_ids(self._files, eos_id, vocab_size)
        self._documents, self._fingerprint, self._groups = None, None, []
        if doc_offsets is not None:
            paths = _expand(doc_offsets, "offsets files")
            if len(paths) != len(self._files):
                raise ValueError(
                    f"doc_offsets: {len(paths)} offsets files for {len(self._files)} token files; pass "
                    "one per token file, in the same order"
                )
            self._documents = [_DocumentStarts(p, f) for p, f in zip(paths, self._files)]

    @property
    def files(self) -> list[str]:
        return [f.path for f in self._files]

    def __len__(self) -> int:
        return self._len

    def _locate(self, indices: Sequence[int]) -> tuple[list[int], list[int]]:
        """(file number, token offset in that file) of the first token of each sample, as Python ints: a batch is
        a few samples, and per-sample Python is cheaper than numpy's per-call cost at that size."""
        if len(indices) and (min(indices) < 0 or max(indices) >= self._len):
            bad = next(i for i in indices if not 0 <= i < self._len)
            raise IndexError(f"sample index {bad} out of range for {self._len} samples")
        if len(self._files) == 1:
            return [0] * len(indices), [int(i) * self.seq_len for i in indices]
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        files = np.searchsorted(self._starts, starts, side="right") - 1
        return files.tolist(), (starts - self._starts[files]).tolist()

    def sample_key(self, index: int) -> tuple[str, int]:
        """(token file, token offset in it): the identity of sample `index`."""
        (file,), (offset,) = self._locate([index])
        return self._files[file].path, offset

    def _read(self, out: np.ndarray, file: int, offset: int, touched: set[int]) -> None:
        """Fill `out` with the tokens from (file, offset) on, continuing into the next files."""
        filled = 0
        while filled < len(out):
            touched.add(file)
            piece = self._files[file].array()[offset : offset + len(out) - filled]
            out[filled : filled + len(piece)] = piece
            filled, file, offset = filled + len(piece), file + 1, 0

    def _doc_ids(self, tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Per token, its document's number within the sample: boundaries after each EOS, or at each offset."""
        doc_ids = np.zeros(tokens.shape, dtype=np.int64)
        if self.eos_id is not None:
            np.cumsum(tokens[:, :-1] == self.eos_id, axis=1, out=doc_ids[:, 1:])
            return doc_ids
        for row, start in enumerate(starts.tolist()):
            doc_ids[row, self.document_starts(start + 1, start + self._span) - start] = 1
            np.cumsum(doc_ids[row], out=doc_ids[row])
        return doc_ids

    def read_tokens(self, low: int, high: int) -> np.ndarray:
        """Tokens [low, high) of the files' concatenation as int64, checked as a batch is (files unchanged after
        the read, ids below vocab_size): the read that packing (`loader.sources.packing`) builds its rows from."""
        if not 0 <= low <= high <= self.tokens:
            raise IndexError(f"tokens [{low}, {high}) out of range for {self.tokens} tokens")
        touched: set[int]  # the files read
        out, touched = np.empty(high - low, dtype=np.int64), set()
        if high > low:
            file = int(np.searchsorted(self._starts, low, side="right")) - 1
            self._read(out, file, low - int(self._starts[file]), touched)
        for file in touched:
            self._files[file].check_unchanged()
        if self.vocab_size is not None:
            self._check_ids(out[None], [low])
        return out

    def document_starts(self, low: int, high: int) -> np.ndarray:
        """Token offsets of the concatenation in [low, high) where a document starts (int64, ascending): 0, every
        token after an EOS, or the offsets files' starts and every file's first token. O(log documents) with
        offsets files (binary search in their maps); O(high - low) with eos_id (the tokens are read)."""
        low, high = max(low, 0), min(high, self.tokens)
        if high <= low:
            return np.zeros(0, np.int64)
        if self.eos_id is not None:
            before = max(low - 1, 0)
            ends = np.flatnonzero(self.read_tokens(before, high - 1) == self.eos_id) + before + 1
            return np.concatenate(([0] if low == 0 else [], ends)).astype(np.int64)
        if self._documents is None:
            raise ValueError("this TokenSource has no document boundaries: pass eos_id= or doc_offsets=")
        found: list[ArrayLike] = []
        file = int(np.searchsorted(self._starts, low, side="right")) - 1
        while file < len(self._files) and self._starts[file] < high:
            first = int(self._starts[file])
            documents = self._documents[file]
            found += [[first]] if first >= low else []  # a file's first token starts a document
            found.append(documents.within(max(low - first, 1), high - first) + first)
            documents.check_unchanged()  # after the read, as for tokens: a change during it is caught too
            file += 1
        return np.concatenate(found).astype(np.int64)

    def document_start(self, token: int) -> int:
        """Where the document holding `token` starts: the last document start at or before it."""
        step = 1 << 16
        low = token + 1
        while low > 0:  # with eos_id, documents are found by reading back: O(the document's length)
            low, high = max(low - step, 0), low
            starts = self.document_starts(low, high)
            if len(starts):
                return int(starts[-1])
            step *= 2
        return 0

    def describe_token(self, token: int) -> str:
        """A token offset of the concatenation as FILE:OFFSET, as the audit prints it."""
        file = int(np.searchsorted(self._starts, token, side="right")) - 1
        return f"{os.path.basename(self._files[file].path)}:{token - int(self._starts[file])}"

    def _windows(self, file: int) -> np.ndarray:
        """The file's whole samples as rows of a strided view of its map (no copy): row r starts at the file's first
        sample start plus r * seq_len, so a batch inside one file is gathered by one fancy index. Kept with the map
        (`_Mapped.derived`): kept here, it would keep the map, and its descriptor, past the bound."""
        phase, seq_len, span = int(-self._starts[file] % self.seq_len), self.seq_len, self._span

        def windows(tokens: np.ndarray) -> np.ndarray:
            rows, itemsize = max(0, (len(tokens) - phase - span) // seq_len + 1), tokens.dtype.itemsize
            return np.ndarray((rows, span), tokens.dtype, tokens, phase * itemsize, (seq_len * itemsize, itemsize))

        return self._files[file].derived(windows)

    def _fill(self, out: np.ndarray, rows: Sequence[int], indices: Sequence[int]) -> None:
        """Write sample indices[k] into row rows[k] of `out` (int64, seq_len + 1 wide; a range of rows is a slice),
        then check every file read, once each, after the reads (a change while reading is caught too): the one read
        path of this source and of a Mixture of TokenSources filling one batch. GATHER_ROWS samples or more inside
        one file: one fancy index into its windows; else a copy per sample (fewer numpy calls)."""
        files, offsets = self._locate(indices)
        if not offsets:
            return
        file, span = files[0], self._span
        target = slice(rows.start, rows.stop) if type(rows) is range and rows.step == 1 else rows
        if (
            len(files) >= GATHER_ROWS
            and files.count(file) == len(files)
            and max(offsets) + span <= self._files[file].count
        ):
            out[target] = self._windows(file)[np.asarray(offsets) // self.seq_len]
            touched = {file}
        else:
            touched = set(files)
            arrays = {f: self._files[f].array() for f in touched}  # a map lookup per file, not per sample
            for row, file, offset in zip(rows, files, offsets):
                tokens = arrays[file]
                if offset + span <= len(tokens):  # the usual sample: inside one file
                    out[row] = tokens[offset : offset + span]
                else:
                    self._read(out[row], file, offset, touched)
        for file in touched:
            self._files[file].check_unchanged()
        if self.vocab_size is not None:
            self._check_ids(out[target], [int(i) * self.seq_len for i in indices])

    def _check_ids(self, tokens: np.ndarray, firsts: Sequence[int]) -> None:
        """Refuse rows holding a token that is no id below vocab_size (row r starts at token firsts[r] of the
        concatenation), naming its file and offset. One max() of the unsigned view checks both ends (a negative
        int32 id wraps to a huge one): ~4 us for 8 x 2049 tokens."""
        ids = tokens.view(np.uint64)
        if ids.max() < self.vocab_size:
            return
        assert self.vocab_size is not None, "checked only with a vocab_size"
        row, column = np.argwhere(ids >= self.vocab_size)[0].tolist()
        token = int(firsts[row]) + column
        file = int(np.searchsorted(self._starts, token, side="right")) - 1
        path, dtype = self._files[file].path, self._files[file].dtype.name
        raise TokenFileError(
            f"{path}: token {token - int(self._starts[file])} is {int(tokens[row, column])}, not an id below "
            f"vocab_size={self.vocab_size}: the file does not hold {dtype} tokens of this vocabulary (a raw file "
            "is read as the dtype= given: pass the one it was written with), or vocab_size is wrong"
        )

    @property
    def plain(self) -> bool:
        """Whether samples are bare token tensors (no eos_id or doc_offsets, whose samples are dicts)."""
        return self.eos_id is None and self._documents is None

    def _tokens(self, indices: Sequence[int]) -> torch.Tensor:
        """The int64 tensor (len(indices), seq_len + 1) of these samples' tokens."""
        out = np.empty((len(indices), self._span), dtype=np.int64)
        self._fill(out, range(len(indices)), indices)
        return torch.from_numpy(out)

    def batch_reader(self) -> Callable[[Sequence[int]], torch.Tensor] | None:
        """The batch of plain samples as the tensor that the loader's collate makes of `__getitems__`'s Rows, read
        without the Rows (`loader.core.rows.batch_reader`); None for dict samples, and where a subclass has its own
        `__getitems__`, whose batches this would not be."""
        return self._tokens if self.plain and type(self).__getitems__ is TokenSource.__getitems__ else None

    def __getitems__(self, indices: Sequence[int]) -> list:
        """A batch in one call (torch's fetcher and Mixture use it): one check per file the batch touches, not per
        sample, and one tensor whose rows are the samples: plain samples come as its `Rows`, which the loader's
        collate hands on as that tensor instead of stacking a copy of it."""
        batch = self._tokens(indices)
        if self.plain:
            return Rows(batch)
        tokens = batch.unbind(0)
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        doc_ids = torch.from_numpy(self._doc_ids(batch.numpy(), starts)).unbind(0)
        return [{"tokens": t, "doc_ids": d} for t, d in zip(tokens, doc_ids)]

    def __getitem__(self, index: int) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def _layout(self) -> dict[str, Any]:
        return {
            "files": [[os.path.basename(f.path), f.count] for f in self._files],
            "dtype": self._files[0].dtype.name,
            "seq_len": self.seq_len,
            "eos_id": self.eos_id,
            "doc_offsets": None if self._documents is None else [os.path.basename(d.path) for d in self._documents],
        }

    def fingerprint(self) -> str:
        """DIGEST-TAGS: a digest of the files' names, token counts, sizes and sampled content (`_content_digest`:
        at most 4 MiB read over all files), dtype, seq_len and document boundaries, and a 4-hex tag per group of
        files (`NAMED_GROUPS`), so that a checkpoint of another token stream, or of files rewritten since, even in
        the same size, is refused naming the files, instead of resumed at other samples. Computed once, after
        checking that the files read are still the ones the source measured (never per batch)."""
        if self._fingerprint is None:
            mapped = [*self._files, *(d.starts for d in self._documents or ())]
            blocks = max(2, min(64, DIGEST_BLOCKS // len(mapped)))
            content = []
            for file in mapped:
                content.append(
                    [os.path.basename(file.path), file.state[0], _content_digest(file.path, file.state[0], blocks)]
                )
                file.check_unchanged()  # the content read is that of the file measured
            groups = [g.tolist() for g in np.array_split(np.arange(len(mapped)), min(len(mapped), NAMED_GROUPS))]
            tags = "".join(_digest([content[k] for k in group])[:4] for group in groups)
            self._groups = [[mapped[k].path for k in group] for group in groups]
            self._fingerprint = f"{_digest({**self._layout(), 'content': content})}-{tags}"
        return self._fingerprint

    def explain_fingerprint(self, saved: str) -> str | None:
        """Which files changed since a checkpoint of fingerprint `saved` was taken, where its tags tell."""
        return _changed_files(saved, self.fingerprint(), self._groups)

    def fingerprint_of_earlier_release(self) -> str:
        """The fingerprint releases before this one recorded (names, token counts, dtype, seq_len, document
        boundaries; no content): their checkpoints resume as they would have there, with a warning."""
        return _digest(self._layout())

    def __repr__(self) -> str:
        return (
            f"TokenSource({len(self._files)} files, {self.tokens} tokens, seq_len={self.seq_len}, {len(self)} "
            f"samples, fingerprint={self.fingerprint()})"
        )
