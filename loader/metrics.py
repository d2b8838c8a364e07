"""What a ResumableDataLoader did, step by step: how long the training loop waited for data, what it received, and
a warning when the waiting dominates.

Why here and this way (as torchdata.nodes and Grain count): the loader already stands between the training loop and
its batches, so it times the one thing only it can see, the time the loop spends inside `next()` (the *data wait*),
at O(1) per batch: a `perf_counter()` pair and a few adds. Everything else is computed once per step. A *step* is
one optimizer update, closed when the loader's `update_complete` turns true (grad_accum micro-batches, or the
epoch's last, shorter update), the same boundary the progress commits at. A step's time runs from the close of the
previous step (or the first `next()` of an iterator) to its own close: the loop's whole cycle, compute included,
so `stall_ratio` = wait / step time is the share of training the loader cost.

`Monitor` holds the counters (one per loader, `dl.monitor`); `dl.metrics()` is the plain dict a logger writes
(`loader.integrations.tensorboard`, `loader.integrations.prometheus`). See docs/observability.md.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")

# the keys of dl.metrics(): the last completed step's values, which a restart may emit again for the same step (a
# consumer keeps the last one), and this launch's totals, which count the work of this process only
STEP_KEYS = (
    "batches",
    "samples",
    "failed_batches",
    "filtered",
    "wait_seconds",
    "step_seconds",
    "stall_ratio",
    "samples_per_second",
    "bytes",
    "bytes_per_second",
)
TOTAL_KEYS = ("batches", "samples", "failed_batches", "filtered", "wait_seconds", "bytes")
STALL_RATIO = 0.5  # defaults of the stall warning: a step waited more than this share of its time...
STALL_MIN_SECONDS = 0.01  # ...and at least this long (a wait of microseconds costs nothing, whatever its share)...
STALL_STEPS = 100  # ...in this many consecutive steps


class DataStallWarning(UserWarning):
    """The training loop waited for data during most of many consecutive steps: the loader limits training. The
    message names the likely cause from what the loader knows (workers, the shard cache, the shuffle)."""


class MetricsWarning(UserWarning):
    """Metrics could not be read or exported (a dataset's own metrics() raised, an exporter's log folder vanished):
    training goes on, the loader keeps counting, and the part that failed is tried again at its next call."""


class Retrying:
    """A part of the metrics that must never stop training (an exporter's write, a dataset's metrics()): a failure is
    caught, the part tried again at its next call, and a MetricsWarning says so once per outage (again only after
    the part worked in between)."""

    def __init__(self) -> None:
        self.failing = False

    def call(self, what: str, function: Callable[[], T], default: T, lost: str) -> T:
        """function(), or `default` when it raises; `what` names the part, `lost` what its failure loses."""
        try:
            result = function()
        except Exception as err:
            if not self.failing:
                warnings.warn(
                    f"{what} raised {type(err).__name__}: {err}. Training goes on and the loader keeps "
                    f"counting, but {lost}; it is tried again at each call (this warning comes again only "
                    f"if it fails after having worked)",
                    MetricsWarning,
                    stacklevel=3,
                )
            self.failing = True
            return default
        self.failing = False
        return result


class Streak(NamedTuple):
    """Consecutive stalled steps, summed: what a warning reports and infers its causes from."""

    steps: int = 0
    wait_seconds: float = 0.0
    step_seconds: float = 0.0
    batches: int = 0  # handed out (delivered or failed): each one was loaded

    @property
    def ratio(self) -> float:
        return self.wait_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


class Segment(NamedTuple):
    """Consecutive micro-batches of one epoch on one rank, as passes hand them out: the batch handed out when the
    monitor's count of handed-out batches was `handed` sits at `position` of `plan` (an `EpochPlan`), so samples
    follow in closed form from two counts, never summed per batch. `plan` None: a stream, whose batches come with
    their number of records instead (`Monitor.records`, the filtered ones included)."""

    plan: Any = None
    rank: int = 0
    position: int = 0
    handed: int = 0

    def samples(self, first: int, stop: int) -> int:
        """Samples in the batches handed out while the count went from `first` to `stop`."""
        if self.plan is None:
            return 0
        at = self.position - self.handed
        return self.plan.samples_from(self.rank, at + first) - self.plan.samples_from(self.rank, at + stop)


def batch_nbytes(batch: object) -> int:
    """Bytes of the tensors and arrays in a batch (nested in dicts, lists and tuples); O(number of tensors)."""
    if isinstance(batch, dict):
        return sum(batch_nbytes(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(value) for value in batch)
    nbytes = getattr(batch, "nbytes", None)  # torch.Tensor and numpy.ndarray
    return nbytes if isinstance(nbytes, int) else 0


class Monitor:
    """A loader's counters, its steps and its stall watch (`dl.monitor`; `dl.monitor.configure(...)` sets the watch).

    Cost: a batch adds to a few cumulative counters; a step (every `grad_accum` batches handed out) stores where
    they stood (a *mark*: the time, the counters, the segment); a step's values, samples included, are differences
    of its two marks, taken when asked for (`snapshot`). The loader
    closes an epoch's last, shorter update itself (`close`), when it next looks (`dl.metrics()`, the end of the pass,
    a new `iter()`)."""

    def __init__(self, grad_accum: int) -> None:
        self.grad_accum = grad_accum  # batches of a step, the epoch's last excepted
        self.configure()
        # this launch's totals, cumulative; samples follow from the segments
        self.batches = self.failed_batches = self.failed_samples = self.bytes = self.updates = 0
        self.records = 0  # records a stream's delivered batches consumed, as its workers counted them
        self.filtered = 0  # samples (records) the loader's filter dropped from delivered batches
        self.wait_seconds = 0.0
        self.resume_seconds: float | None = None  # load_state_dict() to the first batch handed out after it
        self.in_step = 0  # batches handed out (delivered or failed) in the open step
        self.last_at = 0.0  # when the last batch was handed out
        self._loaded_at: float | None = None
        self._segment, self._earlier_samples = Segment(), 0  # samples of segments before this one
        self._start: tuple | None = None  # the open step's first mark (None: it starts at its first next())
        self._last: tuple | None = None  # the last closed step's two marks
        self.streak = Streak()  # the stalled steps in a row, up to the last closed step
        self.streak_source: dict = {}  # the source's counters as the streak began (the loader notes them)
        self.source = Retrying()  # the dataset's own metrics(), which must not stop the loop (see Retrying)

    def configure(
        self,
        *,
        stall_ratio: float = STALL_RATIO,
        stall_steps: int | None = STALL_STEPS,
        stall_min_seconds: float = STALL_MIN_SECONDS,
        count_bytes: bool = False,
    ) -> None:
        """The stall watch: a step is stalled when the training loop waited for data more than `stall_ratio` of its
        time and at least `stall_min_seconds`; `stall_steps` stalled steps in a row raise a `DataStallWarning`
        (once per streak; None: never). `count_bytes`: also sum the bytes of the tensors in every batch delivered
        (O(tensors) per batch: off by default), for `bytes` and `bytes_per_second`. Each call sets all four, those
        not given to their defaults."""
        if not (isinstance(stall_ratio, (int, float)) and 0 <= stall_ratio < 1):
            raise ValueError(f"stall_ratio must be a number in [0, 1), got {stall_ratio!r}")
        if stall_steps is not None and (
            isinstance(stall_steps, bool) or not isinstance(stall_steps, int) or stall_steps < 1
        ):
            raise ValueError(f"stall_steps must be a positive int, or None for no stall warning, got {stall_steps!r}")
        if not (isinstance(stall_min_seconds, (int, float)) and stall_min_seconds >= 0):
            raise ValueError(f"stall_min_seconds must be a number >= 0, got {stall_min_seconds!r}")
        self.stall_ratio, self.stall_min_seconds, self.count_bytes = stall_ratio, stall_min_seconds, bool(count_bytes)
        self.stall_steps = stall_steps or 0  # 0: no streak reaches it

    def _mark(self, at: float) -> tuple:
        return (
            at,
            self.batches,
            self.failed_batches,
            self.failed_samples,
            self.wait_seconds,
            self.bytes,
            self.records,
            self.filtered,
            self._segment,
        )

    # -- per batch: O(1) -------------------------------------------------------------------------------------------

    def handed(self, started: float, now: float, records: int = 0, filtered: int = 0) -> bool:
        """A batch was delivered: the loop called next() at `started` and had it at `now` (its bytes, when counted,
        are added to `bytes` first); of a stream, it consumed `records`; the loader's filter dropped `filtered` of
        its samples (records). True when the step it completed began a stall streak or made it `stall_steps` long
        (the loader then looks at its source, or warns)."""
        if self._start is None:
            self._open(started, now)
        self.wait_seconds += now - started
        self.records += records
        self.filtered += filtered
        self.batches += 1
        self.last_at = now
        self.in_step += 1
        return self.in_step == self.grad_accum and self.close(now)

    def failed(self, started: float, now: float, samples: int) -> bool:
        """A batch of `samples` failed to load: consumed, not delivered. Returns as `handed`."""
        if self._start is None:
            self._open(started, now)
        self.wait_seconds += now - started
        self.failed_batches += 1
        self.failed_samples += samples
        self.last_at = now
        self.in_step += 1
        return self.in_step == self.grad_accum and self.close(now)

    def _open(self, started: float, now: float) -> None:
        self._start = self._mark(started)
        if self._loaded_at is not None:
            self.resume_seconds, self._loaded_at = now - self._loaded_at, None

    # -- per step ----------------------------------------------------------------------------------------------------

    def close(self, now: float) -> bool:
        """The open step is complete at `now` (the loader calls this for an epoch's last, shorter update). Returns
        as `handed`."""
        start = self._start
        if start is None:  # every caller has a batch in the step (in_step > 0), which opened it
            raise RuntimeError("Monitor.close: no step is open (a step opens with its first handed or failed batch)")
        end = (
            now,
            self.batches,
            self.failed_batches,
            self.failed_samples,
            self.wait_seconds,
            self.bytes,
            self.records,
            self.filtered,
            self._segment,
        )  # self._mark(now), without the call: once a batch at
        # grad_accum=1
        self._last, self._start, self.in_step = (start, end), end, 0
        self.updates += 1
        wait, seconds = end[4] - start[4], now - start[0]
        if wait >= self.stall_min_seconds and wait > self.stall_ratio * seconds:
            s = self.streak
            self.streak = Streak(
                s.steps + 1,
                s.wait_seconds + wait,
                s.step_seconds + seconds,
                s.batches + end[1] + end[2] - start[1] - start[2],
            )
            return self.streak.steps == 1 or self.streak.steps == self.stall_steps
        if self.streak.steps:
            self.streak = Streak()
        return False

    def warns(self) -> bool:
        return self.streak.steps == self.stall_steps

    # -- the loader's other events -----------------------------------------------------------------------------------

    def begin(self, plan: Any, rank: int = 0, position: int = 0) -> None:
        """A pass begins handing out batches: of a map-style dataset, from micro-batch `position` of `plan` (an
        `EpochPlan`) on `rank`; of a stream (`plan` None), each delivery adds its records."""
        old, handed = self._segment, self.batches + self.failed_batches
        self._earlier_samples += old.samples(old.handed, handed)
        self._segment = Segment(plan, rank, position, handed)

    def new_pass(self) -> None:
        """A new iterator: unless it continues a step, the next step starts at its first next(), not before (an
        evaluation, a save between epochs is no step's)."""
        if not self.in_step:
            self._start = None

    def forget_step(self) -> None:
        """The open step will never complete (a state was loaded, another epoch set): its batches count in the
        totals, in no step."""
        self._start, self.in_step, self.streak = None, 0, Streak()

    def loaded(self, now: float) -> None:
        """A state was loaded at `now`: `resume_seconds` runs from here to the next batch handed out."""
        self.forget_step()
        self._loaded_at = now

    @property
    def samples(self) -> int:
        """Samples delivered by this launch (failed batches' and filtered ones excepted)."""
        segment, handed = self._segment, self.batches + self.failed_batches
        return (
            self._earlier_samples
            + segment.samples(segment.handed, handed)
            - self.failed_samples
            + self.records
            - self.filtered
        )

    def snapshot(self) -> dict:
        """The last closed step's values (None before the first) and this launch's totals, as one flat dict."""
        step = dict.fromkeys(STEP_KEYS)
        if self._last is not None:
            start, end = self._last
            seconds, batches, failed, failed_samples, wait, nbytes, records, filtered = (
                b - a for a, b in zip(start, end[:8])
            )
            samples = end[8].samples(start[1] + start[2], end[1] + end[2]) - failed_samples + records - filtered
            rate = 1 / seconds if seconds > 0 else 0.0
            step.update(
                batches=batches,
                samples=samples,
                failed_batches=failed,
                filtered=filtered,
                wait_seconds=wait,
                step_seconds=seconds,
                stall_ratio=wait * rate,
                samples_per_second=samples * rate,
            )
            if self.count_bytes:
                step.update(bytes=nbytes, bytes_per_second=nbytes * rate)
        totals = {
            "batches": self.batches,
            "samples": self.samples,
            "failed_batches": self.failed_batches,
            "filtered": self.filtered,
            "wait_seconds": self.wait_seconds,
            "bytes": self.bytes if self.count_bytes else None,
        }
        return {
            "updates": self.updates,
            **step,
            "resume_seconds": self.resume_seconds,
            **{f"total/{key}": totals[key] for key in TOTAL_KEYS},
        }


def stall_causes(
    streak: Streak, num_workers: int, cpus: int, shuffle: str, source_delta: dict, source: dict
) -> list[str]:
    """The likely causes of a stall, most likely first, from what the loader knows: its workers and their pace
    against the `cpus` it may use, the shuffle, and the counters of its source (`dataset.metrics()`: `cache_misses`
    and `downloaded_bytes` during the streak, in `source_delta`; `remote_shards`, in `source`)."""
    causes = []
    if misses := source_delta.get("cache_misses", 0):
        causes.append(
            f"a cold shard cache: readers waited for {misses} shard download(s) during these steps "
            f"({source_delta.get('downloaded_bytes', 0)} bytes downloaded); prefetch more shards ahead "
            f"(WebDatasetSource(prefetch=)) or give the cache room to keep them (cache_limit=): a warm cache serves "
            f"later epochs from local disk"
        )
    if source.get("remote_shards") and shuffle == "global":
        causes.append(
            "a global shuffle over remote shards: every batch reads from many shards, so nearly every shard must be "
            "in the cache at once; shuffle_blocks=dataset.shard_sizes reads a few shards at a time"
        )
    per_batch = streak.step_seconds / streak.batches  # how often a batch came: the loader's pace, as it stalled
    wait = streak.wait_seconds / streak.batches
    compute = per_batch - wait  # the loop's own time per batch
    # W workers that deliver a batch every `per_batch` take W * per_batch for each one (no workers: `wait`); to keep
    # up with a loop that takes one every `compute`, W' >= that / compute
    loading = num_workers * per_batch if num_workers else wait
    needed = math.ceil(loading / compute) if compute > 0 else math.inf
    where = (
        f"no workers: each batch loads in the training process (num_workers=0), {wait:.3g} s per batch"
        if num_workers == 0
        else f"too few workers: num_workers={num_workers} delivered a batch every {per_batch:.3g} s"
    )
    if needed <= cpus:
        causes.append(f"{where}, and the loop trains on one in {compute:.3g} s: num_workers={needed} would keep up")
    else:
        causes.append(
            f"{where}, and the loop trains on one in {compute:.3g} s: keeping up takes more workers than "
            f"the {cpus} CPUs this process may use; make __getitem__ or collate_fn cheaper"
        )
    return causes


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stall_message(streak: Streak, rank: int, num_workers: int, shuffle: str, before: dict, now: dict) -> str:
    """The warning: how long the loop waited, and the likely causes (`before` and `now`: the source's counters as
    the streak began and now)."""
    delta = {key: value - before.get(key, 0) for key, value in now.items() if isinstance(value, (int, float))}
    causes = stall_causes(streak, num_workers, usable_cpus(), shuffle, delta, now)
    return (
        f"rank {rank}: the training loop waited for data {streak.ratio:.0%} of the time over the last {streak.steps} "
        f"steps ({streak.wait_seconds / streak.steps:.3g} s of each {streak.step_seconds / streak.steps:.3g} s "
        f"step): the loader limits training. Likely cause: " + "; or ".join(causes) + ". (The thresholds: "
        "dl.monitor.configure(stall_ratio=, stall_steps=, stall_min_seconds=); stall_steps=None: no warning.)"
    )
