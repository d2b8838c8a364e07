"""The loader's per-step metrics (`dl.metrics()`, `loader.metrics`): exact counts of batches, samples and failures
per optimizer step and per launch, with workers and without, across a resume; the data wait of a slow dataset and
the stall warning with its likely cause; the remote cache's counters a source reports."""

import shutil
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from loader import AbandonedEpochWarning, DataStallWarning, ResumableDataLoader, merge_states
from loader.checkpoint.ledger import Ledger
from loader.metrics import MetricsWarning, Monitor, Streak, stall_causes
from loader.sources.cache import ShardCache
from tests.conftest import IndexDataset, outcomes
from tests.streams import FORK, Failing


class Flaky(IndexDataset):
    """Indices in BAD raise: their batch fails to load (consumed, never served again)."""

    BAD = frozenset({7, 30, 41})

    def __getitem__(self, index):
        if index in self.BAD:
            raise ValueError(f"bad sample {index}")
        return int(index)


class Slow(IndexDataset):
    def __getitem__(self, index):
        time.sleep(0.03)
        return int(index)


def context(workers: int) -> dict:
    return dict(num_workers=workers, **(FORK if workers else {}))


def run_epoch(dl) -> tuple[list[int], list[int]]:
    """Iterate one pass; after every batch handed out, check the metrics of each step it completed against what the
    loop saw. Returns the delivered and the failed indices."""
    delivered, failed = [], []
    step = dict(batches=0, samples=0, failed_batches=0)
    updates = dl.metrics()["updates"]
    for upcoming, batch in outcomes(dl, ValueError):
        if isinstance(batch, ValueError):
            failed += upcoming
            step["failed_batches"] += 1
        else:
            assert upcoming == batch.tolist()
            delivered += batch.tolist()
            step["batches"] += 1
            step["samples"] += len(batch)
        metrics = dl.metrics()
        if dl.update_complete:
            updates += 1
            assert {key: metrics[key] for key in step} == step
            assert metrics["step_seconds"] >= metrics["wait_seconds"] >= 0
            step = dict.fromkeys(step, 0)
        assert metrics["updates"] == updates  # a step closes exactly when its update completes
    return delivered, failed


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("grad_accum", [1, 3])
def test_metrics_count_every_step_batch_sample_and_failure_exactly(workers, grad_accum):
    n, batch_size = 50, 4  # 12 whole batches and a short one: the epoch's last update is shorter
    dl = ResumableDataLoader(
        Flaky(n), batch_size=batch_size, shuffle=True, seed=2, grad_accum=grad_accum, **context(workers)
    )
    delivered, failed = run_epoch(dl)
    assert sorted(delivered + failed) == list(range(n))  # every index exactly once, delivered or failed
    assert Flaky.BAD <= set(failed) and not Flaky.BAD & set(delivered)
    failures = len(failed) // batch_size  # here 2: 7 and 30 share a batch (a whole one), 41 has one of its own
    metrics = dl.metrics()
    assert failures == 2 and metrics["updates"] == -(-13 // grad_accum)
    assert (metrics["total/batches"], metrics["total/samples"], metrics["total/failed_batches"]) == (
        13 - failures,
        n - len(failed),
        failures,
    )
    assert metrics["total/wait_seconds"] > 0 and metrics["launch"] is None and metrics["total/bytes"] is None


def test_a_stream_counts_its_batches_steps_and_failures():
    dl = ResumableDataLoader(Failing(40, bad={9}), batch_size=4, grad_accum=2, **context(2))
    failures = 0
    it = iter(dl)
    while True:
        try:
            next(it)
        except StopIteration:
            break
        except ValueError:
            failures += 1
    metrics = dl.metrics()
    # worker 1 reads 1, 3, ..., 39: [1, 3, 5, 7], 9 fails alone, then [11 .. 17], [19 .. 25], [27 .. 33], [35, 37, 39]
    assert failures == 1 and metrics["updates"] == 6  # 11 batches handed out, 2 a step
    assert (metrics["total/batches"], metrics["total/failed_batches"], metrics["total/samples"]) == (10, 1, 39)


def test_a_resumed_loader_counts_from_its_state_and_times_the_resume():
    kw = dict(batch_size=3, shuffle=True, seed=4, grad_accum=2)
    first = ResumableDataLoader(IndexDataset(40), **kw)
    it = iter(first)
    for _ in range(5):  # two whole steps, then one micro-batch of the third: not committed
        next(it)
    state = merge_states([first.state_dict()])
    second = ResumableDataLoader(IndexDataset(40), **kw)
    second.load_state_dict(state)
    assert second.metrics()["resume_seconds"] is None  # no batch since the load yet
    delivered, failed = run_epoch(second)
    assert not failed and len(delivered) == 40 - 12
    metrics = second.metrics()
    assert metrics["total/samples"] == 28 and metrics["updates"] == 5 and metrics["resume_seconds"] > 0


def test_a_step_left_for_another_epoch_counts_in_no_step():
    dl = ResumableDataLoader(IndexDataset(30), batch_size=2, grad_accum=3)
    it = iter(dl)
    next(it), next(it)  # two micro-batches of an update that never completes
    with pytest.warns(AbandonedEpochWarning):
        dl.set_epoch(1)
    it = iter(dl)
    for _ in range(3):
        next(it)
    metrics = dl.metrics()
    assert (metrics["updates"], metrics["batches"], metrics["samples"]) == (1, 3, 6)
    assert (metrics["total/batches"], metrics["total/samples"]) == (5, 10)  # the totals count every delivery


def test_bytes_are_counted_when_asked_for():
    class Features(IndexDataset):
        def __getitem__(self, index):
            return {"x": torch.full((3,), float(index)), "y": torch.tensor(index)}

    dl = ResumableDataLoader(Features(10), batch_size=4)
    dl.monitor.configure(count_bytes=True)
    for _ in dl:
        pass
    metrics = dl.metrics()
    per_sample = 3 * 4 + 8  # three float32 and an int64
    assert metrics["total/bytes"] == 10 * per_sample and metrics["bytes"] == 2 * per_sample
    assert metrics["bytes_per_second"] > 0


@pytest.mark.parametrize(
    "workers, cause",
    [
        (0, r"no workers: each batch loads in the training process"),
        (2, r"too few workers: num_workers=2 delivered a batch every"),
    ],
)
def test_a_loop_waiting_for_slow_loading_is_warned_once_with_the_likely_cause(workers, cause):
    dl = ResumableDataLoader(Slow(24), batch_size=2, grad_accum=2, **context(workers))
    dl.monitor.configure(stall_steps=3)
    with pytest.warns(
        DataStallWarning,
        match=rf"rank 0: the training loop waited for data .* over the last 3 steps"
        rf".*{cause}",
    ) as caught:
        for _ in dl:  # nothing but waiting: every step stalls
            pass
    assert len([w for w in caught if w.category is DataStallWarning]) == 1  # once per streak, not per step
    metrics = dl.metrics()
    assert metrics["wait_seconds"] > 0 and metrics["stall_ratio"] > 0.5 and dl.monitor.streak.steps == 6


def test_no_stall_warning_when_it_is_turned_off():
    dl = ResumableDataLoader(Slow(12), batch_size=2)
    dl.monitor.configure(stall_steps=None)  # a DataStallWarning would fail this test (pyproject filterwarnings)
    for _ in dl:
        pass
    assert dl.monitor.streak.steps == 6 and dl.metrics()["total/wait_seconds"] > 0


def test_the_stall_streak_needs_consecutive_stalled_steps():
    """The watch alone, with a clock of our own: one step that did not wait breaks the streak."""
    monitor, clock = Monitor(grad_accum=1), [0.0]
    monitor.configure(stall_steps=3)

    def step(wait: float, compute: float) -> bool:
        started = clock[0] + compute
        clock[0] = started + wait
        return monitor.handed(started, clock[0])

    flags = [
        step(0.08, 0.02),
        step(0.08, 0.02),
        step(0.001, 0.02),
        step(0.08, 0.02),
        step(0.08, 0.02),
        step(0.08, 0.02),
        step(0.08, 0.02),
    ]
    assert flags == [True, False, False, True, False, True, False]  # a streak begins, breaks, begins, reaches 3
    assert monitor.streak == Streak(4, pytest.approx(0.32), pytest.approx(0.4), 4)
    assert step(0.005, 0.001) is False and monitor.streak.steps == 0  # 5 ms is below stall_min_seconds


def test_the_causes_come_from_the_pace_of_workers_and_loop():
    streak = Streak(steps=10, wait_seconds=6.0, step_seconds=10.0, batches=10)  # 0.6 s waited, 0.4 s trained
    assert stall_causes(streak, 2, 16, "global", {}, {})[-1].endswith("num_workers=5 would keep up")  # 2 * 1 / 0.4
    assert stall_causes(streak, 0, 16, "global", {}, {})[-1].endswith("num_workers=2 would keep up")  # 0.6 / 0.4
    assert "more workers than the 4 CPUs" in stall_causes(streak, 2, 4, "global", {}, {})[-1]
    remote = stall_causes(streak, 2, 16, "global", {"cache_misses": 3, "downloaded_bytes": 300}, {"remote_shards": 8})
    assert remote[0].startswith("a cold shard cache: readers waited for 3 shard download(s)")
    assert remote[1].startswith("a global shuffle over remote shards")
    assert len(stall_causes(streak, 2, 16, "blocks", {}, {"remote_shards": 8})) == 1


def test_monitor_settings_are_checked():
    monitor = Monitor(grad_accum=1)
    for bad in (dict(stall_ratio=1.5), dict(stall_steps=0), dict(stall_steps=True), dict(stall_min_seconds=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            monitor.configure(**bad)


class CachedShards(Dataset):
    """Samples in shard files of a directory standing for object storage, read through a real ShardCache: a shard
    not in the cache is copied in first, slowly, as a download is. `metrics()` reports the cache's counters, as
    WebDatasetSource does for remote shards."""

    def __init__(self, remote, cache, shards: int, per_shard: int):
        self.remote, self.cache, self.shards, self.per_shard = remote, cache, shards, per_shard

    def __len__(self) -> int:
        return self.shards * self.per_shard

    def __getitem__(self, index):
        name = f"shard-{index // self.per_shard}"
        source = self.remote / name

        def download(dest: str) -> None:
            time.sleep(0.1)
            shutil.copyfile(source, dest)

        got = self.cache.fetch(name, source.stat().st_size, download)
        return int(np.load(got.path)[index % self.per_shard])

    def metrics(self) -> dict:
        return {"remote_shards": self.shards, **self.cache.stats()}


def cached_shards(tmp_path, shards: int, per_shard: int, limit) -> CachedShards:
    (tmp_path / "remote").mkdir()
    for s in range(shards):
        with open(tmp_path / "remote" / f"shard-{s}", "wb") as f:
            np.save(f, np.arange(s * per_shard, (s + 1) * per_shard))
    return CachedShards(tmp_path / "remote", ShardCache(tmp_path / "cache", limit), shards, per_shard)


def test_a_cold_cache_under_a_global_shuffle_is_named_as_the_cause(tmp_path):
    dataset = cached_shards(tmp_path, shards=40, per_shard=4, limit="10MB")
    dl = ResumableDataLoader(dataset, batch_size=2, grad_accum=2, shuffle=True, seed=0)
    dl.monitor.configure(stall_steps=3, stall_min_seconds=0.09)  # only a step that waited for a download stalls
    with pytest.warns(
        DataStallWarning,
        match=r"a cold shard cache: readers waited for \d+ shard download.*; or a "
        r"global shuffle over remote shards.*; or no workers",
    ):
        batches = [batch.tolist() for batch in dl]
    assert sorted(sum(batches, [])) == list(range(160))
    stats, metrics = dataset.cache.stats(), dl.metrics()
    assert stats["cache_misses"] == stats["downloads"] == 40 and stats["cache_hits"] == 160 - 40
    assert "evictions" not in stats  # the limit holds every shard
    assert {key: metrics[f"source/{key}"] for key in stats} == stats and metrics["source/remote_shards"] == 40


def test_a_small_cache_counts_its_evictions(tmp_path):
    dataset = cached_shards(tmp_path, shards=12, per_shard=4, limit=12 * 4096)
    dl = ResumableDataLoader(dataset, batch_size=4)  # in order: one shard after the other
    assert sorted(sum((batch.tolist() for batch in dl), [])) == list(range(48))
    stats = dataset.cache.stats()
    assert stats["cache_misses"] == stats["downloads"] == 12 and stats["cache_hits"] == 48 - 12
    cache, size = dataset.cache, (tmp_path / "remote" / "shard-0").stat().st_size
    held = (cache.limit - cache.footprint(1)) // cache.copy_footprint(size)  # next to the counters' file
    assert held < 12 and stats["evictions"] == 12 - held  # each shard evicted once, but the last ones read
    assert stats["evicted_bytes"] == stats["evictions"] * cache.copy_footprint(size)


def test_with_a_ledger_the_metrics_carry_the_launch_and_its_step(tmp_path):
    first = ResumableDataLoader(IndexDataset(16), batch_size=2, grad_accum=2)
    first.ledger = Ledger.open(tmp_path, 0, 16)
    it = iter(first)
    for _ in range(4):
        next(it)
    assert (first.metrics()["launch"], first.metrics()["step"]) == (1, 2)
    first.ledger.close()
    second = ResumableDataLoader(IndexDataset(16), batch_size=2, grad_accum=2)
    second.load_state_dict(merge_states([first.state_dict()]))
    second.ledger = Ledger.open(tmp_path, 2, 16)  # the next launch, resumed from step 2
    it = iter(second)
    for _ in range(2):
        next(it)
    assert (second.metrics()["launch"], second.metrics()["step"], second.metrics()["updates"]) == (2, 3, 1)
    second.ledger.close()


class BrokenCounters(IndexDataset):
    """A source whose own metrics() raises while `broken` (its counters' file gone, say)."""

    broken = True

    def metrics(self):
        if self.broken:
            raise FileNotFoundError("cache/stats.json")
        return {"downloads": 3}


def test_a_dataset_whose_metrics_raise_leaves_the_rest_of_the_metrics_and_every_batch():
    dataset = BrokenCounters(40)
    dl = ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=0, grad_accum=2)
    delivered, seen = [], []
    for batch in dl:
        delivered += batch.tolist()
        if not dl.update_complete:
            continue
        if not seen:  # warned once, naming the dataset; later failures are silent (warnings are errors here)
            with pytest.warns(
                MetricsWarning,
                match=r"the dataset's own metrics\(\) \(BrokenCounters.metrics\) raised "
                r"FileNotFoundError: cache/stats.json. Training goes on",
            ):
                metrics = dl.metrics()
        else:
            metrics = dl.metrics()
        seen.append((metrics["samples"], metrics["total/samples"], metrics.get("source/downloads")))
        dataset.broken = len(seen) < 3  # works again from the third update on
    assert sorted(delivered) == list(range(40))
    assert seen == [(8, 8 * (k + 1), None if k < 3 else 3) for k in range(5)]
