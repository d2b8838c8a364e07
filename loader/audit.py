"""`python -m loader audit RUN_DIR`: per epoch, was every sample seen exactly once across all restarts?

Reads the identity ledger (`loader.ledger`) of a run, across generations and world sizes. An epoch is finished
when its dropped-by-policy record exists; for an epoch still in progress only duplicates can be judged.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from loader.ledger import read_ledger


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

    @property
    def clean(self) -> bool:
        return not len(self.skipped) and not len(self.duplicated)

    @property
    def not_yet_seen(self) -> int:
        """Samples of an unfinished epoch that no counted step delivered yet (of a finished one: the skipped)."""
        return self.expected - self.seen_once - len(self.duplicated) - self.dropped - len(self.failed)


def audit(run_dir) -> list[EpochAudit]:
    records, dropped, num_samples = read_ledger(run_dir)
    per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    failed_per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    for record in records:
        (failed_per_epoch if record.failed else per_epoch)[record.epoch].append(record.indices)
    report = []
    for epoch in sorted(set(per_epoch) | set(dropped) | set(failed_per_epoch)):
        counts = np.bincount(np.concatenate(per_epoch[epoch] + [np.zeros(0, np.int64)]), minlength=num_samples)
        failed = np.unique(np.concatenate(failed_per_epoch[epoch] + [np.zeros(0, np.int64)]))
        finished = epoch in dropped
        unseen = np.ones(num_samples, dtype=bool)
        unseen[counts > 0] = False
        unseen[failed] = False
        if finished:
            unseen[dropped[epoch]] = False
        report.append(EpochAudit(
            epoch=epoch,
            expected=num_samples,
            finished=finished,
            seen_once=int((counts == 1).sum()),
            skipped=np.nonzero(unseen)[0] if finished else np.zeros(0, np.int64),
            duplicated=np.nonzero(counts > 1)[0],
            dropped=len(dropped.get(epoch, ())),
            failed=failed,
        ))
    return report


def _listed(indices: np.ndarray, limit: int, describe: Callable[[int], str]) -> str:
    shown = ", ".join(describe(i) for i in indices[:limit].tolist())
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


EXACTLY_ONCE, FAILED, NO_LEDGER, UNFINISHED = 0, 1, 2, 3  # the exit statuses of `python -m loader audit`


def main(run_dir: str, limit: int = 20, describe: Callable[[int], str] = str) -> int:
    """Print the audit; `describe` names a sample (e.g. by its shard and key). Returns the exit status: EXACTLY_ONCE
    (every epoch finished, every sample once), FAILED (a sample skipped or duplicated), NO_LEDGER (nothing to
    audit), or UNFINISHED (an epoch in progress, nothing duplicated so far: a crashed job never restarted, or one
    still running)."""
    try:
        report = audit(run_dir)
    except (OSError, ValueError) as err:
        print(f"audit: {err}", file=sys.stderr)
        return NO_LEDGER
    print(f"{'epoch':>5} {'state':>11} {'expected':>9} {'seen once':>10} {'skipped':>8} {'duplicated':>11} "
          f"{'dropped by policy':>18} {'failed to load':>15}")
    for e in report:
        skipped = str(len(e.skipped)) if e.finished else "-"
        print(f"{e.epoch:>5} {'finished' if e.finished else 'in progress':>11} {e.expected:>9} {e.seen_once:>10} "
              f"{skipped:>8} {len(e.duplicated):>11} {e.dropped:>18} {len(e.failed):>15}")
        if len(e.skipped):
            print(f"      skipped indices: {_listed(e.skipped, limit, describe)}")
        if len(e.duplicated):
            print(f"      duplicated indices: {_listed(e.duplicated, limit, describe)}")
        if len(e.failed):
            print(f"      failed to load (consumed, not trained): {_listed(e.failed, limit, describe)}")
    if not all(e.clean for e in report):
        print("audit: FAILED (samples skipped or duplicated)")
        return FAILED
    unfinished = [e for e in report if not e.finished]
    for e in unfinished:
        print(f"audit: epoch {e.epoch} unfinished: {e.seen_once} of {e.expected} samples seen once so far, "
              f"{e.not_yet_seen} not yet seen, none duplicated (the job stopped mid-epoch, or is still running)")
    if unfinished:
        return UNFINISHED
    failed = sum(len(e.failed) for e in report)
    if failed:
        print(f"audit: nothing skipped or duplicated; {failed} sample(s) failed to load and were not trained")
    else:
        print("audit: every sample exactly once")
    return EXACTLY_ONCE
