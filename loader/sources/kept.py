"""Documents filtered before packing: the kept documents of a token stream as a token stream of their own.

Why over the kept documents' concatenation: `PackedSource`'s windows are fixed in token space. Over the
concatenation of all documents, a filter that drops a share f of the tokens would leave every window about f
emptier (a 50% quality filter: half of every row padding; a mask keeping one document: rows of padding only), and
the source as long as unfiltered. Over the kept documents' concatenation, padding stays about 1 - fill whatever the
filter drops, and rows are still a pure function of (seed, epoch, row, data), resumed in O(1). The cost is paid once,
at construction: one pass over the documents' starts and the mask (O(documents)), and the kept documents' starts and
prefix sums held (two int64 per kept document).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from loader.sources.array_cache import CHUNK, cached, chunks, from_state, to_state

KeepArg = np.ndarray | str | os.PathLike | Callable[[np.ndarray], np.ndarray]


def document_table(documents: Any) -> tuple[np.ndarray, np.ndarray]:
    """Every document's start token and length, in stream order (document k is the k-th start)."""
    starts = np.union1d([0], documents.document_starts(0, documents.tokens)).astype(np.int64)
    return starts, np.diff(np.append(starts, documents.tokens))


def read_mask(keep: np.ndarray | str | os.PathLike, label: str = "keep=") -> tuple[np.ndarray, str]:
    """A keep= mask given as an array or a .npy path (memory-mapped), and a name for it: a 1-D bool array. Errors
    name a path as `label` gives it (keep=, or a command line's option)."""
    if isinstance(keep, (str, os.PathLike)):
        name = os.fspath(keep)
        where = f"{label}{name!r}"
        try:
            mask = np.load(name, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ValueError(f"{where}: not a readable .npy mask ({err})") from None
    else:
        name, mask = "keep= (the mask array)", np.asarray(keep)
        where = name
    if mask.dtype != np.bool_ or mask.ndim != 1:
        raise ValueError(
            f"{where}: must be a bool array of one entry per document (the keep= mask), got {mask.dtype} of shape "
            f"{mask.shape}"
        )
    return mask, name


def check_mask(mask: np.ndarray, name: str, documents: int) -> None:
    """A mask of one entry per document that keeps one at least."""
    if mask.dtype != np.bool_ or mask.shape != (documents,):
        raise ValueError(
            f"{name}: must be a bool array of one entry per document ({documents} documents), got "
            f"{mask.dtype} of shape {mask.shape}"
        )
    if not any(chunk.any() for _, chunk in chunks(mask)):
        raise ValueError(f"{name} keeps no document of {documents}: nothing to pack")


def keep_mask(keep: KeepArg, lengths: np.ndarray) -> tuple[np.ndarray, str]:
    """The boolean mask of `keep` (a bool array of one entry per document, a .npy file of one, memory-mapped, or a
    vectorised predicate of the documents' lengths) and a name for it, checked against the document count."""
    if callable(keep):
        name = f"keep={getattr(keep, '__qualname__', type(keep).__name__)}(lengths)"
        mask = np.asarray(keep(lengths.copy()))
    else:
        mask, name = read_mask(keep)
    check_mask(mask, name, len(lengths))
    return mask, name


def mask_digest(mask: np.ndarray) -> str:
    """Digest of the mask's whole content (a bit per document: 125 MB hashed for 1e9 documents, once, in chunks)."""
    hashed = hashlib.sha256()
    for _, chunk in chunks(mask, CHUNK * 8):  # whole bytes of bits: the chunks' bits pack as the whole's
        hashed.update(np.packbits(chunk).tobytes())
    hashed.update(str(len(mask)).encode())
    return hashed.hexdigest()[:12]


def kept_arrays(documents: Any, mask: np.ndarray, name: str) -> dict[str, np.ndarray]:
    """What packing needs of the kept documents: their starts in the documents, their starts in the kept ones'
    concatenation (one more entry: its end), and the dropped documents' starts and lengths (for the audit)."""
    starts, lengths = document_table(documents)
    check_mask(mask, name, len(starts))
    mask = np.asarray(mask)
    return {
        "starts": starts[mask],
        "bases": np.concatenate(([0], np.cumsum(lengths[mask]))).astype(np.int64),
        "dropped_starts": starts[~mask],
        "dropped_lengths": lengths[~mask],
    }


def kept_documents(
    documents: Any, keep: KeepArg, cache: str | os.PathLike | None
) -> tuple[KeptDocuments, tuple[str, str]]:
    """The kept documents of `keep` and (the mask's name, its digest). With a cache directory their tables are made
    once per documents and mask (keyed by the documents' fingerprint and the mask's digest) and memory-mapped; a
    predicate of the lengths still reads every document's start at each start (the mask is its result)."""
    if callable(keep):
        mask, name = keep_mask(keep, document_table(documents)[1])
    else:
        mask, name = read_mask(keep)
    digest = mask_digest(mask)
    key = {"documents": documents.fingerprint(), "mask": digest, "count": len(mask)}
    fields = dict.fromkeys(("starts", "bases", "dropped_starts", "dropped_lengths"), np.dtype(np.int64))
    arrays, _ = cached(cache, "kept-documents", key, fields, lambda: kept_arrays(documents, mask, name))
    kept = KeptDocuments(documents, **arrays)
    if (
        len(kept.bases) != len(kept.starts) + 1
        or len(kept.starts) + len(kept.dropped_starts) != len(mask)
        or len(kept.dropped_starts) != len(kept.dropped_lengths)
        or not 0 < kept.tokens <= documents.tokens
    ):
        raise ValueError(
            f"the cached kept documents in {cache} do not describe these {len(mask)} documents of "
            f"{documents.tokens} tokens: delete its kept-documents-* files to rebuild them"
        )
    return kept, (name, digest)


class KeptDocuments:
    """The documents a mask keeps, concatenated: the `Documents` methods over token positions of that
    concatenation, each read and named through the underlying documents (`original` maps a position back), and
    the documents it drops (`dropped_starts`, `dropped_lengths`)."""

    def __init__(
        self,
        documents: Any,
        starts: np.ndarray,
        bases: np.ndarray,
        dropped_starts: np.ndarray,
        dropped_lengths: np.ndarray,
    ) -> None:
        self.documents, self.starts, self.bases = documents, starts, bases
        self.dropped_starts, self.dropped_lengths = dropped_starts, dropped_lengths
        self.tokens = int(self.bases[-1])

    def __getstate__(self) -> dict:
        return to_state(self.__dict__)  # a spawned worker maps the cached tables again

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(from_state(state))

    def _document(self, token: int) -> int:
        return int(np.searchsorted(self.bases, token, side="right")) - 1

    def original(self, token: int) -> int:
        """The position in the underlying documents of this position of the kept ones."""
        document = self._document(token)
        return int(self.starts[document]) + token - int(self.bases[document])

    def read_tokens(self, low: int, high: int) -> np.ndarray:
        if not 0 <= low <= high <= self.tokens:
            raise IndexError(f"tokens [{low}, {high}) out of range for {self.tokens} kept tokens")
        out, at = [np.zeros(0, np.int64)], low
        while at < high:
            document = self._document(at)
            end = min(high, int(self.bases[document + 1]))
            start = self.original(at)
            out.append(self.documents.read_tokens(start, start + end - at))
            at = end
        return np.concatenate(out)

    def document_starts(self, low: int, high: int) -> np.ndarray:
        low, high = max(low, 0), min(high, self.tokens)
        found = self.bases[np.searchsorted(self.bases, low) : np.searchsorted(self.bases, high)]
        return np.unique(found)  # an empty document starts where the next one does: once

    def document_start(self, token: int) -> int:
        return int(self.bases[self._document(token)])

    def describe_token(self, token: int) -> str:
        return self.documents.describe_token(self.original(token))

    def fingerprint(self) -> str:
        return self.documents.fingerprint()
