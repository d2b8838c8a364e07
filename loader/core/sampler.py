"""The stateful rank sampler: this rank's micro-batches of dataset indices, from committed progress on.

It yields; it does not count. The loader tells it when a batch is *delivered* (handed to the training loop), so
batches that workers prefetched are never progress, and `state_dict` reports only micro-batches of completed
updates. Iterating reads the cursor (epoch, delivered) once, so a new pass continues right after the last
delivered batch, whatever was prefetched before.
"""

from __future__ import annotations

import copy
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike

from loader.core.checks import check_rank, is_int
from loader.core.order import EpochOrder, Order
from loader.core.partition import EpochPlan, Layout, plan_at, samples_of_updates, updates_of_samples
from loader.core.progress import EMPTY, Remaining, contains, difference, spans_of, union, whole
from loader.core.state import (
    MAX_EPOCHS_AHEAD,
    Progress,
    RankProgress,
    base_digest,
    check_fingerprint,
    check_schedule,
    merge,
    progress_of,
    rank_state,
    short,
)


class AbandonedEpochWarning(UserWarning):
    """set_epoch() left an epoch part way through: the rest of it is never trained in this run. Said because an
    epoch counter that is off by one after a resume would otherwise skip data silently."""


def warn_abandoned(epoch: int, current: int, left: str) -> None:
    """set_epoch(epoch) leaves `current` part way, `left` saying what of it this rank never delivers."""
    warnings.warn(
        f"set_epoch({epoch}) abandons epoch {current} part way: {left} and are never trained in this run. To "
        f"finish the epoch, call set_epoch({current}) (a loader resumed by load_state_dict is already in its epoch: "
        f"loop from loader.epoch); to abandon it on purpose, silence {AbandonedEpochWarning.__name__}",
        AbandonedEpochWarning,
        stacklevel=4,
    )


CHUNK_SAMPLES = 8192  # ids computed per vectorised call: amortises numpy's per-call cost (~40 us a chunk), keeps
# the first batch fast (< 1 ms) and the working set small (~0.3 MB)


@dataclass(frozen=True)
class EpochView:
    """Everything needed to turn (rank, micro-batch number) into dataset indices within one epoch."""

    epoch: int
    remaining: Remaining
    plan: EpochPlan
    order: EpochOrder

    def indices(self, rank: int, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dataset indices of the given micro-batches, flat, and the offsets that split them per batch."""
        starts, stops = self.plan.batch_bounds(rank, batches)
        sizes = stops - starts
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], sizes)
        return self.order(self.remaining.positions(np.repeat(starts, sizes) + within)), offsets


class ResumableSampler:
    """Deals this rank its share of each epoch, resuming from any committed progress at any world size."""

    def __init__(
        self,
        order: Order,
        layout: Layout,
        rank: int,
        schedule: tuple[tuple[int, int], ...] | None = None,
        amended: tuple[tuple[tuple[int, int], ...], int] | None = None,
    ):
        """`schedule`: the global batch by optimizer step of a batch-size ramp (K per update follows it, and the
        progress keeps the step); `amended`: (the schedule it changes, the step it changes at), for a resume."""
        check_rank(rank, layout.world_size)
        self.order, self.layout, self.rank = order, layout, rank
        self.schedule, self.amended = schedule, amended
        self._first_step = 0  # with a schedule: the optimizer step of the current epoch's first update
        # (view, first batch, ids, offsets) of the chunks served last: workers prefetch far less than a chunk ahead,
        # so the batch just delivered is almost always in one of them and last_indices slices it (else recomputes)
        self._recent_chunks: deque = deque(maxlen=2)
        self.delivered_any = False  # a batch was delivered (or failed) since the progress was last loaded
        self._bases_set = 0
        self._start_epoch(0, Progress(order.fingerprint(), 0, {}, schedule=schedule))

    # -- the cursor ------------------------------------------------------------------------------------------------

    def _start_epoch(self, epoch: int, base: Progress | None = None, *, ended: bool = False) -> None:
        self._base = base or Progress(self.order.fingerprint(), epoch, {}, schedule=self.schedule, step=self.step)
        self._bases_set += 1  # every rank of one job sets its progress the same number of times
        self._base_digest: str | None = None
        self._enter(epoch, ended, self._base.step)

    def _enter(self, epoch: int, ended: bool = False, first_step: int | None = None) -> None:
        """Put the cursor at the start of `epoch`'s remaining positions under the current base; its first update is
        step `first_step` (default: the one after the current epoch's last update, the natural advance)."""
        if first_step is None:
            first_step = self._first_step + self.view().plan.updates
        self._view: EpochView | None = None  # made by view() on first use
        self._epoch, self._position, self._first_step = epoch, 0, first_step
        self._ended = ended  # the current pass handed out its end: the next pass starts the next epoch
        self._last_delivered: int | None = None  # micro-batch number of the batch delivered last in this epoch
        # position 0 follows whole updates committed earlier in this epoch (a resumed state): an update is complete
        self._after_committed = epoch < self._base.epoch or len(self._base.committed_in(epoch)) > 0

    def view(self, epoch: int | None = None) -> EpochView:
        """The current epoch's view (cached: O(#intervals + #blocks) to build), or another epoch's. An epoch the
        base reports finished has nothing remaining (a state restored at the end of that epoch sits there)."""
        epoch = self._epoch if epoch is None else epoch
        if self._view is not None and self._view.epoch == epoch:
            return self._view
        n = self.order.num_samples
        committed = whole(n) if epoch < self._base.epoch else self._base.committed_in(epoch)
        remaining = Remaining(committed, n)
        first_step = self._first_step if epoch == self._epoch else self._first_step + self.view().plan.updates
        plan = plan_at(remaining.count, self.layout, self.schedule, first_step)  # epoch is this one or the next
        view = EpochView(epoch, remaining, plan, self.order.for_epoch(epoch))
        if epoch == self._epoch:
            self._view = view
        return view

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """With a schedule: the optimizer updates completed, all epochs, as the progress counts them."""
        plan = self.view().plan
        return self._first_step + plan.updates_in(plan.completed(self._position))

    @property
    def grad_accum(self) -> int:
        """K of the update the next micro-batch belongs to (of the next epoch's first, past this rank's share)."""
        if self.exhausted:
            return self.view(self._epoch + 1).plan.layout.grad_accum
        return self.view().plan.grad_accum_at(self._position)

    @property
    def exhausted(self) -> bool:
        """This rank's share of the current epoch is all handed out (delivered, or failed to load)."""
        return self._position >= self.view().plan.batches_per_rank

    @property
    def ended(self) -> bool:
        """The current pass handed its end (StopIteration) to the training loop."""
        return self._ended

    def set_epoch(self, epoch: int) -> bool:
        """Names the epoch the next pass serves. The current one: what is left of it (the usual call after a
        resume keeps the progress; after a pass that ended, the next pass is empty). The next one after an
        exhausted pass: the natural advance. Any other: that epoch from its start, abandoning the rest.
        Returns whether the next pass changed."""
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch == self._epoch:
            changed, self._ended = self._ended, False
            return changed
        if epoch == self._epoch + 1 and self.exhausted:
            self._enter(epoch)
            return True
        if (self._position > 0 or self._after_committed) and not self.exhausted:
            left = self.view().plan.batches_per_rank - self._position
            warn_abandoned(epoch, self._epoch, f"{left} micro-batch(es) of rank {self.rank}'s share were not delivered")
        self._start_epoch(epoch)
        return True

    def begin_pass(self) -> None:
        """Called when a pass starts: after a pass that ended, move on to the next epoch. An exhausted pass that
        did not end yet (its last batch delivered, its StopIteration not) ends first, as an empty pass."""
        if self._ended:
            self.set_epoch(self._epoch + 1)

    @property
    def at_epoch_start(self) -> bool:
        """Nothing of the current epoch is handed out on this rank (an epoch restored as finished excepted)."""
        return self._position == 0 and self._epoch >= self._base.epoch

    def next_pass(self) -> ResumableSampler:
        """A copy of this sampler as a pass started now would find it (after `begin_pass`), to tell what that pass
        yields without starting it."""
        ahead = copy.copy(self)
        ahead._recent_chunks = deque(maxlen=2)  # its own: follow_length clears it
        ahead.begin_pass()
        return ahead

    def follow_length(self, order: Order) -> None:
        """The dataset changed length before this epoch started: deal `order`, built for the new length, from this
        epoch on (earlier epochs are finished whatever they committed). Progress committed under the old length for
        this epoch or a later one cannot be mapped onto the new one: refused, before anything changes."""
        old, new = self.order.num_samples, order.num_samples
        ahead = [e for e in self._base.committed if e >= self._epoch]
        if ahead:
            raise ValueError(
                f"the dataset's length changed from {old} to {new} before epoch {self._epoch} started, but epoch "
                f"{min(ahead)} has progress committed under {old} samples, whose positions would name other samples "
                f"now: resume with the dataset of {old} samples until that epoch is done, then change it"
            )
        self.order = order
        self._recent_chunks.clear()
        self._start_epoch(self._epoch)

    def deliver(self) -> None:
        """The loader handed the next micro-batch to the training loop."""
        self._last_delivered = self._position
        self._position += 1
        self.delivered_any = True

    def fail(self) -> None:
        """Loading the next micro-batch raised: it is consumed (never served again), but not delivered."""
        self._position += 1
        self.delivered_any = True

    @property
    def handed_out(self) -> int:
        """Micro-batches of the current epoch handed out on this rank so far: delivered, or failed to load."""
        return self._position

    @property
    def progress_id(self) -> tuple[int, str]:
        """(times the progress was set, digest of that progress): the same on ranks that loaded the same state,
        from which they count their updates alike (see `loader.checkpoint.lockstep`)."""
        if self._base_digest is None:
            self._base_digest = base_digest(self._base.to_dict())
        return self._bases_set, self._base_digest

    def relayout(self, layout: Layout, rank: int) -> None:
        """Deal the same progress under another layout: only before this sampler delivered anything under its own."""
        check_rank(rank, layout.world_size)
        self.layout, self.rank, self._view = layout, rank, None
        self._recent_chunks.clear()

    def end_pass(self) -> None:
        """The loader handed the end of the pass (StopIteration) to the training loop."""
        self._ended = True

    @property
    def update_complete(self) -> bool:
        """True when no micro-batch of an unfinished update is pending: step now (after the batch just
        delivered), or nothing to step for (right after a resume at a committed update)."""
        if self._position == 0:
            return self._after_committed
        return self.view().plan.completed(self._position) == self._position

    def undealt(self, ahead: int) -> int:
        """The first position of the current epoch after every position committed, or dealt to any rank in
        micro-batches before its cursor + `ahead` (those the workers may have prefetched), rounded up to the next
        whole update. The same on every rank in lockstep at an update boundary, computed without communication; the
        epoch's length when none is left."""
        view, k = self.view(), self.layout.grad_accum
        first = -(-(self._position + ahead) // k) * k  # the first micro-batch of the first update dealt to no one
        if first >= view.plan.batches_per_rank:
            position = self.order.num_samples
        else:  # rank 0's micro-batch of an update holds its lowest remaining index
            (slot,), _ = view.plan.batch_bounds(0, np.array([first]))
            position = int(view.remaining.positions(np.array([slot]))[0])
        committed = (
            whole(self.order.num_samples) if self._epoch < self._base.epoch else self._base.committed_in(self._epoch)
        )
        return max(position, int(committed[-1, 1]) if len(committed) else 0)

    def update_holding(self, position: int) -> int | None:
        """The update of this pass (counted from its first) that holds the first remaining position >= `position`,
        a position after everything committed (`undealt`); None when no update of the epoch holds one."""
        view = self.view()
        committed = view.remaining.count - self.order.num_samples  # minus the committed positions, all before
        slot = position + committed
        if slot >= view.plan.served:
            return None
        if slot >= view.plan.tail.start:
            return view.plan.tail.first_batch // self.layout.grad_accum
        return slot // self.layout.global_batch

    def next_indices(self) -> np.ndarray | None:
        """Dataset indices of the micro-batch the next delivery hands out (None if there is none): the one at the
        cursor, or the first of the next epoch when this rank's share is all handed out."""
        view, batch = (self.view(self._epoch + 1), 0) if self.exhausted else (self.view(), self._position)
        if batch >= view.plan.batches_per_rank:
            return None
        return view.indices(self.rank, np.array([batch]))[0]

    def last_indices(self) -> np.ndarray:
        """Dataset indices of the micro-batch delivered last in this epoch."""
        if self._last_delivered is None:
            raise RuntimeError("no batch has been delivered in this epoch yet")
        batch, view = self._last_delivered, self.view()
        for chunk_view, first, ids, offsets in self._recent_chunks:
            if chunk_view is view and first <= batch < first + len(offsets) - 1:
                return ids[offsets[batch - first] : offsets[batch - first + 1]].copy()
        ids, _ = view.indices(self.rank, np.array([batch]))
        return ids

    # -- iteration -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        """A pass: the rest of the current epoch, or the next epoch after a finished one (as `len` counts)."""
        self.begin_pass()
        view, first = self.view(), self._position
        per_chunk = max(1, CHUNK_SAMPLES // self.layout.batch_size)
        for low in range(first, view.plan.batches_per_rank, per_chunk):
            batches = np.arange(low, min(low + per_chunk, view.plan.batches_per_rank))
            ids, offsets = view.indices(self.rank, batches)
            self._recent_chunks.append((view, low, ids, offsets))
            flat, cuts = ids.tolist(), offsets.tolist()
            for a, b in zip(cuts[:-1], cuts[1:]):
                yield flat[a:b]

    def _next_epoch(self) -> tuple[EpochView, Progress | None]:
        """The view of the epoch a pass started now would serve, and the base if it counts batches done in it
        before this sampler's plan (a resumed epoch)."""
        view = self.view(self._epoch + 1) if self._ended else self.view()
        return view, self._base if view.epoch == self._base.cursor_epoch else None

    def __len__(self) -> int:
        """Micro-batches of the epoch the next pass serves, all of them: those delivered before (before a resume
        too) and those to come, as DataLoader's len counts, and as frameworks that add their restored batch
        counter back to it expect."""
        view, resumed = self._next_epoch()
        return (resumed.done_in_epoch if resumed else 0) + view.plan.batches_per_rank

    @property
    def batches_left(self) -> int:
        """Micro-batches a pass started now would yield on this rank."""
        view, _ = self._next_epoch()
        return view.plan.batches_per_rank - (0 if self._ended else min(self._position, view.plan.batches_per_rank))

    def samples_in_epoch(self) -> int:
        """Samples this rank is dealt in the epoch the next pass serves, all of them, as `len` counts batches."""
        view, resumed = self._next_epoch()
        return (resumed.samples_done_in_epoch if resumed else 0) + view.plan.samples_from(self.rank, 0)

    # -- state -----------------------------------------------------------------------------------------------------

    def standing(self) -> Progress:
        """The global progress this rank's state stands for, every rank in lockstep: exact at an update's end, and
        at the end of this rank's share of an epoch, which every rank's share reaches (`Ledger.record_end`)."""
        return merge([RankProgress.from_dict(self.state_dict())])

    def state_dict(self) -> dict:
        completed = self.view().plan.completed(self._position)
        ended = self._ended and completed == self._position
        return rank_state(self._base, self.layout, self.rank, self._epoch, completed, ended)

    def load_state_dict(self, state: dict | list | tuple) -> None:
        """Accepts a merged (global) state, the list of all ranks' states, or one rank's state (standing for every
        rank in lockstep). Everything is validated before anything changes: a rejected state leaves the sampler
        as it was."""
        progress = progress_of(state)
        check_fingerprint(progress.fingerprint, self.order.fingerprint())
        self._restore(check_schedule(progress, self.schedule, *(self.amended or (None, None))))

    def _restore(self, progress: Progress) -> None:
        self.delivered_any = False
        if progress.end_of_epoch is not None:  # every rank sat at the end of the epoch before progress.epoch
            self._start_epoch(progress.epoch - 1, progress, ended=progress.end_of_epoch)
        else:
            self._start_epoch(progress.epoch, progress)

    def skip(
        self,
        epoch: int | None = None,
        positions: range | ArrayLike | None = None,
        updates: int | range | None = None,
        indices: range | ArrayLike | None = None,
    ) -> np.ndarray:
        """Commit positions of `epoch` (default: the epoch the next batch comes from) as skipped on request: never
        dealt, never trained, recorded in the progress. `updates`: updates counted from the next one (an int n:
        the next n; a range); `positions`: epoch positions; `indices`: dataset indices, at the positions the
        epoch's order puts them (its inverse). From the progress this rank stands at, which stands for every rank:
        call it alike on every rank, between optimizer updates (a rank that differs shows at the merge, as a state
        of another base). Checked before anything changes; returns the intervals skipped."""
        if self.view().plan.completed(self._position) != self._position:
            raise ValueError(
                "skip() in the middle of an optimizer update: call it after the update's last "
                "micro-batch (loader.update_complete) and the optimizer step"
            )
        current = self.standing()
        epoch = current.epoch if epoch is None else epoch
        if not is_int(epoch) or not current.epoch <= epoch <= current.epoch + MAX_EPOCHS_AHEAD:
            raise ValueError(
                f"skip(epoch={epoch!r}): epochs before {current.epoch} are finished; pass an epoch in "
                f"[{current.epoch}, {current.epoch + MAX_EPOCHS_AHEAD}]"
            )
        n, committed = self.order.num_samples, current.committed_in(epoch)
        if updates is not None and self.schedule is not None and epoch != current.epoch:
            raise ValueError(
                f"skip(updates=..., epoch={epoch}) under a global batch schedule: the updates of epoch {epoch} "
                f"start at a step that depends on what epoch {current.epoch} has left to train; skip updates of "
                f"the current epoch, or positions= or indices= of a later one"
            )
        if sum(given is not None for given in (positions, updates, indices)) != 1:
            raise ValueError(
                "skip() takes updates= (the next n updates, or a range of them counted from the next), "
                "positions= (positions of the epoch) or indices= (dataset indices of the epoch), one of "
                "them"
            )
        if indices is not None:
            positions = _positions_of(self.order.for_epoch(epoch), committed, indices)
        schedule = self.schedule or ((0, self.layout.global_batch),)
        step = current.step if self.schedule else 0  # the step of the next update: a skipped one steps nothing
        spans = _positions_to_skip(committed, n, schedule, step, epoch, positions, updates)
        skipped = {**current.skipped, epoch: union(current.skipped.get(epoch, EMPTY), spans)}
        self._restore(
            replace(current, committed={**current.committed, epoch: union(committed, spans)}, skipped=skipped)
        )
        return spans


def _positions_to_skip(
    committed: np.ndarray,
    n: int,
    schedule: tuple[tuple[int, int], ...],
    step: int,
    epoch: int,
    positions: range | ArrayLike | None,
    updates: int | np.integer | range | None,
) -> np.ndarray:
    """The intervals `skip` commits: each position of [0, n) not committed yet, or the remaining positions that
    updates [a, b) from the next one, optimizer step `step`, would take under the global batch `schedule` (update
    g: remaining indices [P(g), P(g + 1)) with P(g) the sum of G over the g steps before it, the last one short)."""
    if updates is not None:
        steps = range(int(updates)) if is_int(updates) or isinstance(updates, np.integer) else updates
        remaining = Remaining(committed, n)
        if not isinstance(steps, range) or steps.step != 1 or not 0 <= steps.start < steps.stop:
            raise ValueError(
                f"skip(updates={updates!r}): pass a positive int or a non-empty range(a, b) of updates "
                f"counted from the next one (0)"
            )
        most = updates_of_samples(schedule, step, remaining.count)
        if steps.stop > most:
            of = f"of {schedule[0][1]}" if len(schedule) == 1 else f"from step {step} of the global batch schedule"
            raise ValueError(
                f"skip(updates={updates!r}): epoch {epoch} has {remaining.count} positions left, {most} updates "
                f"{of} at most"
            )
        span = [[samples_of_updates(schedule, step, u) for u in (steps.start, steps.stop)]]
        span[0][1] = min(span[0][1], remaining.count)
        return difference(remaining.covering_spans(span), committed, n)
    assert positions is not None, "skip() takes exactly one of updates=, positions=, indices= (checked there)"
    spans = spans_of(_ints_in(positions, n, "skip(positions=...): positions", f"epoch {epoch}'s [0, {n})"))
    overlap = difference(spans, difference(spans, committed, n), n)
    if len(overlap):
        raise ValueError(
            f"skip(positions=...): positions [{overlap[0, 0]}, {overlap[0, 1]}) of epoch {epoch} are "
            f"already committed (trained, or skipped before): skip positions not committed yet"
        )
    return spans


def _ints_in(values: range | ArrayLike, n: int, name: str, within: str) -> range | np.ndarray:
    """`values` (a range, an int, a list or an array of ints of any dtype) as a range or int64s, each checked in
    [0, n) before it is converted: numpy would wrap 2**64 - 1 to -1, and a position 2**63 - 1 ends at -2**63. Bools
    and floats are refused, not read as 0, 1 or truncated. A ValueError says `name` must be ints `within`."""
    if isinstance(values, range):
        ends = (values[0], values[-1]) if values else None  # O(1) for a range of any length and step
        bounds = None if ends is None else (min(ends), max(ends))
    else:  # a list as Python objects: numpy would read [True, 2] as ints, [1, 2**64 - 1] as floats
        array = np.asarray(values, dtype=object if isinstance(values, (list, tuple)) else None).reshape(-1)
        if array.dtype.kind == "O" and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in array):
            bounds = (int(min(array)), int(max(array))) if array.size else None
        else:
            bounds = (int(array.min()), int(array.max())) if array.dtype.kind in "iu" and array.size else None
    if bounds is None:
        raise ValueError(f"{name} must be one or more ints (a range, a list, an int array), got {short(values)}")
    if bounds[0] < 0 or bounds[1] >= n:
        raise ValueError(f"{name} must be in {within}, got {short(values)} (from {bounds[0]} to {bounds[1]})")
    return values if isinstance(values, range) else array.astype(np.int64)


def _positions_of(order: EpochOrder, committed: np.ndarray, indices: range | ArrayLike) -> np.ndarray:
    """The positions of dataset `indices` in the epoch (the inverse of its order), refused naming the indices out of
    the dataset or at positions already committed."""
    n = order.order.num_samples
    within = f"[0, {n}) (epoch {order.epoch}'s dataset)"
    ids = np.unique(np.asarray(_ints_in(indices, n, "skip(indices=...): dataset indices", within)))
    positions = order.positions_of(ids)
    taken = ids[contains(committed, positions)]
    if len(taken):
        raise ValueError(
            f"skip(indices=...): dataset indices {short(taken.tolist())} of epoch {order.epoch} are "
            f"already committed (trained, or skipped before): skip indices not committed yet"
        )
    return positions
