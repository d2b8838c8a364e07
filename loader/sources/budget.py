"""Token-budget batches: variable-length samples batched under a budget of tokens, as a map-style dataset whose
item k is the k-th batch.

Why the batch is the item: the loader's exactness comes from positions (update g covers remaining positions
[g*G, (g+1)*G)), so a batch whose size depends on the data must be one position. With `batch_size=None` every
rank takes one batch per micro-step, so every rank runs the same number of micro-batches per step whatever their
token counts, and exactly-once, any world size and an O(1) resume come from the loader's order and progress.

Why global length buckets, not a sorted window: fairseq's `max_tokens` and Lhotse's dynamic bucketing sort a
buffer (a window of the epoch's order) by length and cut it greedily; how many batches a window yields depends on
the lengths it happens to hold, so batch k of an epoch would need the batch counts of every earlier window (the
whole epoch's lengths mapped at a resume, O(N)), and the dataset's length would change with the epoch (which the
loader refuses). Buckets are fixed per dataset instead: lengths within a ratio (default 1.1) of each other share a
bucket, and no bucket straddles a length max_tokens // n where a batch would hold one sample more; bucket b, whose
longest sample has m_b tokens, holds n_b = max_tokens // m_b samples a batch, so its |b| members always cut into
c_b = ceil(|b| / n_b) near-equal batches, in every epoch. Batch k is (bucket, j) by one
binary search in the buckets' prefix of batch counts; each epoch deals a bucket's members anew through a keyed
permutation of its slots (`Order`), so batch j of bucket b in epoch e is a pure function of (seed, e, k) in
O(batch) time, and the loader's `shuffle=True` mixes the buckets' batches.

Costs: construction reads the lengths twice in chunks (memory-mapped lengths read through their file, so they stay
on disk) and builds the index of samples sorted by bucket, 4 bytes a sample (8 past 2**31 samples); nothing is per
epoch or per resume. With `cache=`, that is done once: later starts read the lengths once for their digest and map
the index (`loader.sources.array_cache`); the arithmetic stays in the pure functions below, the cache a shell.
A batch costs count x longest <= max_tokens tokens padded (so also in sum); a batch pads each sample to at most
the bucket's ratio, and a bucket's batches leave at most one batch's worth of budget unused: on 200,000 synthetic
SFT and speech lengths, 1-3% more batches and 1-2% padding than a best fit of all the epoch's lengths sorted
(`python -m benchmarks.budget`; `stats()` measures an epoch).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from loader.core.checks import check_num_samples, check_positive_int, is_int
from loader.core.order import EpochOrder, Order, sample_seed
from loader.sources.array_cache import cached, chunks, from_state, to_state

__all__ = ["OVERSIZE", "TokenBudgetBatches", "batch_counts", "bucket_bounds", "bucket_of", "sort_by_bucket"]

OVERSIZE = ("alone", "refuse")
CHUNK = 1 << 22  # lengths read per step at construction: bounded temporaries for memory-mapped lengths
BREAKS = 256  # batch sizes whose longest length bounds a bucket: past them the ratio's bounds are finer
_BUCKET = -1  # sample_seed index of a bucket's order key
_LAST = 2**63 - 1  # the last bucket's upper bound


def bucket_bounds(buckets: float | Sequence[int] | None, max_tokens: int) -> np.ndarray:
    """Ascending upper bounds of the buckets (bucket of length L: the first bound >= L): for a ratio, ceil(ratio**i)
    and max_tokens // n for n <= BREAKS (a bucket never straddles a length where a batch holds one more sample);
    the given ints for a list; none for None; always max_tokens (samples over the budget never share a bucket with
    those under it) and a last bound past every length."""
    if buckets is None:
        given = np.zeros(0, np.int64)
    elif isinstance(buckets, (int, float)) and not isinstance(buckets, bool):
        if not buckets > 1:
            raise ValueError(f"buckets (a ratio) must be > 1, got {buckets!r}; None for one bucket")
        steps = int(np.log(2.0**62) / np.log(buckets)) + 1
        breaks = max_tokens // np.arange(1, min(BREAKS, max_tokens) + 1)  # where a batch holds one more
        given = np.concatenate((np.ceil(float(buckets) ** np.arange(steps)).astype(np.int64), breaks))
    else:
        wrong = f"buckets must be a ratio > 1, None or a list of positive int bounds, got {buckets!r}"
        if not isinstance(buckets, (Sequence, np.ndarray)):  # a bool, a set: no bounds in a known order
            raise ValueError(wrong)
        given = np.asarray(list(buckets))
        if given.ndim != 1 or not all(is_int(b) and b > 0 for b in given.tolist()):
            raise ValueError(wrong)
    return np.unique(np.concatenate((given.astype(np.int64), [max_tokens, _LAST])))


def _check_chunk(chunk: np.ndarray, low: int) -> None:
    if chunk.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {chunk.dtype}")
    if chunk.dtype.kind == "i" and len(chunk) and chunk.min() < 0:
        at = low + int(np.argmax(chunk < 0))
        raise ValueError(f"lengths must be non-negative: sample {at} has length {int(chunk[at - low])}")


def _index_dtype(samples: int) -> np.dtype:
    return np.dtype(np.int32 if samples < 2**31 else np.int64)


def bucket_of(lengths: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each length's bucket: the first bound at or above it (a length 0 counting 1)."""
    return np.searchsorted(bounds, np.maximum(lengths.astype(np.int64), 1), side="left")


def batch_counts(members: np.ndarray, per_batch: np.ndarray, multiple_of: int) -> np.ndarray:
    """Batches per bucket: ceil(members / per batch), then one more for the bucket with the fullest batches
    (members / batches, the first of equals) until the total is a multiple of `multiple_of`."""
    batches = -(-members // per_batch)
    extra = -int(batches.sum()) % multiple_of
    if extra > int((members - batches).sum()):
        raise ValueError(
            f"{int(members.sum())} samples make {int(batches.sum())} batches, which cannot be split into a "
            f"multiple of multiple_of={multiple_of} batches (a batch holds one sample at least): pass a "
            f"smaller multiple_of or a smaller max_tokens"
        )
    fullest = [(-count / n, b) for b, (count, n) in enumerate(zip(members.tolist(), batches.tolist())) if count > n]
    heapq.heapify(fullest)
    for _ in range(extra):
        _, b = heapq.heappop(fullest)
        batches[b] += 1
        if members[b] > batches[b]:
            heapq.heappush(fullest, (-int(members[b]) / int(batches[b]), b))
    return batches


def sort_by_bucket(
    chunks: Iterable[tuple[int, np.ndarray]], bounds: np.ndarray, used: np.ndarray, members: np.ndarray
) -> np.ndarray:
    """The sample indices sorted by bucket (the `used` buckets, of these member counts), data order within one:
    a counting sort, chunk by chunk of the lengths."""
    samples = int(members.sum())
    index = np.empty(samples, _index_dtype(samples))
    cursor = np.zeros(len(bounds), np.int64)
    cursor[used] = np.concatenate(([0], np.cumsum(members)[:-1]))
    for low, chunk in chunks:
        bucket = bucket_of(chunk, bounds)
        order = np.argsort(bucket, kind="stable")
        ranked = bucket[order]
        within = np.arange(len(chunk)) - np.searchsorted(ranked, ranked, side="left")
        index[cursor[ranked] + within] = low + order
        cursor += np.bincount(bucket, minlength=len(bounds))
    return index


def _fits(table: np.ndarray, samples: int, buckets: int, multiple_of: int) -> bool:
    """Whether a buckets table (bucket, members, longest, batches) can be these samples': ascending buckets, members
    summing to the samples, 1 to members batches each, a multiple of `multiple_of` in all."""
    if table.ndim != 2 or table.shape[1] != 4 or not len(table):
        return False
    bucket, members, longest, batches = table.T
    return bool(
        (np.diff(bucket) > 0).all()
        and 0 <= bucket[0]
        and bucket[-1] < buckets
        and members.sum() == samples
        and (longest >= 1).all()
        and (batches >= 1).all()
        and (batches <= members).all()
        and batches.sum() % multiple_of == 0
    )


@functools.lru_cache(maxsize=1024)
def _deal(seed: int, bucket: int, members: int, epoch: int) -> EpochOrder:
    """A bucket's keyed order of its member slots in `epoch` (kept: its keys cost more than a batch's deal)."""
    return Order(members, seed=int(sample_seed(seed, bucket, _BUCKET))).for_epoch(epoch)


class TokenBudgetBatches(torch.utils.data.Dataset):
    """Batches of samples under a token budget, a map-style dataset: item k is the k-th batch, a pure function of
    (seed, epoch, k) and the lengths, so a `ResumableDataLoader(batches, batch_size=None)` resumes it exactly at
    any world size.

    Args:
        lengths: tokens per sample (an int array, a list, or a `.npy` path, memory-mapped); a sample of length 0
            counts as 1 (it still takes a row).
        max_tokens: the budget: a batch's count x longest (its padded size) is at most this.
        dataset: the samples; item k is then `dataset.__getitems__(members)` (or a list of `dataset[i]`); None:
            item k is the int64 tensor of the members' indices.
        buckets: a ratio > 1 (lengths within it of each other share a bucket, which pads a sample by at most that
            ratio), a list of int upper bounds, or None (one bucket: as many samples in every batch as the longest
            sample allows).
        max_samples: at most this many samples a batch (fairseq's `max_sentences`); None: no cap.
        oversize: a sample longer than max_tokens: "alone" (a batch of its own, over the budget, counted by
            `stats()`), or "refuse" (a ValueError naming it when the batches are made).
        multiple_of: the epoch's batch count is made a multiple of this by splitting the fullest batches: with it
            the global batch (world_size x grad_accum batches), nothing is dropped at the epoch's end in lockstep.
        seed: keys each bucket's deal of members per epoch.
        epoch: the default epoch, for batches asked by plain ints (`batches[k]`, torch's DataLoader); under a
            ResumableDataLoader every index carries the epoch of its batch (`epoch_aware`).
        cache: a directory where the index of samples by bucket is kept (True: the lengths' .npy's own), so that
            a restart maps it instead of sorting the lengths again: made once, keyed by the lengths' digest and the
            parameters (the seed aside: it only deals), checked against its digests on every load. None: made in
            memory at every start.
    """

    epoch_aware = True

    def __init__(
        self,
        lengths: Any,
        max_tokens: int,
        *,
        dataset: Any = None,
        buckets: float | Sequence[int] | None = 1.1,
        max_samples: int | None = None,
        oversize: str = "alone",
        multiple_of: int = 1,
        seed: int = 0,
        epoch: int = 0,
        cache: str | os.PathLike | bool | None = None,
    ) -> None:
        check_positive_int("max_tokens", max_tokens)
        check_positive_int("multiple_of", multiple_of)
        if max_samples is not None:
            check_positive_int("max_samples", max_samples)
        if oversize not in OVERSIZE:
            raise ValueError(f"oversize must be one of {OVERSIZE}, got {oversize!r}")
        for name, value in (("seed", seed), ("epoch", epoch)):
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        source = os.fspath(lengths) if isinstance(lengths, (str, os.PathLike)) else None
        if source is not None:
            lengths = np.load(source, mmap_mode="r", allow_pickle=False)
        lengths = lengths if isinstance(lengths, np.ndarray) else np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or not len(lengths):
            raise ValueError(f"lengths must be a non-empty 1-D array of ints, got shape {lengths.shape}")
        check_num_samples("len(lengths)", len(lengths))
        _check_chunk(lengths[:0], 0)
        if cache is True:
            if source is None:
                raise ValueError("cache=True keeps the index next to the lengths' .npy: pass lengths as a path")
            cache = os.path.dirname(os.path.abspath(source))
        self.lengths, self.max_tokens, self.dataset, self.max_samples = lengths, max_tokens, dataset, max_samples
        self.oversize, self.multiple_of, self.seed, self.epoch = oversize, multiple_of, seed, epoch
        self.bounds = bucket_bounds(buckets, max_tokens)
        self.index, table, self.built = self._index(cache or None)
        self.bucket_count, self.bucket_longest, self.bucket_batches = (np.array(table[:, c]) for c in (1, 2, 3))
        self.bucket_start = np.concatenate(([0], np.cumsum(self.bucket_count)[:-1])).astype(np.int64)
        self.batch_start = np.concatenate(([0], np.cumsum(self.bucket_batches))).astype(np.int64)

    def _index(self, cache: str | os.PathLike | None) -> tuple[np.ndarray, np.ndarray, bool]:
        """The samples sorted by bucket and the used buckets' table (bucket, members, longest, batches), built
        from the lengths or, with a cache directory, loaded there when made from the same lengths (their digest:
        one read of them) and parameters; also whether they were built."""
        digest = None
        if cache is not None:
            hashed = hashlib.sha256()
            for _, chunk in self._chunks():
                hashed.update(chunk.astype("<i8").tobytes())
            digest = hashed.hexdigest()
        key = {
            "lengths": digest,
            "samples": len(self.lengths),
            "bounds": self.bounds.tolist(),
            "max_tokens": self.max_tokens,
            "max_samples": self.max_samples,
            "oversize": self.oversize,
            "multiple_of": self.multiple_of,
        }

        def build() -> dict[str, np.ndarray]:
            nonlocal digest
            counts, longest, digest = self._survey()
            used = np.nonzero(counts)[0]
            per_batch = np.maximum(1, self.max_tokens // longest[used])
            if self.max_samples is not None:
                per_batch = np.minimum(per_batch, self.max_samples)
            batches = batch_counts(counts[used], per_batch, self.multiple_of)
            index = sort_by_bucket(self._chunks(), self.bounds, used, counts[used])
            return {"index": index, "buckets": np.stack([used, counts[used], longest[used], batches], 1)}

        fields = {"index": _index_dtype(len(self.lengths)), "buckets": np.dtype(np.int64)}
        arrays, built = cached(cache, "budget-index", key, fields, build)
        table = np.asarray(arrays["buckets"])
        if not _fits(table, len(self.lengths), len(self.bounds), self.multiple_of):
            raise ValueError(
                f"the cached index of TokenBudgetBatches in {cache} does not describe {len(self.lengths)} samples "
                f"(a buckets table of shape {table.shape}): delete its budget-index-* files to rebuild it"
            )
        self._lengths_digest = str(digest)[:16]
        return arrays["index"], table, built

    def _chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        for low, chunk in chunks(self.lengths, CHUNK):
            _check_chunk(chunk, low)
            yield low, chunk

    def _survey(self) -> tuple[np.ndarray, np.ndarray, str]:
        """One pass over the lengths: members and longest (at least 1) per bucket, and the lengths' digest."""
        counts = np.zeros(len(self.bounds), np.int64)
        longest = np.zeros(len(self.bounds), np.int64)
        digest = hashlib.sha256()
        for low, chunk in self._chunks():
            digest.update(chunk.astype("<i8").tobytes())
            if self.oversize == "refuse" and (chunk > self.max_tokens).any():
                at = low + int(np.argmax(chunk > self.max_tokens))
                over = sum(int((part > self.max_tokens).sum()) for _, part in self._chunks())
                raise ValueError(
                    f"sample {at} has {int(self.lengths[at])} tokens, more than max_tokens={self.max_tokens} "
                    f"({over} samples do): truncate them (and their lengths), raise max_tokens, or pass "
                    f'oversize="alone" (each in a batch of its own)'
                )
            bucket = bucket_of(chunk, self.bounds)
            counts += np.bincount(bucket, minlength=len(self.bounds))
            np.maximum.at(longest, bucket, np.maximum(chunk.astype(np.int64), 1))
        return counts, longest, digest.hexdigest()

    def __len__(self) -> int:
        return int(self.batch_start[-1])

    def _epoch_of(self, epoch: int | None, k: int | None = None) -> int:
        """The epoch to deal with: `epoch` if given, else the one the index carries, else the default."""
        return getattr(k, "epoch", self.epoch) if epoch is None else epoch

    def _locate(self, k: int) -> tuple[int, int]:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k < len(self):
            raise IndexError(f"batch {k!r} out of range for {len(self)} batches")
        bucket = int(np.searchsorted(self.batch_start, k, side="right")) - 1
        return bucket, int(k) - int(self.batch_start[bucket])

    def _deal(self, bucket: int, epoch: int) -> EpochOrder:
        return _deal(self.seed, bucket, int(self.bucket_count[bucket]), epoch)

    def members(self, k: int, epoch: int | None = None) -> np.ndarray:
        """The sample indices (ascending, int64) of batch k in `epoch` (default: the one k carries, else the
        default epoch): slots [j * |b| // c, (j + 1) * |b| // c) of its bucket b's deal, batch j of c."""
        bucket, j = self._locate(k)
        count, batches = int(self.bucket_count[bucket]), int(self.bucket_batches[bucket])
        slots = np.arange(j * count // batches, (j + 1) * count // batches, dtype=np.int64)
        dealt = self._deal(bucket, self._epoch_of(epoch, k))(slots)
        return np.sort(self.index[self.bucket_start[bucket] + dealt].astype(np.int64))

    def __getitem__(self, k: int) -> Any:
        members = self.members(k)
        if self.dataset is None:
            return torch.from_numpy(members)
        getitems = getattr(self.dataset, "__getitems__", None)
        indices = members.tolist()
        return getitems(indices) if callable(getitems) else [self.dataset[i] for i in indices]

    def describe(self, k: int, epoch: int | None = None) -> str:
        """Batch k and the samples it holds in `epoch`, as the audit names a sample."""
        members = self.members(k, epoch)
        bucket = self._locate(k)[0]
        return f"{k} ({len(members)} samples <= {int(self.bucket_longest[bucket])} tokens: {members.tolist()})"

    def stats(self, epoch: int | None = None) -> dict[str, float]:
        """One epoch's batches measured (O(samples), bucket by bucket): their count, samples, tokens, padded tokens
        (count x longest, summed), padding (1 - tokens / padded), fill (padded / (batches x max_tokens)) and the
        samples longer than max_tokens (each a batch of its own)."""
        epoch = self._epoch_of(epoch)
        tokens = padded = 0
        for bucket, (start, count, batches) in enumerate(
            zip(self.bucket_start.tolist(), self.bucket_count.tolist(), self.bucket_batches.tolist())
        ):
            dealt = self._deal(bucket, epoch)(np.arange(count, dtype=np.int64))
            lengths = np.asarray(self.lengths[self.index[start + dealt]]).astype(np.int64)
            cuts = np.arange(batches, dtype=np.int64) * count // batches
            tokens += int(lengths.sum())
            padded += int((np.maximum.reduceat(np.maximum(lengths, 1), cuts) * np.diff(np.append(cuts, count))).sum())
        over = int(self.bucket_count[self.bucket_longest > self.max_tokens].sum())
        return {
            "batches": len(self),
            "samples": len(self.lengths),
            "tokens": tokens,
            "padded_tokens": padded,
            "padding": 1 - tokens / padded,
            "fill": padded / (len(self) * self.max_tokens),
            "oversize": over,
        }

    def fingerprint(self) -> str:
        """Digests of the parameters and of the lengths (all of them, read once when the batches were made), for
        the checkpoint manifest: the same in every epoch."""
        bounds = hashlib.sha256(self.bounds.astype("<i8").tobytes()).hexdigest()[:16]
        layout = {
            "samples": len(self.lengths),
            "max_tokens": self.max_tokens,
            "buckets": bounds,
            "max_samples": self.max_samples,
            "oversize": self.oversize,
            "multiple_of": self.multiple_of,
            "seed": self.seed,
        }
        return f"{hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]}-{self._lengths_digest}"

    def explain_fingerprint(self, saved: str) -> str:
        """What changed since a checkpoint of fingerprint `saved`: the lengths, or the batching's parameters."""
        if saved.partition("-")[2] != self._lengths_digest:
            return "the lengths of the TokenBudgetBatches changed (their number or a value)"
        return "the TokenBudgetBatches' max_tokens, buckets, max_samples, oversize, multiple_of or seed changed"

    def __getstate__(self) -> dict:
        return to_state(self.__dict__)  # a spawned worker maps the cached index and the lengths' file again

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(from_state(state))

    def __repr__(self) -> str:
        return (
            f"TokenBudgetBatches({len(self)} batches of <= {self.max_tokens} tokens, {len(self.lengths)} "
            f"samples in {len(self.bucket_count)} buckets)"
        )
