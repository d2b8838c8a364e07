"""`python -m loader audit RUN_DIR`: per epoch, was every sample seen exactly once across all restarts?

Reads the identity ledger (`loader.checkpoint.ledger`) of a run, across generations and world sizes. An epoch is finished
when its dropped-by-policy record exists; for an epoch still in progress only duplicates can be judged. With a
`Grouping` (e.g. the sources of a mixture), each epoch also gets one row per group.
"""

from __future__ import annotations

import inspect
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from loader.checkpoint.ledger import Record, read_dropped, read_ledger

GROUP_CHUNK = 1 << 18  # indices grouped per call: bounds the memory a grouping function may take


@dataclass(frozen=True)
class Grouping:
    """Groups of dataset indices to report separately, e.g. by source: their names, and each index's group."""

    names: Sequence[str]
    of: Callable[[np.ndarray], np.ndarray]  # dataset indices -> group numbers
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
class EpochAudit:
    epoch: int
    expected: int
    finished: bool
    seen_once: int
    skipped: np.ndarray
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
        return (self.expected - self.seen_once - len(self.duplicated) - self.dropped - len(self.failed)
                - len(self.requested) + len(self.served_anyway) - len(self.filtered))


def _by_group(grouping: Grouping, counts: np.ndarray, **offending: np.ndarray) -> tuple[GroupAudit, ...]:
    """Each group's expected and seen-once counts (all indices, in chunks) and its share of the offending ones."""
    size = len(grouping.names)

    def tally(indices: np.ndarray) -> np.ndarray:
        return np.bincount(grouping.of(indices), minlength=size) if len(indices) else np.zeros(size, np.int64)

    expected, seen_once = np.zeros(size, np.int64), np.zeros(size, np.int64)
    for low in range(0, len(counts), GROUP_CHUNK):
        indices = np.arange(low, min(low + GROUP_CHUNK, len(counts)))
        expected += tally(indices)
        seen_once += tally(indices[counts[indices] == 1])
    kinds = ("skipped", "duplicated", "dropped", "failed", "requested", "filtered")
    columns = zip(expected, seen_once, *(tally(offending[k]) for k in kinds))
    return tuple(GroupAudit(name, *map(int, row)) for name, row in zip(grouping.names, columns))


def tally(records: list[Record], epochs,
          num_samples: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Per epoch (those of the records and `epochs`, in order): how many times the records delivered each index, the
    indices of the batches that failed to load, and how many times the loader's filter dropped each index."""
    per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    failed_per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    filtered_per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    for record in records:
        kind = failed_per_epoch if record.failed else filtered_per_epoch if record.filtered else per_epoch
        kind[record.epoch].append(record.indices)
    for epoch in sorted(set(per_epoch) | set(epochs) | set(failed_per_epoch) | set(filtered_per_epoch)):
        counts, filtered = (np.bincount(np.concatenate(kind[epoch] + [np.zeros(0, np.int64)]), minlength=num_samples)
                            for kind in (per_epoch, filtered_per_epoch))
        yield epoch, counts, np.unique(np.concatenate(failed_per_epoch[epoch] + [np.zeros(0, np.int64)])), filtered


def audit(run_dir, grouping: Grouping | None = None) -> list[EpochAudit]:
    records, dropped, num_samples = read_ledger(run_dir)
    if grouping is not None and grouping.num_samples != num_samples:
        raise ValueError(f"the grouping describes a dataset of {grouping.num_samples} samples, the ledger of {run_dir} "
                         f"one of {num_samples}: pass the one this run trained on")
    return audit_records(records, dropped, num_samples, grouping, read_dropped(run_dir, "skipped"))


def audit_records(records: list[Record], dropped: dict[int, np.ndarray], num_samples: int,
                  grouping: Grouping | None = None, requested: dict[int, np.ndarray] | None = None) -> list[EpochAudit]:
    """The audit of the records that count (`read_ledger`'s), with the indices skipped on request per epoch."""
    report, requested = [], requested or {}
    for epoch, counts, failed, filtered_counts in tally(records, set(dropped) | set(requested), num_samples):
        finished = epoch in dropped
        asked = np.unique(requested.get(epoch, np.zeros(0, np.int64)))
        filtered = np.nonzero(filtered_counts)[0]
        counts = counts + filtered_counts * (counts > 0)  # trained and also filtered: delivered twice
        unseen = np.ones(num_samples, dtype=bool)
        unseen[counts > 0] = False
        unseen[failed] = False
        unseen[asked] = False
        unseen[filtered] = False
        if finished:
            unseen[dropped[epoch]] = False
        skipped = np.nonzero(unseen)[0] if finished else np.zeros(0, np.int64)
        duplicated = np.union1d(np.nonzero(counts > 1)[0], np.nonzero(filtered_counts > 1)[0])
        filtered = filtered[(filtered_counts[filtered] == 1) & (counts[filtered] == 0)]
        dropped_here = dropped.get(epoch, np.zeros(0, np.int64))
        groups = () if grouping is None else _by_group(grouping, counts, skipped=skipped, duplicated=duplicated,
                                                       dropped=dropped_here, failed=failed, requested=asked,
                                                       filtered=filtered)
        report.append(EpochAudit(
            epoch=epoch,
            expected=num_samples,
            finished=finished,
            seen_once=int((counts == 1).sum()),
            skipped=skipped,
            duplicated=duplicated,
            dropped=len(dropped_here),
            failed=failed,
            groups=groups,
            requested=asked,
            served_anyway=asked[(counts[asked] > 0) | (filtered_counts[asked] > 0)],
            filtered=filtered,
        ))
    return report


def by_epoch(describe: Callable[..., str]) -> Callable[[int, int], str]:
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


def _listed(indices: np.ndarray, limit: int, describe: Callable[[int, int], str], epoch: int) -> str:
    shown = ", ".join(describe(i, epoch) for i in indices[:limit].tolist())
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


EXACTLY_ONCE, FAILED, NO_LEDGER, UNFINISHED = 0, 1, 2, 3  # the exit statuses of `python -m loader audit`
EXIT_STATUSES = f"""exit statuses:
  {EXACTLY_ONCE}: every epoch finished, every sample exactly once (failed-to-load, skipped-on-request and
     filtered-by-policy samples listed, not trained)
  {FAILED}: a sample was skipped or duplicated
  {NO_LEDGER}: no ledger to audit (no such directory, or a run without a Ledger attached)
  {UNFINISHED}: an epoch unfinished, nothing duplicated so far (the job stopped mid-epoch, or is still running)"""


def main(run_dir: str, limit: int = 20, describe: Callable[..., str] = str, grouping: Grouping | None = None) -> int:
    """Print the audit; `describe` names a sample (e.g. by its shard and key; with an `epoch` parameter, as the
    sample was in that epoch, e.g. a packed row: see `by_epoch`), `grouping` adds a row per group (e.g.
    per source of a mixture) under each epoch's. Returns the exit status: EXACTLY_ONCE (every epoch finished, every
    sample once), FAILED (a sample skipped or duplicated), NO_LEDGER (nothing to audit), or UNFINISHED (an epoch in
    progress, nothing duplicated so far: a crashed job never restarted, or one still running)."""
    try:
        report = audit(run_dir, grouping)
    except (OSError, ValueError) as err:
        print(f"audit: {err}", file=sys.stderr)
        return NO_LEDGER
    name = by_epoch(describe)
    for note in () if grouping is None else grouping.notes:
        print(note)
    print(f"{'epoch':>5} {'state':>11} {'expected':>9} {'seen once':>10} {'skipped':>8} {'duplicated':>11} "
          f"{'dropped by policy':>18} {'failed to load':>15} {'skipped on request':>19} {'filtered by policy':>19}")
    for e in report:
        skipped = str(len(e.skipped)) if e.finished else "-"
        print(f"{e.epoch:>5} {'finished' if e.finished else 'in progress':>11} {e.expected:>9} {e.seen_once:>10} "
              f"{skipped:>8} {len(e.duplicated):>11} {e.dropped:>18} {len(e.failed):>15} {len(e.requested):>19} "
              f"{len(e.filtered):>19}")
        for g in e.groups:
            print(f"{'':>5} {g.name:>11} {g.expected:>9} {g.seen_once:>10} {g.skipped if e.finished else '-':>8} "
                  f"{g.duplicated:>11} {g.dropped:>18} {g.failed:>15} {g.requested:>19} {g.filtered:>19}")
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
        if len(e.served_anyway):
            print(f"      served although skipped on request: {_listed(e.served_anyway, limit, name, e.epoch)}")
    if not all(e.clean for e in report):
        print("audit: FAILED (samples skipped or duplicated, or served although skipped on request)")
        return FAILED
    unfinished = [e for e in report if not e.finished]
    for e in unfinished:
        print(f"audit: epoch {e.epoch} unfinished: {e.seen_once} of {e.expected} samples seen once so far, "
              f"{e.not_yet_seen} not yet seen, none duplicated (the job stopped mid-epoch, or is still running)")
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
    return EXACTLY_ONCE
