"""`python -m loader audit RUN_DIR`: per epoch, was every sample seen exactly once across all restarts?

Reads the identity ledger (`loader.checkpoint.ledger`) of a run, across generations and world sizes. An epoch is
finished when the ledger records its end (`read_run`), or when nothing of it is left unseen; for an epoch still in
progress only duplicates can be judged. With a `Grouping` (e.g. the sources of a mixture), each epoch also gets one
row per group.

Memory follows what the ledger recorded, not the dataset's length N: the records (8 bytes an index, as on disk), the
sorted distinct indices of one epoch at a time, and the samples never seen kept as intervals. A ledger of a few
records of an N = 10**9 dataset is audited in a few MB; a whole epoch of N = 10**9 needs about 3 x 8 GB.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from loader.checkpoint.ledger import LedgerError, Record, RunLedger, read_run
from loader.core.progress import EMPTY, complement, spans_of, total
from loader.streams.filtered import WIDTH, records_of
from loader.streams.filtered import describe as describe_record

GROUP_CHUNK = 1 << 18  # indices grouped per call: bounds the memory a grouping function may take
T = TypeVar("T")


@dataclass(frozen=True)
class Grouping:
    """Groups of dataset indices to report separately, e.g. by source: their names, and each index's group."""

    names: Sequence[str]
    of: Callable[..., np.ndarray]  # dataset indices -> group numbers; with an `epoch` parameter, of that epoch (a
    # mixture whose epochs continue its stream holds other samples at an index in each epoch)
    num_samples: int  # the dataset length it groups: the ledger's must be the same
    notes: Sequence[str] = ()  # lines printed above the table, e.g. where a mixture's schedule changed


@dataclass(frozen=True)
class GroupAudit:
    """One group's part of an epoch's audit (counts only; the epoch's row lists the offending indices)."""

    name: str
    expected: int
    seen_once: int
    skipped: int
    duplicated: int
    dropped: int
    failed: int
    requested: int = 0  # skipped on request (`loader.skip`)
    filtered: int = 0  # filtered by policy (the loader's `filter=`)


@dataclass(frozen=True)
class Unseen:
    """Indices no counted step delivered, as intervals: a finished epoch's skipped samples may be most of a dataset
    of billions, which an array of them would hold in memory."""

    spans: np.ndarray  # sorted, disjoint [start, stop) intervals

    def __len__(self) -> int:
        return total(self.spans)

    def chunks(self, size: int) -> Iterator[np.ndarray]:
        """The indices in increasing order, at most `size` at a time."""
        for start, stop in self.spans.tolist():
            for low in range(start, stop, size):
                yield np.arange(low, min(low + size, stop), dtype=np.int64)

    def head(self, count: int) -> np.ndarray:
        """The first `count` indices."""
        taken = []
        for chunk in self.chunks(max(count, 1)):
            if count <= 0:
                break
            taken.append(chunk[:count])
            count -= len(taken[-1])
        return np.concatenate(taken + [np.zeros(0, np.int64)])

    def tolist(self) -> list[int]:
        return [i for chunk in self.chunks(GROUP_CHUNK) for i in chunk.tolist()]


@dataclass(frozen=True)
class EpochTally:
    """What the counted records of one epoch delivered: each distinct index and how often, the failed ones, and each
    distinct index the loader's filter dropped and how often. A sample filtered and also trained, or filtered twice,
    was consumed more than once: duplicated, as one trained twice."""

    epoch: int
    delivered: np.ndarray  # sorted distinct indices of the delivered batches (trained)
    times: np.ndarray  # how often each was delivered
    failed: np.ndarray  # sorted distinct indices of the batches that failed to load
    filtered: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sorted distinct indices the
    # loader's filter dropped (consumed, never trained)
    filtered_times: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # how often each was dropped

    @property
    def once(self) -> np.ndarray:
        """Trained once, never filtered."""
        return np.setdiff1d(self.delivered[self.times == 1], self.filtered, assume_unique=True)

    @property
    def filtered_once(self) -> np.ndarray:
        """Filtered once, never trained: filtered by policy."""
        return np.setdiff1d(self.filtered[self.filtered_times == 1], self.delivered, assume_unique=True)

    @property
    def duplicated(self) -> np.ndarray:
        """Consumed more than once: trained twice, filtered twice, or trained and filtered."""
        return np.union1d(
            np.union1d(self.delivered[self.times > 1], self.filtered[self.filtered_times > 1]),
            np.intersect1d(self.delivered, self.filtered, assume_unique=True),
        )


@dataclass(frozen=True)
class EpochAudit:
    epoch: int
    expected: int
    finished: bool
    seen_once: int
    skipped: Unseen  # of a finished epoch; an unfinished one's unseen are not yet seen, not skipped
    duplicated: np.ndarray
    dropped: int
    failed: np.ndarray  # samples of batches whose loading raised: consumed, never trained, never served again
    groups: tuple[GroupAudit, ...] = ()
    requested: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # skipped on request
    served_anyway: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # skipped on request, yet
    # delivered: a skip the loader did not keep
    filtered: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # filtered by policy (the loader's
    # `filter=`): consumed, never trained

    @property
    def clean(self) -> bool:
        return not len(self.skipped) and not len(self.duplicated) and not len(self.served_anyway)

    @property
    def not_yet_seen(self) -> int:
        """Samples of an unfinished epoch that no counted step delivered yet (of a finished one: the skipped)."""
        return (
            self.expected
            - self.seen_once
            - len(self.duplicated)
            - self.dropped
            - len(self.failed)
            - len(self.requested)
            + len(self.served_anyway)
            - len(self.filtered)
        )


def _by_group(
    grouping: Grouping, epoch: int, num_samples: int, once: np.ndarray, skipped: Unseen, **offending: np.ndarray
) -> tuple[GroupAudit, ...]:
    """Each group's expected count (all indices, in chunks), and its share of those seen once and the offending."""
    size, of = len(grouping.names), by_epoch(grouping.of)

    def tally_of(indices: np.ndarray) -> np.ndarray:
        return np.bincount(of(indices, epoch), minlength=size) if len(indices) else np.zeros(size, np.int64)

    def chunked(chunks: Iterable[np.ndarray]) -> np.ndarray:
        return sum((tally_of(chunk) for chunk in chunks), np.zeros(size, np.int64))

    expected = chunked(Unseen(np.array([[0, num_samples]], np.int64)).chunks(GROUP_CHUNK))
    seen_once = chunked(np.array_split(once, max(1, -(-len(once) // GROUP_CHUNK))))
    kinds = ("duplicated", "dropped", "failed", "requested", "filtered")
    columns = zip(expected, seen_once, chunked(skipped.chunks(GROUP_CHUNK)), *(tally_of(offending[k]) for k in kinds))
    return tuple(GroupAudit(name, *map(int, row)) for name, row in zip(grouping.names, columns))


def tally(records: list[Record], epochs: Iterable[int]) -> Iterator[EpochTally]:
    """Per epoch (those of the records and `epochs`, in order): the distinct indices the records delivered and how
    often, the indices of the batches that failed to load, and the distinct indices the loader's filter dropped and
    how often. One epoch's indices in memory at a time."""
    per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    failed_per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    filtered_per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    for record in records:
        kind = failed_per_epoch if record.failed else filtered_per_epoch if record.filtered else per_epoch
        kind[record.epoch].append(record.indices)
    for epoch in sorted(set(per_epoch) | set(epochs) | set(failed_per_epoch) | set(filtered_per_epoch)):
        delivered, times = _distinct(per_epoch.pop(epoch, []))
        filtered, filtered_times = _distinct(filtered_per_epoch.pop(epoch, []))
        failed = np.unique(np.concatenate(failed_per_epoch.pop(epoch, []) + [np.zeros(0, np.int64)]))
        yield EpochTally(epoch, delivered, times, failed, filtered, filtered_times)


def _distinct(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct indices of `batches`, and how often each occurs."""
    return np.unique(np.concatenate(batches + [np.zeros(0, np.int64)]), return_counts=True)


def read_indexed(run_dir: str | os.PathLike) -> RunLedger:
    """The ledger of a run that recorded dataset indices (`read_run`); a stream's is refused with a LedgerError
    saying what reads it."""
    run = read_run(run_dir)
    if run.stream:
        raise LedgerError(
            f"{run_dir}: the ledger of a stream's run (Ledger.open_stream) names the records its filter dropped, "
            f"not dataset indices: read it with audit_stream(run_dir) (python -m loader audit does)"
        )
    return run


def audit(run_dir: str | os.PathLike, grouping: Grouping | None = None) -> list[EpochAudit]:
    """The audit of a run's ledger; raises FileNotFoundError (no ledger) or LedgerError (a file unreadable or
    inconsistent, named with its field; a stream's ledger, see `audit_stream`) before judging anything."""
    return _report(read_indexed(run_dir), grouping, run_dir)


def _report(run: RunLedger, grouping: Grouping | None, run_dir: str | os.PathLike) -> list[EpochAudit]:
    if grouping is not None and grouping.num_samples != run.num_samples:
        raise LedgerError(
            f"the grouping describes a dataset of {grouping.num_samples} samples, the ledger of {run_dir} "
            f"one of {run.num_samples}: pass the one this run trained on"
        )
    return audit_records([r for r in run.records if r.counted], run.dropped, run.num_samples, grouping, run.requested)


def audit_records(
    records: list[Record],
    dropped: dict[int, np.ndarray],
    num_samples: int,
    grouping: Grouping | None = None,
    requested: dict[int, np.ndarray] | None = None,
) -> list[EpochAudit]:
    """The audit of the records that count (`read_ledger`'s), with the indices skipped on request per epoch. An
    epoch is finished when `dropped` lists it, or when nothing of it is left unseen (none can be skipped then)."""
    report, requested = [], requested or {}
    for t in tally(records, set(dropped) | set(requested)):
        asked = np.unique(requested.get(t.epoch, np.zeros(0, np.int64)))
        dropped_here = np.unique(dropped.get(t.epoch, np.zeros(0, np.int64)))
        unseen = complement(
            spans_of(np.concatenate((t.delivered, t.failed, asked, dropped_here, t.filtered))), num_samples
        )
        finished = t.epoch in dropped or not len(unseen)
        skipped = Unseen(unseen if finished else EMPTY)
        once, duplicated, filtered = t.once, t.duplicated, t.filtered_once
        groups = (
            ()
            if grouping is None
            else _by_group(
                grouping,
                t.epoch,
                num_samples,
                once,
                skipped,
                duplicated=duplicated,
                dropped=dropped_here,
                failed=t.failed,
                requested=asked,
                filtered=filtered,
            )
        )
        report.append(
            EpochAudit(
                epoch=t.epoch,
                expected=num_samples,
                finished=finished,
                seen_once=len(once),
                skipped=skipped,
                duplicated=duplicated,
                dropped=len(dropped_here),
                failed=t.failed,
                groups=groups,
                requested=asked,
                served_anyway=np.intersect1d(asked, np.union1d(t.delivered, t.filtered), assume_unique=True),
                filtered=filtered,
            )
        )
    return report


@dataclass(frozen=True)
class StreamEpochAudit:
    """One epoch of a stream's run (`Ledger.open_stream`): the records its filter dropped, as rows (rank, source,
    batch, record) named by `loader.streams.filtered.describe`, those named once and those named more than once (a
    record consumed twice). Its trained records have no index: the ledger counts its steps, not them."""

    epoch: int
    filtered: np.ndarray  # (n, 4): named once, filtered by policy
    duplicated: np.ndarray  # (m, 4): named more than once

    @property
    def clean(self) -> bool:
        return not len(self.duplicated)


def audit_stream(run_dir: str | os.PathLike) -> list[StreamEpochAudit]:
    """The audit of a stream's run: per epoch that counted records hold, the records its filter dropped."""
    run = read_run(run_dir)
    if not run.stream:
        raise LedgerError(f"{run_dir}: the ledger of a map-style run, which audit(run_dir) reads")
    return _stream_report(run)


def _stream_report(run: RunLedger) -> list[StreamEpochAudit]:
    named: dict[int, list[np.ndarray]] = defaultdict(lambda: [np.zeros((0, WIDTH), np.int64)])
    for r in run.records:
        if r.counted:
            named[r.epoch] += [records_of(r.indices, r.rank)] if r.filtered else []
    report = []
    for epoch, rows in sorted(named.items()):
        distinct, times = np.unique(np.concatenate(rows), axis=0, return_counts=True)
        report.append(StreamEpochAudit(epoch, distinct[times == 1], distinct[times > 1]))
    return report


def _stream_main(report: list[StreamEpochAudit], limit: int) -> int:
    """`main` for a stream's run: per epoch the records its filter dropped, counted and named."""
    print(f"{'epoch':>5} {'filtered by policy':>19} {'named twice or more':>20}")
    for e in report:
        print(f"{e.epoch:>5} {len(e.filtered):>19} {len(e.duplicated):>20}")
        for label, rows in (("filtered by policy (consumed, not trained)", e.filtered), ("named twice", e.duplicated)):
            if len(rows):
                more = f", ... ({len(rows)} in all)" if len(rows) > limit else ""
                print(f"      {label}: {', '.join(map(describe_record, rows[:limit]))}{more}")
    if not all(e.clean for e in report):
        print("audit: FAILED (a stream's record filtered more than once)")
        return FAILED
    filtered = sum(len(e.filtered) for e in report)
    print(
        f"audit: a stream's run: {filtered} record(s) filtered by policy (the loader's filter=), each named once, "
        f"not trained (its trained records have no index to name)"
    )
    return EXACTLY_ONCE


def by_epoch(describe: Callable[..., T]) -> Callable[[Any, int], T]:
    """`describe` as a function of (index, epoch): a describer with an `epoch` parameter (`PackedSource.describe`,
    whose rows hold other documents in each epoch) names an index as the ledger's epoch had it; any other names it
    alike in every epoch."""
    try:
        takes_epoch = "epoch" in inspect.signature(describe).parameters
    except (TypeError, ValueError):  # a builtin without a signature (str)
        takes_epoch = False
    if takes_epoch:
        return lambda index, epoch: describe(index, epoch=epoch)
    return lambda index, epoch: describe(index)


def _listed(indices: np.ndarray | Unseen, limit: int, describe: Callable[[int, int], str], epoch: int) -> str:
    first = indices.head(limit) if isinstance(indices, Unseen) else indices[:limit]
    shown = ", ".join(describe(i, epoch) for i in first.tolist())
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


EXACTLY_ONCE, FAILED, NO_LEDGER, UNFINISHED = 0, 1, 2, 3  # the exit statuses of `python -m loader audit`
EXIT_STATUSES = f"""exit statuses:
  {EXACTLY_ONCE}: every epoch finished, every sample exactly once (failed-to-load, skipped-on-request and
     filtered-by-policy samples listed, not trained); a stream's run: every record its filter dropped named once
  {FAILED}: a sample was skipped or duplicated
  {NO_LEDGER}: no ledger to audit (no such directory, a run without a Ledger attached), or an input that cannot
     be read or contradicts the rest (the file and field named on stderr)
  {UNFINISHED}: an epoch unfinished, nothing duplicated so far (the job stopped mid-epoch, or is still running)"""


class FilteredDocuments(Protocol):
    """A source that filters documents before it forms its samples (`PackedSource(keep=)`): the documents it
    dropped in an epoch (consumed by no sample, never trained) and their names."""

    def filtered_documents(self, epoch: int) -> np.ndarray: ...

    def describe_document(self, start: int) -> str: ...


def main(
    run_dir: str,
    limit: int = 20,
    describe: Callable[..., str] = str,
    grouping: Grouping | None = None,
    documents: FilteredDocuments | None = None,
) -> int:
    """Print the audit; `describe` names a sample (e.g. by its shard and key; with an `epoch` parameter, as the
    sample was in that epoch, e.g. a packed row: see `by_epoch`), `grouping` adds a row per group (e.g.
    per source of a mixture) under each epoch's, `documents` (a `PackedSource` with keep=) lists per epoch the
    documents it filtered by policy before packing. Returns the exit status: EXACTLY_ONCE (every epoch finished, every
    sample once), FAILED (a sample skipped or duplicated), NO_LEDGER (nothing to audit, or a ledger file unreadable or
    inconsistent), or UNFINISHED (an epoch in
    progress, nothing duplicated so far: a crashed job never restarted, or one still running)."""
    try:
        run = read_run(run_dir)
        if run.stream:
            return _stream_main(_stream_report(run), limit)
        report = _report(run, grouping, run_dir)
    except (OSError, LedgerError) as err:
        print(f"audit: {err}", file=sys.stderr)
        return NO_LEDGER
    name = by_epoch(describe)
    for note in () if grouping is None else grouping.notes:
        print(note)
    print(
        f"{'epoch':>5} {'state':>11} {'expected':>9} {'seen once':>10} {'skipped':>8} {'duplicated':>11} "
        f"{'dropped by policy':>18} {'failed to load':>15} {'skipped on request':>19} {'filtered by policy':>19}"
    )
    for e in report:
        skipped = str(len(e.skipped)) if e.finished else "-"
        print(
            f"{e.epoch:>5} {'finished' if e.finished else 'in progress':>11} {e.expected:>9} {e.seen_once:>10} "
            f"{skipped:>8} {len(e.duplicated):>11} {e.dropped:>18} {len(e.failed):>15} {len(e.requested):>19} "
            f"{len(e.filtered):>19}"
        )
        for g in e.groups:
            print(
                f"{'':>5} {g.name:>11} {g.expected:>9} {g.seen_once:>10} {g.skipped if e.finished else '-':>8} "
                f"{g.duplicated:>11} {g.dropped:>18} {g.failed:>15} {g.requested:>19} {g.filtered:>19}"
            )
        if len(e.skipped):
            print(f"      skipped indices: {_listed(e.skipped, limit, name, e.epoch)}")
        if len(e.duplicated):
            print(f"      duplicated indices: {_listed(e.duplicated, limit, name, e.epoch)}")
        if len(e.failed):
            print(f"      failed to load (consumed, not trained): {_listed(e.failed, limit, name, e.epoch)}")
        if len(e.requested):
            print(f"      skipped on request (never served, not trained): {_listed(e.requested, limit, name, e.epoch)}")
        if len(e.filtered):
            print(f"      filtered by policy (consumed, not trained): {_listed(e.filtered, limit, name, e.epoch)}")
        dropped_documents = np.zeros(0, np.int64) if documents is None else documents.filtered_documents(e.epoch)
        if documents is not None and len(dropped_documents):
            shown = ", ".join(map(documents.describe_document, dropped_documents[:limit].tolist()))
            more = f", ... ({len(dropped_documents)} in all)" if len(dropped_documents) > limit else ""
            print(f"      documents filtered by policy before packing (keep=, never trained): {shown}{more}")
        if len(e.served_anyway):
            print(f"      served although skipped on request: {_listed(e.served_anyway, limit, name, e.epoch)}")
    if not all(e.clean for e in report):
        print("audit: FAILED (samples skipped or duplicated, or served although skipped on request)")
        return FAILED
    unfinished = [e for e in report if not e.finished]
    for e in unfinished:
        print(
            f"audit: epoch {e.epoch} unfinished: {e.seen_once} of {e.expected} samples seen once so far, "
            f"{e.not_yet_seen} not yet seen, none duplicated (the job stopped mid-epoch, or is still running)"
        )
    if unfinished:
        return UNFINISHED
    failed, requested = sum(len(e.failed) for e in report), sum(len(e.requested) for e in report)
    if failed:
        print(f"audit: nothing skipped or duplicated; {failed} sample(s) failed to load and were not trained")
    else:
        print("audit: every sample exactly once")
    if requested:
        print(f"audit: {requested} sample(s) skipped on request, never served")
    filtered = sum(len(e.filtered) for e in report)
    if filtered:
        print(f"audit: {filtered} sample(s) filtered by policy (the loader's filter=), not trained")
    if documents is not None and report:
        count = sum(len(documents.filtered_documents(e.epoch)) for e in report)
        print(
            f"audit: {count} document(s) filtered by policy before packing (keep=, over {len(report)} "
            f"epoch(s)), not trained"
        )
    return EXACTLY_ONCE
