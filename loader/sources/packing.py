"""Document packing: LM rows of whole documents and pieces of documents, with the metadata of document masks.

Why rows are computed, never buffered: the loader's exactness at any world size comes from positions, so a packed
row must be a pure function of (seed, epoch, row, data). Bin packing whole documents makes the number of rows a run
of documents fills vary, so "row p" would need the row counts of all earlier documents, or a buffer of partial bins
in the state (which pins a resume to the topology that filled it). Here the windows are fixed in token space
instead: window k is the span of T = floor(fill * R * (seq_len + 1)) tokens at (shift + k * T) mod N of the
documents' concatenation (N tokens, the shift seeded per epoch), found by binary search in the document offsets,
and always packs into exactly R rows. The document crossing a window's edge is cut there, a document longer than a
row is cut into rows; the pieces, in a keyed order of (seed, epoch, window) sorted by decreasing length, go whole
into the first (first fit) or fullest (best fit) row with room, and a piece that fits nowhere is split over the
rows with the most room (counted). So len = windows * R, row p is (window p // R, row p % R) at O(window) work,
cached per process, padding is about 1 - fill by construction, and the loader's state stays a set of positions.

Why the epoch rides on the row index: the loader hands an epoch-aware dataset (`epoch_aware = True`) indices that
carry the epoch of the batch they belong to (`loader.SampleIndex.epoch`), as Grain's MapDataset reads the epoch
from the index itself. Every worker then packs a row with its batch's epoch, whatever the worker saw before
(persistent workers, prefetching, a superseded iterator, a resume): a `set_epoch` on the dataset, as Hugging Face
datasets and WebDataset take it, reaches only the process it is called in, and nothing tells which batch it is for.

Sample: {"tokens", "segment_ids", "positions", "cu_seqlens"}; see `PackedSource`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.utils.data

from loader.core.checks import check_positive_int
from loader.core.order import Order, sample_seed, window_arrangements
from loader.core.state import StateError, progress_of
from loader.sources.kept import KeepArg, KeptDocuments, kept_documents

__all__ = ["MODES", "ArrowDocuments", "Documents", "PackedSource", "label_mask", "pack", "row_metadata"]

MODES = ("concat", "first_fit", "best_fit")
_SHIFT, _ARRANGE = -1, -2  # sample_seed indices of the epoch's window shift and of its window arrangements
_KEEP = "+keep:"  # what precedes the keep= mask's digest in the fingerprint
CACHED_WINDOWS = 4  # window layouts kept per process: rows of a window come together with shuffle_blocks=R


class Documents(Protocol):
    """Documents as one concatenated token stream: what `PackedSource` reads (TokenSource and ArrowDocuments)."""

    tokens: int

    def read_tokens(self, low: int, high: int) -> np.ndarray: ...  # int64 tokens [low, high)

    def document_starts(self, low: int, high: int) -> np.ndarray: ...  # ascending starts in [low, high)

    def document_start(self, token: int) -> int: ...  # the start of the document holding `token`

    def describe_token(self, token: int) -> str: ...  # e.g. FILE:OFFSET, for the audit

    def fingerprint(self) -> str: ...


class ArrowDocuments:
    """A Hugging Face `datasets.Dataset` column of token lists as documents, one row a document: the Arrow
    ListArray's offsets are the document offsets and its values the tokens, both read in place (memory-mapped
    for a dataset saved with `save_to_disk`), never copied or loaded whole."""

    _chunks: list[tuple[np.ndarray, np.ndarray]] | None  # see `_arrays`

    def __init__(self, dataset: Any, column: str = "input_ids") -> None:
        if getattr(dataset, "_indices", None) is not None:
            raise ValueError(
                "the dataset has an indices mapping (select, shuffle, filter, train_test_split): its "
                "rows are not the Arrow table's; call dataset.flatten_indices() first"
            )
        table = dataset.data.table
        if column not in table.column_names:
            raise ValueError(f"no column {column!r} in the dataset; it has {table.column_names}")
        kind = table.schema.field(column).type
        value = getattr(kind, "value_type", None)
        if value is None or not (str(value).startswith("int") or str(value).startswith("uint")):
            raise ValueError(f"column {column!r} is {kind}: documents must be lists of integer token ids")
        self.dataset, self.column, self._chunks = dataset, column, None
        lengths = [self._offsets(chunk) for chunk in table.column(column).chunks]
        self._bases = np.concatenate(([0], np.cumsum([int(o[-1] - o[0]) for o in lengths]))).astype(np.int64)
        self._rows = np.concatenate(([0], np.cumsum([len(o) - 1 for o in lengths]))).astype(np.int64)
        self.tokens = int(self._bases[-1])

    @staticmethod
    def _offsets(chunk: Any) -> np.ndarray:
        return chunk.offsets.to_numpy(zero_copy_only=True)

    def _arrays(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(offsets, values) per Arrow chunk, views of the table's buffers, made once per process."""
        if self._chunks is None:
            chunks = self.dataset.data.table.column(self.column).chunks
            self._chunks = [(self._offsets(c), c.values.to_numpy(zero_copy_only=True)) for c in chunks]
        return self._chunks

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_chunks": None}  # workers view the table themselves

    def _chunk_of(self, token: int) -> int:
        return int(np.searchsorted(self._bases, token, side="right")) - 1

    def read_tokens(self, low: int, high: int) -> np.ndarray:
        if not 0 <= low <= high <= self.tokens:
            raise IndexError(f"tokens [{low}, {high}) out of range for {self.tokens} tokens")
        out, filled = np.empty(high - low, np.int64), 0
        arrays = self._arrays()
        while low + filled < high:
            chunk = self._chunk_of(low + filled)
            offsets, values = arrays[chunk]
            at = int(offsets[0]) + low + filled - int(self._bases[chunk])
            piece = values[at : min(int(offsets[-1]), at + high - low - filled)]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
        return out

    def document_starts(self, low: int, high: int) -> np.ndarray:
        low, high, found = max(low, 0), min(high, self.tokens), []
        chunk = self._chunk_of(low) if low < high else len(self._bases)
        arrays = self._arrays()
        while chunk < len(arrays) and self._bases[chunk] < high:
            offsets, base = arrays[chunk][0], int(self._bases[chunk]) - int(arrays[chunk][0][0])
            found.append(offsets[np.searchsorted(offsets, low - base) : np.searchsorted(offsets, high - base)] + base)
            chunk += 1
        return np.unique(np.concatenate(found + [np.zeros(0, np.int64)]).astype(np.int64))  # empty rows: once

    def _row_of(self, token: int) -> tuple[int, int]:
        """(dataset row, offset in it) of a token, by binary search in its chunk's offsets."""
        chunk = self._chunk_of(token)
        offsets = self._arrays()[chunk][0]
        at = token - int(self._bases[chunk]) + int(offsets[0])
        row = int(np.searchsorted(offsets, at, side="right")) - 1
        return int(self._rows[chunk]) + row, at - int(offsets[row])

    def document_start(self, token: int) -> int:
        return token - self._row_of(token)[1]

    def describe_token(self, token: int) -> str:
        row, offset = self._row_of(token)
        return f"row {row}:{offset}"

    def fingerprint(self) -> str:
        return f"{getattr(self.dataset, '_fingerprint', None)}/{self.column}"


def pack(lengths: Sequence[int], capacity: int, rows: int, best: bool) -> np.ndarray:
    """Place pieces of these lengths, in this order, into `rows` rows of `capacity` tokens: each piece whole into
    the first row with room (first fit) or the fullest row with room (best fit, the first of equals); a piece that
    fits in no row is split over the rows with the most room, the first of equals first. Each row fills from its
    column 0 in placement order. Returns one row per part: (piece, offset in the piece, length, row, column), in
    placement order. Best fit keeps the rows sorted by (room, row), so a piece costs a binary search."""
    if sum(lengths) > capacity * rows:
        raise ValueError(f"{sum(lengths)} tokens do not fit in {rows} rows of {capacity}")
    free = np.full(rows, capacity, np.int64)
    rooms = [(capacity, row) for row in range(rows)]
    parts = []

    def put(piece: int, offset: int, length: int, row: int) -> None:
        room = int(free[row])
        parts.append((piece, offset, length, row, capacity - room))
        if best:
            del rooms[bisect.bisect_left(rooms, (room, row))]
            bisect.insort(rooms, (room - length, row))
        free[row] = room - length

    for piece, length in enumerate(lengths):
        if best:
            at = bisect.bisect_left(rooms, (length, -1))
            row = rooms[at][1] if at < rows else -1
        else:
            row = int(np.argmax(free >= length))
            row = row if free[row] >= length else -1
        if row >= 0:
            put(piece, 0, length, row)
            continue
        offset = 0
        while offset < length:
            row = int(np.argmax(free))
            take = min(int(free[row]), length - offset)
            put(piece, offset, take, row)
            offset += take
    return np.array(parts, dtype=np.int64).reshape(-1, 5)


def row_metadata(lengths: Sequence[int] | np.ndarray, seq_len: int) -> dict[str, torch.Tensor]:
    """The document-mask metadata of a row of seq_len + 1 tokens whose segments (documents or pieces of them) have
    these lengths from column 0 on, padding after them: segment_ids (0, 1, ... per segment, -1 for padding),
    positions (restarting at 0 at each segment, 0 for padding) and cu_seqlens over the seq_len inputs (segment
    boundaries; the padding run is a segment of its own), int32, padded to seq_len + 1 entries with seq_len."""
    width, lengths = seq_len + 1, [int(n) for n in lengths]
    ends = np.cumsum(lengths, dtype=np.int64)
    used = int(ends[-1]) if lengths else 0
    segment_ids = np.full(width, -1, np.int64)
    segment_ids[:used] = np.repeat(np.arange(len(lengths)), lengths)
    positions = np.zeros(width, np.int64)
    positions[:used] = np.arange(used) - np.repeat(ends - lengths, lengths)
    bounds = [0] + [end for end in ends.tolist() if 0 < end < seq_len] + [seq_len]
    cu_seqlens = np.full(width, seq_len, np.int32)
    cu_seqlens[: len(bounds)] = bounds
    return {
        "segment_ids": torch.from_numpy(segment_ids),
        "positions": torch.from_numpy(positions),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
    }


def label_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Which targets count (shape [..., seq_len]): target t (token t + 1) only where tokens t and t + 1 are of the
    same segment and not padding, so padding and each segment's last token predict nothing across a boundary."""
    return (segment_ids[..., :-1] == segment_ids[..., 1:]) & (segment_ids[..., :-1] >= 0)


def _cut(bounds: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Pieces (start, length) between consecutive bounds, each longer than `capacity` cut into capacity-long ones."""
    starts, lengths = bounds[:-1], np.diff(bounds)
    count = -(-lengths // capacity)
    first = np.repeat(np.cumsum(count) - count, count)
    offset = (np.arange(int(count.sum())) - first) * capacity
    piece_start = np.repeat(starts, count) + offset
    return piece_start, np.minimum(capacity, np.repeat(lengths, count) - offset)


class PackedSource(torch.utils.data.Dataset):
    """Packed LM rows of documents with the metadata of document masks, a map-style dataset: row p is a pure
    function of (seed, epoch, p) and the documents, so the loader resumes it exactly at any world size.

    Args:
        documents: a TokenSource with document boundaries (eos_id= or doc_offsets=), an `ArrowDocuments` (a Hugging
            Face dataset's column of token lists), or any object with the `Documents` methods.
        seq_len: a row holds seq_len + 1 tokens (inputs [:-1], targets [1:]); default: the TokenSource's.
        mode: "concat": row p is tokens [p * seq_len, p * seq_len + seq_len + 1) of the concatenation, as a
            TokenSource's samples (len = (N - 1) // seq_len), rows overlapping by one target token; "first_fit" /
            "best_fit": windows of whole documents packed into rows (see the module's docstring).
        rows_per_window: R, the rows each window packs into (bin modes): more rows, fewer splits, more work per
            window (O(window tokens) per process, cached).
        fill: T / (R * (seq_len + 1)), the share of a window's rows its tokens fill: padding is about 1 - fill.
        seed: keys the window shift and the order of pieces in each window, with the epoch.
        epoch: the default epoch, for rows asked by plain ints (torch's DataLoader, `source[p]`, `describe(p)`).
            Under a ResumableDataLoader every row index carries the epoch of its batch, which is used instead: each
            epoch of the loader packs its own rows, with no rebuild.
        pad_id: the token of padding columns.
        keep: which documents to pack (a filter before rows are formed): a bool array of one entry per document
            (documents in stream order), the path of a .npy of one (memory-mapped), or a vectorised predicate of
            the documents' lengths array returning one. The rows pack the kept documents' concatenation (padding
            stays about 1 - fill); `filtered_documents()` names the others, the audit lists them as filtered by
            policy (`audit.main(..., filtered_documents=source.filtered_documents)`), and the mask's content is
            part of the fingerprint: a resume with another mask is refused, naming it.
        cache: with keep=, a directory where the kept documents' tables are kept (memory-mapped .npy files, made
            once per documents and mask, keyed by the documents' fingerprint and the mask's digest, checked against
            their digests on every load), so that a restart maps them instead of reading every document's start
            and holding two int64 per document. None: made in memory at every start.

    Sample p: {"tokens": int64 [seq_len + 1], "segment_ids": int64 [seq_len + 1] (0, 1, ... per document piece,
    -1 for padding), "positions": int64 [seq_len + 1] (restart at 0 at each piece), "cu_seqlens": int32
    [seq_len + 1] (the pieces' boundaries over the seq_len inputs, padded with seq_len)}. `label_mask` gives the
    targets that count. Identity: `pieces(p, epoch)`, `sample_key(p, epoch)` and `describe(p, epoch)` name the
    documents and token ranges of a row in an epoch.
    """

    def __init__(
        self,
        documents: Documents,
        seq_len: int | None = None,
        mode: str = "best_fit",
        *,
        rows_per_window: int = 64,
        fill: float = 0.99,
        seed: int = 0,
        epoch: int = 0,
        pad_id: int = 0,
        keep: KeepArg | None = None,
        cache: str | os.PathLike | None = None,
    ) -> None:
        seq_len = getattr(documents, "seq_len", None) if seq_len is None else seq_len
        if seq_len is None:
            raise ValueError("pass seq_len=: these documents carry no seq_len of their own")
        check_positive_int("seq_len", seq_len)
        check_positive_int("rows_per_window", rows_per_window)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 < fill <= 1:
            raise ValueError(f"fill must be in (0, 1] (the share of a window's rows its tokens fill), got {fill!r}")
        for name, value in (("seed", seed), ("epoch", epoch), ("pad_id", pad_id)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        document_starts = getattr(documents, "document_starts", None)
        if document_starts is None:
            raise TypeError(
                f"{type(documents).__name__} has no document_starts(): pass a TokenSource, an "
                "ArrowDocuments or an object with the Documents methods"
            )
        document_starts(0, 1)  # a TokenSource without eos_id= or doc_offsets= is refused here
        self.documents, self.seq_len, self.mode, self.seed, self.epoch, self.pad_id = (
            documents,
            seq_len,
            mode,
            seed,
            epoch,
            pad_id,
        )
        self.capacity, self.rows_per_window, self.fill = seq_len + 1, rows_per_window, fill
        self._stream, self._keep = documents, None
        if keep is not None:
            self._stream, self._keep = kept_documents(documents, keep, cache)
        tokens = self._stream.tokens
        if tokens < (self.capacity if mode == "concat" else 1):
            raise ValueError(f"{tokens} tokens are too few for one row of seq_len + 1 = {self.capacity}")
        if mode == "concat":
            self.window_tokens, self._len = seq_len, (tokens - 1) // seq_len
        else:
            self.window_tokens = max(1, int(fill * rows_per_window * self.capacity))
            self.windows = -(-tokens // self.window_tokens)
            last = tokens - (self.windows - 1) * self.window_tokens
            self._last_rows = -(-last // self.capacity)
            self._len = (self.windows - 1) * rows_per_window + self._last_rows
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return self._len

    @property
    def epoch_aware(self) -> bool:
        """Whether the loader hands this dataset indices that carry their batch's epoch (`_epoch_of`): the bin
        modes pack each epoch their own way; a concat row is the same tokens in every epoch."""
        return self.mode != "concat"

    def _check(self, row: int) -> int:
        if not 0 <= row < self._len:
            raise IndexError(f"row {row} out of range for {self._len} packed rows")
        return int(row)

    def _epoch_of(self, epoch: int | None, row: int | None = None) -> int:
        """The epoch to pack with: `epoch` if given, else the one the row's index carries, else the default."""
        return getattr(row, "epoch", self.epoch) if epoch is None else epoch

    def window_span(self, window: int, epoch: int | None = None) -> list[tuple[int, int]]:
        """The token ranges of window `window` of `epoch` (default: the default epoch) in the concatenation (of the
        kept documents under keep=): one, or two where it wraps past the end."""
        tokens, size = self._stream.tokens, self.window_tokens
        shift = int(sample_seed(self.seed, self._epoch_of(epoch), _SHIFT)) % tokens
        start = (shift + window * size) % tokens
        end = start + (size if window < self.windows - 1 else tokens - (self.windows - 1) * size)
        return [(start, min(end, tokens))] + ([(0, end - tokens)] if end > tokens else [])

    def _pieces(self, window: int, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The window's pieces in data order: (start token, length, start of its document)."""
        starts, lengths, documents = [], [], []
        for low, high in self.window_span(window, epoch):
            inner = self._stream.document_starts(low + 1, high)
            bounds = np.unique(np.concatenate(([low], inner, [high]))).astype(np.int64)
            piece_start, piece_length = _cut(bounds, self.capacity)
            first = self._stream.document_start(low)
            owner = np.searchsorted(bounds, piece_start, side="right") - 1
            doc = bounds[owner]
            doc[owner == 0] = first
            starts.append(piece_start)
            lengths.append(piece_length)
            documents.append(doc)
        return np.concatenate(starts), np.concatenate(lengths), np.concatenate(documents)

    def layout(self, window: int, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Window `window`'s parts in `epoch` (default: the default epoch), one per (row, column) run: (row, column,
        start token, length, document start), sorted by row then column, and where each row's parts begin (R + 1
        entries). Kept per process for the next rows of the same window."""
        epoch = self._epoch_of(epoch)
        key = (epoch, window)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        starts, lengths, documents = self._pieces(window, epoch)
        arrange = int(sample_seed(self.seed, epoch, _ARRANGE))
        order = window_arrangements(arrange, np.array([window]), len(lengths))[0]
        order = order[np.argsort(-lengths[order], kind="stable")]  # decreasing length, ties in the keyed order
        rows = self.rows_per_window if window < self.windows - 1 else self._last_rows
        parts = pack(lengths[order].tolist(), self.capacity, rows, self.mode == "best_fit")
        piece = order[parts[:, 0]]
        table = np.stack([parts[:, 3], parts[:, 4], starts[piece] + parts[:, 1], parts[:, 2], documents[piece]], 1)
        table = table[np.lexsort((table[:, 1], table[:, 0]))]
        begins = np.searchsorted(table[:, 0], np.arange(rows + 1))
        self._cache[key] = table, begins
        while len(self._cache) > CACHED_WINDOWS:
            self._cache.popitem(last=False)
        return table, begins

    def _row_parts(self, row: int, epoch: int) -> np.ndarray:
        """(column, start token, length, document start) of each segment of the row in `epoch`, in column order."""
        if self.mode == "concat":
            low, high = row * self.seq_len, row * self.seq_len + self.capacity
            bounds = np.unique(np.concatenate(([low], self._stream.document_starts(low + 1, high), [high])))
            docs = bounds[:-1].copy()
            docs[0] = self._stream.document_start(low)
            return np.stack([bounds[:-1] - low, bounds[:-1], np.diff(bounds), docs], 1)
        window, at = divmod(row, self.rows_per_window)
        table, begins = self.layout(window, epoch)
        return table[begins[at] : begins[at + 1], 1:]

    def pieces(self, row: int, epoch: int | None = None) -> list[tuple[int, int, int, int]]:
        """What row `row` trains in `epoch` (default: the one its index carries, else the default epoch): (document
        start token, offset in the document, length, column) per segment, the document named by where it starts
        in the concatenation. A concat row owns its first seq_len tokens (its last one is the next row's first),
        so that the rows of an epoch own every token once."""
        parts = self._row_parts(self._check(row), self._epoch_of(epoch, row)).tolist()
        if self.mode == "concat":
            parts = [[c, s, min(n, self.seq_len - c), d] for c, s, n, d in parts if c < self.seq_len]
        original = self._kept().original if self._keep else int  # kept under keep=
        return [(original(d), s - d, n, c) for c, s, n, d in parts]

    def sample_key(self, row: int, epoch: int | None = None) -> tuple[str, ...]:
        """The identity of row `row` in `epoch`: each piece's first token (as the documents name it) and length."""
        return tuple(f"{self.documents.describe_token(d + o)}+{n}" for d, o, n, _ in self.pieces(row, epoch))

    def describe(self, row: int, epoch: int | None = None) -> str:
        """Row `row` and the documents and token ranges it holds in `epoch`, as the audit prints a sample (the
        audit passes the epoch of the ledger it names the row from)."""
        return f"{row} ({', '.join(self.sample_key(row, epoch))})"

    def __getitems__(self, rows: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        samples = []
        for row in rows:
            parts = self._row_parts(self._check(row), self._epoch_of(None, row))
            tokens = np.full(self.capacity, self.pad_id, np.int64)
            for column, start, length, _ in parts.tolist():
                tokens[column : column + length] = self._stream.read_tokens(start, start + length)
            samples.append({"tokens": torch.from_numpy(tokens), **row_metadata(parts[:, 2], self.seq_len)})
        return samples

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([row])[0]

    def stats(self, windows: Sequence[int] | None = None, epoch: int | None = None) -> dict[str, float]:
        """Padding and splits over these windows of `epoch` (default all, the default epoch; bin modes): the
        padding fraction of their rows, and as fractions of their documents (counted per window): those cut at a
        window's edge, those in more than one row of a window (longer than a row, or split to fit), and the splits
        made to fit a piece."""
        windows = range(self.windows) if windows is None else windows
        rows = tokens = documents = edges = long = split = 0
        for window in windows:
            table, begins = self.layout(window, epoch)
            rows, tokens = rows + len(begins) - 1, tokens + int(table[:, 3].sum())
            docs, counts = np.unique(table[:, 4], return_counts=True)
            documents += len(docs)
            edges += sum(self._stream.document_start(low) != low for low, _ in self.window_span(window, epoch))
            long += int((counts > 1).sum())
            pieces = len(self._pieces(window, self._epoch_of(epoch))[1])
            split += len(table) - pieces
        return {
            "padding": 1 - tokens / (rows * self.capacity),
            "documents": documents,
            "cut_at_window_edges": edges / documents,
            "cut_in_rows": long / documents,
            "split_to_fit": split / documents,
        }

    def _digest(self, documents: str, **legacy: int) -> str:
        layout = {
            "documents": documents,
            "seq_len": self.seq_len,
            "mode": self.mode,
            "rows_per_window": self.rows_per_window,
            "fill": self.fill,
            "seed": self.seed,
            **legacy,
            "pad_id": self.pad_id,
        }
        return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]

    def _documents_of_earlier_release(self) -> str | None:
        earlier = getattr(self.documents, "fingerprint_of_earlier_release", None)
        return earlier() if callable(earlier) else None

    def fingerprint(self) -> str:
        """Digest of the documents' fingerprint and the packing's parameters, for the checkpoint manifest: the
        same in every epoch (the rows of each epoch are a function of these and the epoch the loader saves).
        Documents that name their changed files (a TokenSource's tags) lend it their tags, to name them here too.
        Under `keep=`, the mask's digest follows (`+keep:DIGEST`), to name a changed mask."""
        documents = self.documents.fingerprint()
        tags = documents.partition("-")[2] if hasattr(self.documents, "explain_fingerprint") else ""
        keep = f"{_KEEP}{self._keep[1]}" if self._keep else ""
        return self._digest(documents) + (f"-{tags}" if tags else "") + keep

    def explain_fingerprint(self, saved: str) -> str | None:
        """Which document files, or whether the keep= mask, changed since a checkpoint of fingerprint `saved`, where
        the documents and the mask's digest tell."""
        saved, _, mask = saved.partition(_KEEP)
        changed = []
        if mask != (self._keep[1] if self._keep else ""):
            changed.append(
                f"the keep= mask {self._keep[0]} changed since the checkpoint was saved (digest "
                f"{mask or 'none: no mask'} then, {self._keep[1]} now), so its rows would hold other "
                f"documents"
                if self._keep
                else "the checkpoint was saved with a keep= mask (digest "
                f"{mask}) and this PackedSource has none, so its rows would hold other documents"
            )
        explain = getattr(self.documents, "explain_fingerprint", None)
        files = explain(saved) if callable(explain) else None
        return "; ".join(changed + ([files] if files else [])) or None

    def fingerprint_of_earlier_release(self) -> str | None:
        """The fingerprint the previous release recorded, where the documents' differs (a TokenSource's held no
        content then): such a checkpoint resumes as it would have there, with a warning. None under keep=, which
        no earlier release had."""
        documents = self._documents_of_earlier_release()
        return None if documents is None or self._keep else self._digest(documents)

    def fingerprint_before_change(self) -> str | None:
        """The fingerprint a checkpoint of a release that packed every epoch with `epoch=` holds (it had the epoch
        in it, and the documents' fingerprint of then): such a checkpoint resumes here when its progress fits
        (`check_change`). None under keep=, which no such release had."""
        if self._keep:
            return None
        documents = self._documents_of_earlier_release()
        return self._digest(self.documents.fingerprint() if documents is None else documents, epoch=self.epoch)

    def _kept(self) -> KeptDocuments:
        """The documents `keep=` kept: `_stream` is one exactly when `keep=` was given."""
        return cast(KeptDocuments, self._stream)

    def filtered_documents(self, epoch: int | None = None) -> np.ndarray:
        """The start tokens of the documents `keep=` drops (empty without it), ascending: the same in every epoch
        (`epoch` is taken for the audit, which asks per epoch)."""
        return self._kept().dropped_starts if self._keep else np.zeros(0, np.int64)

    def describe_document(self, start: int) -> str:
        """A filtered document by its first token, as the documents name it, and its length (the audit's name)."""
        starts = self.filtered_documents()
        at = int(np.searchsorted(starts, start))
        if at == len(starts) or starts[at] != start:
            raise ValueError(f"no filtered document starts at token {start}")
        return f"{self.documents.describe_token(int(start))}+{int(self._kept().dropped_lengths[at])}"

    def check_change(self, progress: dict, order: Order) -> None:
        """A checkpoint of an earlier release packed every epoch of the loader with `epoch=` E; this release packs
        loader epoch k with k. Its positions name the same rows only in epoch E: progress committed in another
        epoch would name other rows here (tokens trained twice or never), so it is refused, whatever the loader's
        `order` (any committed position of another epoch holds a row that moved)."""
        saved = progress_of(progress)
        moved = sorted(e for e, spans in saved.committed.items() if e != self.epoch and len(spans))
        if moved:
            raise StateError(
                f"the checkpoint was saved by a release that packed every epoch with PackedSource(epoch="
                f"{self.epoch}), and its epoch {moved[0]} is part trained: this release packs epoch {moved[0]} "
                f"with epoch {moved[0]}, so its saved positions would name other rows. Finish that epoch with the "
                f"release that saved the checkpoint, then resume here (or start the data anew)"
            )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": OrderedDict()}

    def __repr__(self) -> str:
        return (
            f"PackedSource({self.mode}, {len(self)} rows of {self.capacity} tokens, fingerprint={self.fingerprint()})"
        )
