"""The stateful rank sampler: this rank's micro-batches of dataset indices, from committed progress on.

It yields; it does not count. The loader tells it when a batch is *delivered* (handed to the training loop), so
batches that workers prefetched are never progress, and `state_dict` reports only micro-batches of completed
updates. Iterating reads the cursor (epoch, delivered) once, so a new pass continues right after the last
delivered batch, whatever was prefetched before.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from loader._checks import check_rank, is_int
from loader.order import EpochOrder, Order
from loader.partition import EpochPlan, Layout
from loader.progress import Remaining
from loader.state import Progress, check_fingerprint, merge_states, rank_state

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

    def __init__(self, order: Order, layout: Layout, rank: int):
        check_rank(rank, layout.world_size)
        self.order, self.layout, self.rank = order, layout, rank
        # (view, first batch, ids, offsets) of the chunks served last: workers prefetch far less than a chunk ahead,
        # so the batch just delivered is almost always in one of them and last_indices slices it (else recomputes)
        self._recent_chunks: deque = deque(maxlen=2)
        self._start_epoch(0)

    # -- the cursor ------------------------------------------------------------------------------------------------

    def _start_epoch(self, epoch: int, base: Progress | None = None) -> None:
        self._base = base or Progress(self.order.fingerprint(), epoch, {})
        self._epoch, self._delivered, self._view = epoch, 0, None

    def view(self, epoch: int | None = None) -> EpochView:
        """The current epoch's view (cached: O(#intervals + #blocks) to build), or another epoch's."""
        epoch = self._epoch if epoch is None else epoch
        if self._view is not None and self._view.epoch == epoch:
            return self._view
        remaining = Remaining(self._base.committed_in(epoch), self.order.num_samples)
        view = EpochView(epoch, remaining, EpochPlan(remaining.count, self.layout), self.order.for_epoch(epoch))
        if epoch == self._epoch:
            self._view = view
        return view

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def exhausted(self) -> bool:
        return self._delivered >= self.view().plan.batches_per_rank

    def set_epoch(self, epoch: int) -> None:
        """Same epoch: nothing changes (so the usual set_epoch call after a resume keeps the progress). The next
        epoch after a finished pass: the natural advance. Any other epoch: start it fresh, abandoning the rest."""
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch == self._epoch:
            return
        if epoch == self._epoch + 1 and self.exhausted:
            self._epoch, self._delivered, self._view = epoch, 0, None
        else:
            self._start_epoch(epoch)

    def begin_pass(self) -> None:
        """Called when a pass starts: after a finished pass, move on to the next epoch."""
        if self.exhausted:
            self.set_epoch(self._epoch + 1)

    def deliver(self) -> None:
        """The loader handed one more micro-batch to the training loop."""
        self._delivered += 1

    @property
    def update_complete(self) -> bool:
        """True when the micro-batch just delivered completes an optimizer update: step now."""
        return self._delivered > 0 and self.view().plan.completed(self._delivered) == self._delivered

    def last_indices(self) -> np.ndarray:
        """Dataset indices of the micro-batch delivered last in this epoch."""
        if self._delivered == 0:
            raise RuntimeError("no batch has been delivered in this epoch yet")
        batch, view = self._delivered - 1, self.view()
        for chunk_view, first, ids, offsets in self._recent_chunks:
            if chunk_view is view and first <= batch < first + len(offsets) - 1:
                return ids[offsets[batch - first]:offsets[batch - first + 1]].copy()
        ids, _ = view.indices(self.rank, np.array([batch]))
        return ids

    # -- iteration -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        """A pass: the rest of the current epoch, or the next epoch after a finished one (as `len` counts)."""
        self.begin_pass()
        view, first = self.view(), self._delivered
        per_chunk = max(1, CHUNK_SAMPLES // self.layout.batch_size)
        for low in range(first, view.plan.batches_per_rank, per_chunk):
            batches = np.arange(low, min(low + per_chunk, view.plan.batches_per_rank))
            ids, offsets = view.indices(self.rank, batches)
            self._recent_chunks.append((view, low, ids, offsets))
            flat, cuts = ids.tolist(), offsets.tolist()
            for a, b in zip(cuts[:-1], cuts[1:]):
                yield flat[a:b]

    def _next_pass(self) -> tuple[EpochPlan, int]:
        """The plan of the epoch a pass started now would serve, and the micro-batch it would start at."""
        if self.exhausted:
            return self.view(self._epoch + 1).plan, 0
        return self.view().plan, self._delivered

    def __len__(self) -> int:
        """Micro-batches a pass started now would yield."""
        plan, first = self._next_pass()
        return plan.batches_per_rank - first

    def samples_in_next_pass(self) -> int:
        """Samples a pass started now would yield on this rank."""
        plan, first = self._next_pass()
        return plan.samples_from(self.rank, first)

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        completed = self.view().plan.completed(self._delivered)
        return rank_state(self._base, self.layout, self.rank, self._epoch, completed)

    def load_state_dict(self, state) -> None:
        """Accepts a merged (global) state, a list of per-rank states, or the state of a one-rank run.

        Everything is validated before anything changes: a rejected state leaves the sampler as it was."""
        if isinstance(state, (list, tuple)):
            state = merge_states(list(state))
        elif isinstance(state, dict) and state.get("kind") == "rank":
            state = merge_states([state])
        progress = Progress.from_dict(state)
        check_fingerprint(progress.fingerprint, self.order.fingerprint())
        self._start_epoch(progress.epoch, progress)
