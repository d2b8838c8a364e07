"""Per-shard sample index of a WebDataset tar: where each sample's member bytes live.

Random access into a tar needs, for every sample, the offset and size of each of
its members.  We get them from one pass over the 512-byte tar headers (never the
member data) and group members into samples exactly as webdataset's streaming
reader does, so index ``i`` of a shard is the ``i``-th sample webdataset yields.

The headers are parsed here rather than with ``tarfile``: on shards written by
webdataset (a pax header per member) ``tarfile`` spends ~33 us per member
building full ``TarInfo`` objects; this parser decodes only name, type and size
(~8 us per member) and follows ``tarfile``'s naming rules (ustar prefix, GNU long
names, pax ``path``/``size``).  It is also stricter than ``tarfile``: a bad header
or a missing end-of-archive marker in the middle of a shard is an error, not a
silent end of the shard.

Indexes are cached as ``.npz`` files (plain numpy arrays, no pickle): loading
is a few array reads instead of parsing one JSON object per member, the file is
~36 bytes per member plus its key, and the arrays stay as a handful of buffers that forked
DataLoader workers share copy-on-write (a list of per-sample Python objects
would be copied page by page as reference counts change).

An index describes one file's bytes, and size and mtime do not pin them down:
``mv``, ``cp -p``, ``rsync -t`` and tar extraction keep both.  So the index
holds a digest of each member's header blocks; the reader checks them before
serving a member's data, and a cached index loaded for another file (another
inode or ctime: a replacement, or a copy staged to node-local disk) is reused
only if the first block and a spread of member headers read back the same.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import uuid
import warnings
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

import numpy as np
from webdataset.tariterators import base_plus_ext

INDEX_VERSION = 2  # 2: header digests and the shard's inode and ctime
BLOCK = 512
SPOT_CHECKS = 8  # members whose headers are read back when a cached index is loaded for another inode or ctime
_ZERO_BLOCK = bytes(BLOCK)
_EMPTY_TAR_BYTES = range(2 * BLOCK, 20 * BLOCK + 1, BLOCK)  # end marker, padded to at most one default record
_TAR_ENCODING = sys.getfilesystemencoding()  # what tarfile (and so webdataset) decodes names with
_REGULAR = (b"0", b"\0", b"7")
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # types whose size field tarfile ignores
_EXTENSIONS = (b"L", b"K", b"g", b"x", b"X")  # GNU long name/link, pax global/extended (+ Solaris)
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skip_meta default
_RESERVED = ("__key__", "__url__", "__local_path__")  # sample entries webdataset fills in itself


class ShardFormatError(ValueError):
    """A shard is not a complete, uncompressed tar that can be indexed (or read as indexed)."""


class StaleIndexError(ValueError):
    """A shard changed after its index was built; serving bytes from the index would be wrong."""


class TarMember(NamedTuple):
    """A regular file in a tar: its name, where its data lies, and its header blocks just before the data."""

    name: str
    offset: int
    size: int
    header_length: int  # bytes of the member's own header and of the extended headers before it
    header_digest: int  # digest() of those bytes


class IndexedMember(NamedTuple):
    """A member of an indexed sample: where its data lies, and what its header blocks hashed to when indexed."""

    suffix: str
    offset: int
    size: int
    header_length: int
    header_digest: int

    @property
    def header_offset(self) -> int:
        return self.offset - self.header_length


def digest(data: bytes) -> int:
    """64 bits of blake2b, as a signed int64 for numpy: a changed header gets another digest but by chance."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def header_matches(fd: int, offset: int, length: int, header_digest: int) -> bool:
    """Whether the ``length`` bytes at ``offset`` are still the headers indexed there (a short read never is)."""
    return digest(os.pread(fd, length, offset)) == header_digest


def _fail(shard: str, offset: int, problem: str) -> ShardFormatError:
    return ShardFormatError(
        f"{shard}: {problem} (at byte {offset}). The shard is truncated or corrupted; "
        "re-create or re-download it, or remove it from the shard list."
    )


def _text(field: bytes) -> str:
    """Decode a NUL-terminated header field like tarfile's ``nts``."""
    return field.split(b"\0", 1)[0].decode(_TAR_ENCODING, "surrogateescape")


def _number(field: bytes) -> int | None:
    """Decode a numeric header field (octal, or GNU base-256); None when invalid."""
    if field[0] in (0o200, 0o377):
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[0] == 0o377 else value
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return None


def _checksum_ok(header: bytes) -> bool:
    """Accept the unsigned and the (historic Sun) signed byte-sum checksums, as tarfile does."""
    stored = _number(header[148:156])
    unsigned = 256 + sum(header) - sum(header[148:156])
    if stored == unsigned:
        return True
    summed = header[:148] + header[156:]
    high_bytes = len(summed) - len(summed.translate(None, bytes(range(128, 256))))
    return stored == unsigned - 256 * high_bytes


def _pax_records(data: bytes, where: str) -> Iterator[tuple[str, str]]:
    """Yield the ``length key=value`` records of a pax header, parsed as tarfile parses them."""
    pos = 0
    while (match := _PAX_RECORD.match(data, pos)) is not None:
        length = int(match.group(1))
        if length == 0:
            raise ShardFormatError(f"{where}: corrupted pax header (zero-length record); re-create the shard")
        value = data[match.end(2) + 1 : match.start(1) + length - 1]
        yield match.group(2).decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
        pos += length


def _apply_extensions(name: str, size: int, extensions: list[tuple[bytes, bytes]], where: str) -> tuple[str, int]:
    """Apply GNU long-name and pax headers; the outermost one wins, as in tarfile's recursion."""
    for typeflag, data in reversed(extensions):
        if typeflag == b"L":
            name = _text(data)
            continue
        for key, value in _pax_records(data, where):
            if key.startswith("GNU.sparse."):
                raise ShardFormatError(f"{where}: sparse tar members are not supported; repack the shard")
            if key == "path":
                name = value.rstrip("/")
            elif key == "size":
                if not value.isdigit():
                    raise ShardFormatError(f"{where}: invalid pax size {value!r}; the shard is corrupted")
                size = int(value)
    return name, size


def _check_global_pax(data: bytes, where: str) -> None:
    """Global pax headers only matter to us if they rename or resize members; we refuse those."""
    for key, _ in _pax_records(data, where):
        if key in ("path", "size") or key.startswith("GNU.sparse."):
            raise ShardFormatError(f"{where}: global pax header sets {key!r}; repack the shard")


def _blocks(size: int) -> int:
    """Bytes a member's data occupies: tar pads it to whole blocks."""
    return -(-size // BLOCK) * BLOCK


def _read_exact(f: BinaryIO, offset: int, size: int, shard: str, what: str) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise _fail(shard, offset, f"file ends inside {what}")
    return data


def _check_end(f: BinaryIO, offset: int, shard: str) -> None:
    """Everything after the first zero block must be zero padding, else a header was corrupted."""
    f.seek(offset)
    while chunk := f.read(1 << 20):
        if chunk.count(0) != len(chunk):
            raise _fail(shard, offset, "data after the end-of-archive marker (corrupted header?)")
        offset += len(chunk)


def _check_empty_archive(file_size: int, shard: str) -> None:
    """A file of zeros reads as a tar with no members; only the sizes tar writers give an empty one pass.

    Larger (or odd-sized) zeros are a shard preallocated or zeroed and never written: reading it as
    empty would silently drop its samples.
    """
    if file_size not in _EMPTY_TAR_BYTES:
        raise ShardFormatError(
            f"{shard}: the file is {file_size} bytes of zeros, not a tar archive (an empty tar is "
            f"{_EMPTY_TAR_BYTES.start} to {_EMPTY_TAR_BYTES.stop - 1} bytes); it was preallocated or zeroed but "
            "never written. Re-create or re-download it, or remove it from the shard list."
        )


def scan_tar(f: BinaryIO, shard: str, file_size: int | None = None) -> Iterator[TarMember]:
    """Yield the regular-file members of an uncompressed tar in order, with data offsets.

    ``f`` needs only seek and read (a remote file read by ranges works); ``file_size`` defaults to its fstat's.
    """
    if file_size is None:
        file_size = os.fstat(f.fileno()).st_size
    offset = start = 0  # start: where the next member's header blocks begin
    headers: list[bytes] = []  # those blocks, for its header digest
    extensions: list[tuple[bytes, bytes]] = []  # long-name/pax headers waiting for their member
    while True:
        f.seek(offset)
        header = f.read(BLOCK)
        if header == _ZERO_BLOCK and not extensions:
            _check_end(f, offset, shard)
            if offset == 0:
                _check_empty_archive(file_size, shard)
            return
        if len(header) < BLOCK:
            problem = "empty file" if file_size == 0 else "file ends before the end-of-archive marker"
            raise _fail(shard, offset, problem)
        size = _number(header[124:136])
        if size is None or size < 0 or not _checksum_ok(header):
            hint = "; compressed shards (.tar.gz etc.) cannot be read randomly" if offset == 0 else ""
            raise _fail(shard, offset, f"invalid tar header{hint}")
        typeflag, data_offset = header[156:157], offset + BLOCK
        where = f"{shard}: tar header at byte {offset}"
        headers.append(header)
        if typeflag in _EXTENSIONS:
            padded = _read_exact(f, data_offset, _blocks(size), shard, "an extended header")
            headers.append(padded)
            data = padded[:size]
            offset = data_offset + _blocks(size)
            if typeflag == b"g":
                _check_global_pax(data, where)
            elif typeflag != b"K":  # K is a long link target: irrelevant to regular files
                extensions.append((typeflag, data))
            continue
        if typeflag == b"S":
            raise ShardFormatError(f"{where}: sparse tar members are not supported; repack the shard")
        name = _text(header[0:100])
        if typeflag == b"\0" and name.endswith("/"):
            typeflag = b"5"  # old V7 tars mark directories only by the trailing slash
        regular = typeflag in _REGULAR
        if prefix := _text(header[345:500]):
            name = prefix + "/" + name
        name, size = _apply_extensions(name, size, extensions, where)
        extensions = []
        offset = data_offset + (_blocks(size) if regular or typeflag not in _NO_DATA else 0)
        if regular:
            if data_offset + size > file_size:
                raise _fail(shard, data_offset, f"file ends inside the data of {name!r}")
            yield TarMember(name, data_offset, size, data_offset - start, digest(b"".join(headers)))
        start, headers = offset, []


def _repeated_key(shard: str, key: str, first: TarMember, again: TarMember) -> ShardFormatError:
    return ShardFormatError(
        f"{shard}: sample key {key!r} occurs twice, with other samples between: {first.name!r} at byte "
        f"{first.offset} and {again.name!r} at byte {again.offset}. webdataset would yield two samples with one "
        "key, so (shard, key) could not tell them apart; give one of them another key and repack the shard"
    )


def group_samples(members: Iterable[TarMember], shard: str) -> Iterator[tuple[str, dict[str, TarMember]]]:
    """Group consecutive members into samples with webdataset's key rules (base_plus_ext, lower-case suffix).

    A key must name one sample: (shard, key) is the identity that resume and audit rely on.
    """
    key: str | None = None
    sample: dict[str, TarMember] = {}
    first_members: dict[str, TarMember] = {}  # each key's first member, to name both places of a repeat
    for member in members:
        if _META.match(member.name):
            continue
        prefix, suffix = base_plus_ext(member.name)
        if prefix is None:
            continue
        if prefix != key:
            if sample:
                assert key is not None, "a sample has members under its key"
                yield key, sample
            if prefix in first_members:
                raise _repeated_key(shard, prefix, first_members[prefix], member)
            first_members[prefix] = member
            key, sample = prefix, {}
        suffix = suffix.lower()
        if suffix in _RESERVED:
            raise ShardFormatError(
                f"{shard}: member {member.name!r} would overwrite the sample's {suffix!r} entry; "
                "rename it and repack the shard"
            )
        if suffix in sample:
            raise ShardFormatError(
                f"{shard}: sample {key!r} has two members with suffix {suffix!r} ({member.name!r}); "
                "webdataset rejects this too; repack the shard with unique names"
            )
        sample[suffix] = member
    if sample:
        assert key is not None, "a sample has members under its key"
        yield key, sample


def _pack_strings(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Strings as one UTF-8 buffer plus offsets: compact, picklable, no per-string objects."""
    encoded = [s.encode("utf-8", "surrogateescape") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


def _unpack_string(blob: np.ndarray, offsets: np.ndarray, i: int) -> str:
    return blob[offsets[i] : offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")


_SHARD_FIELDS = ("shard_bytes", "shard_mtime_ns", "shard_identity", "head_digest")  # saved as one array


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """The samples of one shard: keys, and where each member's data and header blocks lie.

    ``shard_bytes``/``shard_mtime_ns`` are the shard's stat when indexed: any
    difference later means the offsets can no longer be trusted. Equal ones do
    not prove the file is the one indexed (``mv``, ``cp -p`` and ``tar``
    extraction keep them), so the header digests are what reads are checked
    against; ``shard_identity`` (inode and ctime) tells when no check is needed.
    Scalars go to the ``.npz`` as one array and the members as one table:
    loading costs ~30 us per array.
    """

    shard_bytes: int
    shard_mtime_ns: int
    shard_identity: int  # file_identity() when indexed
    head_digest: int  # digest() of the shard's first block: all an index without members can be checked by
    key_blob: np.ndarray  # uint8, all sample keys back to back
    key_offsets: np.ndarray  # int64[n + 1]
    sample_members: np.ndarray  # int64[n + 1]: members of sample i are [sample_members[i], sample_members[i+1])
    member_table: np.ndarray  # int64[m, 4]: data offset, size, header length and header digest (IndexedMember's)
    member_suffixes: np.ndarray  # int32[m]: position in `suffixes`
    suffixes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.sample_members) - 1

    def key(self, i: int) -> str:
        return _unpack_string(self.key_blob, self.key_offsets, i)

    def members(self, i: int) -> list[IndexedMember]:
        """Sample ``i``'s members, in tar order."""
        lo, hi = int(self.sample_members[i]), int(self.sample_members[i + 1])
        rows = zip(self.member_suffixes[lo:hi].tolist(), self.member_table[lo:hi].tolist())
        return [IndexedMember(self.suffixes[s], *row) for s, row in rows]

    def matches(self, st: os.stat_result) -> bool:
        """Same size and mtime: the file may be the one indexed (not proof: see the class docstring)."""
        return file_state(st) == (self.shard_bytes, self.shard_mtime_ns)

    def untouched(self, st: os.stat_result) -> bool:
        """The very file indexed (same inode), its ctime unmoved since: no header needs reading back."""
        return self.matches(st) and file_identity(st) == self.shard_identity

    def spot_checks(self) -> list[tuple[int, int, int]]:
        """(offset, length, digest) of the first block and of up to SPOT_CHECKS members' headers, spread evenly."""
        count = len(self.member_table)
        picks = np.linspace(0, count - 1, min(count, SPOT_CHECKS)).round().astype(np.int64)
        rows = self.member_table[picks].tolist()
        return [(0, BLOCK, self.head_digest), *((offset - length, length, d) for offset, _, length, d in rows)]

    def to_arrays(self) -> dict[str, Any]:  # arrays, and the format's version as an np.int64
        suffix_blob, suffix_offsets = _pack_strings(list(self.suffixes))
        arrays = {k: v for k, v in vars(self).items() if isinstance(v, np.ndarray)}
        shard = np.array([getattr(self, name) for name in _SHARD_FIELDS], dtype=np.int64)
        strings = {"suffix_blob": suffix_blob, "suffix_offsets": suffix_offsets}
        return {"version": np.int64(INDEX_VERSION), "shard": shard, **strings, **arrays}

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> ShardIndex:
        blob, offsets = arrays.pop("suffix_blob"), arrays.pop("suffix_offsets")
        suffixes = tuple(_unpack_string(blob, offsets, i) for i in range(len(offsets) - 1))
        arrays.pop("version")
        scalars = dict(zip(_SHARD_FIELDS, arrays.pop("shard").tolist(), strict=True))
        return cls(suffixes=suffixes, **scalars, **arrays)


def file_state(st: os.stat_result) -> tuple[int, int]:
    """What must be unchanged for an index to describe a shard at all: size and modification time."""
    return st.st_size, st.st_mtime_ns


def file_identity(st: os.stat_result) -> int:
    """Inode and ctime as one number: a copy gets a new inode, a write, rename or utime a new ctime."""
    return digest(b"%d %d" % (st.st_ino, st.st_ctime_ns))


def build_index(shard: str) -> ShardIndex:
    """Index ``shard`` by scanning its tar headers once."""
    with open(shard, "rb") as f:
        before = os.fstat(f.fileno())
        head = os.pread(f.fileno(), BLOCK, 0)
        samples = list(group_samples(scan_tar(f, shard), shard))
        after = os.fstat(f.fileno())
        if (*file_state(after), after.st_ctime_ns) != (*file_state(before), before.st_ctime_ns):
            raise StaleIndexError(f"{shard} changed while it was being indexed; stop writing to it and retry")
    return assemble_index(samples, before.st_size, before.st_mtime_ns, file_identity(before), head)


def assemble_index(
    samples: list[tuple[str, dict[str, TarMember]]], size: int, mtime_ns: int, identity: int, head: bytes
) -> ShardIndex:
    """The index of grouped samples, for a shard of that size, mtime and identity whose first block is ``head``."""
    vocabulary: dict[str, int] = {}
    members = [(vocabulary.setdefault(suffix, len(vocabulary)), m) for _, s in samples for suffix, m in s.items()]
    key_blob, key_offsets = _pack_strings([key for key, _ in samples])
    sample_members = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum([len(s) for _, s in samples], out=sample_members[1:])
    return ShardIndex(
        shard_bytes=size,
        shard_mtime_ns=mtime_ns,
        shard_identity=identity,
        head_digest=digest(head),
        key_blob=key_blob,
        key_offsets=key_offsets,
        sample_members=sample_members,
        member_table=np.array([m[1:] for _, m in members], dtype=np.int64).reshape(-1, 4),
        member_suffixes=np.array([s for s, _ in members], dtype=np.int32),
        suffixes=tuple(vocabulary),
    )


def default_cache_dir() -> str:
    """Where indexes go when the shard's own directory is not writable."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "loader", "webdataset-index")


def cache_paths(shard: str, cache_dir: str | None) -> list[str]:
    """Candidate index files, preferred first: next to the shard, else a cache directory.

    Names inside a cache directory carry a hash of the shard's absolute path so
    equally named shards of different datasets do not share an index.
    """
    digest = hashlib.sha256(os.path.abspath(shard).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    cached = f"{os.path.basename(shard)}.{digest}.idx.npz"
    if cache_dir is not None:
        return [os.path.join(cache_dir, cached)]
    return [shard + ".idx.npz", os.path.join(default_cache_dir(), cached)]


def load_index(source: str | BinaryIO) -> ShardIndex | None:
    """The index cached at ``source`` (a path or an open file) if it is readable and of this version."""
    try:
        with np.load(source, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        if int(arrays["version"]) != INDEX_VERSION:
            return None
        return ShardIndex.from_arrays(arrays)
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
        return None  # missing, partial or from another format: rebuild it


def index_bytes(index: ShardIndex) -> bytes:
    """The ``.npz`` file of an index, as bytes: what is cached locally or stored next to a remote shard."""
    buffer = io.BytesIO()
    np.savez(buffer, **index.to_arrays())
    return buffer.getvalue()


def same_layout(a: ShardIndex, b: ShardIndex) -> bool:
    """Whether two indexes list the same samples, members, offsets and header digests (the shard's stat aside)."""
    arrays = ("key_blob", "key_offsets", "sample_members", "member_table", "member_suffixes")
    return (
        a.head_digest == b.head_digest
        and a.suffixes == b.suffixes
        and all(np.array_equal(getattr(a, name), getattr(b, name)) for name in arrays)
    )


def describes(index: ShardIndex, shard: str) -> bool:
    """Whether ``index`` is that of ``shard`` as it is now.

    The file indexed, untouched, needs no read. A copy (staging to node-local disk) or a
    replacement with the same size and mtime gets its first block and a spread of member
    headers read back: a few preads, where rebuilding reads every header.
    """
    fd = os.open(shard, os.O_RDONLY)
    try:
        return describes_file(index, fd)
    finally:
        os.close(fd)


def describes_file(index: ShardIndex, fd: int) -> bool:
    """``describes`` for an open file."""
    st = os.fstat(fd)
    if not index.matches(st):
        return False
    return index.untouched(st) or all(header_matches(fd, *check) for check in index.spot_checks())


def save_index(path: str, index: ShardIndex) -> None:
    """Write atomically (temp file + rename) so concurrent readers and crashed writers never leave a torn index."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(index_bytes(index))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_or_build_index(shard: str, cache_dir: str | None = None, rebuild: bool = False) -> tuple[ShardIndex, bool]:
    """The shard's index, from cache when valid, else built and cached; also whether it was built."""
    if not os.path.exists(shard):
        raise FileNotFoundError(f"WebDataset shard not found: {shard}; check the shard list or brace pattern")
    candidates = cache_paths(shard, cache_dir)
    if not rebuild:
        for path in candidates:
            if (index := load_index(path)) is not None and describes(index, shard):
                return index, False
    index = build_index(shard)
    errors = []
    for path in candidates:
        try:
            save_index(path, index)
            break
        except OSError as exn:  # e.g. read-only shard directory: try the next location
            errors.append(f"{path}: {exn}")
    else:
        warnings.warn(
            f"could not cache the index of {shard} ({'; '.join(errors)}); it will be rebuilt next time", stacklevel=1
        )
    return index, True
