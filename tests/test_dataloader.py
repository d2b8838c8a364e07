"""ResumableDataLoader: a drop-in DataLoader whose progress is what was delivered in whole updates."""

import itertools
import json
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import loader.core.sampler as sampler_module
from loader import (
    AbandonedEpochWarning,
    ContinuedPassWarning,
    ResumableDataLoader,
    SampleIndex,
    StateError,
    merge_states,
    sample_seed,
)
from tests.conftest import IndexDataset


class PairDataset(Dataset):
    """Tensors and dicts, so collation is exercised beyond plain ints."""

    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "y": i % 3}


def batches(dl, count=None):
    """Take `count` batches (all when None) from a new pass: exactly `count` are delivered."""
    return list(itertools.islice(dl, count))


def as_lists(items):
    return [b.tolist() for b in items]


@pytest.mark.parametrize("batch_size", [1, 4, 10, 37, 50])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_batches_as_torch_dataloader(batch_size, drop_last):
    ours = batches(ResumableDataLoader(PairDataset(), batch_size=batch_size, drop_last=drop_last))
    theirs = batches(DataLoader(PairDataset(), batch_size=batch_size, drop_last=drop_last))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])


def test_same_batches_with_workers_collate_and_no_batching():
    kw = dict(num_workers=2, multiprocessing_context="fork", collate_fn=lambda b: [x["y"] for x in b], batch_size=5)
    assert batches(ResumableDataLoader(PairDataset(), **kw)) == batches(DataLoader(PairDataset(), **kw))
    ours = batches(ResumableDataLoader(PairDataset(), batch_size=None))
    theirs = batches(DataLoader(PairDataset(), batch_size=None))
    assert [o["y"] for o in ours] == [t["y"] for t in theirs] and len(ours) == 37


def test_is_a_dataloader_and_reports_the_arguments():
    dl = ResumableDataLoader(IndexDataset(10), batch_size=3, drop_last=True, num_workers=0)
    assert isinstance(dl, DataLoader)
    assert (dl.batch_size, dl.drop_last, dl.num_workers, len(dl)) == (3, True, 0, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sampler=[0, 1]), "sampler="),
        (dict(batch_sampler=[[0, 1]]), "sampler="),
        (dict(in_order=False), "in_order=False"),
        (dict(batch_size=0), "batch_size must be a positive int or None, got 0"),
        (dict(batch_size=-3), "batch_size must be a positive int or None, got -3"),
        (dict(rank=2, world_size=2), r"rank must be an int in \[0, world_size=2\), got 2"),
        (dict(rank=-1, world_size=2), r"rank must be an int in \[0, world_size=2\), got -1"),
        (dict(world_size=0), "world_size must be a positive int, got 0"),
        (dict(grad_accum=0), "grad_accum must be a positive int, got 0"),
        (dict(shuffle_blocks=4), "shuffle_blocks needs shuffle=True"),
        (dict(shuffle=True, shuffle_blocks=[3, 3]), "sum to the dataset length 10"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResumableDataLoader(IndexDataset(10), **kwargs)


def test_prefetched_batches_are_not_progress():
    kw = dict(batch_size=4, shuffle=True, seed=3, num_workers=2, prefetch_factor=4, multiprocessing_context="fork")
    reference = as_lists(batches(ResumableDataLoader(IndexDataset(100), **kw)))
    dl = ResumableDataLoader(IndexDataset(100), **kw)
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(3)]  # workers have fetched up to 8 batches by now
    state = dl.state_dict()
    assert state["completed"] == 3
    resumed = ResumableDataLoader(IndexDataset(100), **kw)
    resumed.load_state_dict(state)
    assert seen + as_lists(batches(resumed)) == reference


def test_half_accumulated_update_is_replayed():
    kw = dict(batch_size=2, shuffle=True, grad_accum=4)
    reference = as_lists(batches(ResumableDataLoader(IndexDataset(40), **kw)))
    dl = ResumableDataLoader(IndexDataset(40), **kw)
    it = iter(dl)
    flags = []
    for _ in range(6):
        next(it)
        flags.append(dl.update_complete)
    assert flags == [False, False, False, True, False, False]
    resumed = ResumableDataLoader(IndexDataset(40), **kw)
    resumed.load_state_dict(dl.state_dict())
    assert as_lists(batches(resumed)) == reference[4:]  # micro-batches 5 and 6 come again


def test_final_short_update_completes_at_the_end_of_the_epoch():
    dl = ResumableDataLoader(IndexDataset(10), batch_size=2, grad_accum=4)  # 5 micro-batches: 4 + 1
    flags = [dl.update_complete for _ in dl]
    assert flags == [False, False, False, True, True]
    assert merge_states([dl.state_dict()])["epoch"] == 1


@pytest.mark.parametrize(
    "workers", [dict(), dict(num_workers=2, persistent_workers=True, multiprocessing_context="fork")]
)
def test_a_new_iterator_supersedes_the_old_one_instead_of_double_counting(workers):
    kw = dict(batch_size=3, shuffle=True, seed=5, **workers)
    reference = as_lists(batches(ResumableDataLoader(IndexDataset(30), **kw)))
    dl = ResumableDataLoader(IndexDataset(30), **kw)
    old = iter(dl)
    seen = [next(old).tolist()]
    with pytest.warns(ContinuedPassWarning, match="the 1 batch"):
        new = iter(dl)
    seen.append(next(new).tolist())
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)
    assert dl.state_dict()["completed"] == 2
    seen += [batch.tolist() for batch in new]
    assert seen == reference


def test_code_written_for_distributed_sampler_runs_unchanged():
    """`loader.sampler.set_epoch(e)` and `len(loader.sampler)` (samples of this rank), the DistributedSampler idiom."""
    kw = dict(batch_size=4, shuffle=True, seed=2, rank=1, world_size=3)
    dl, reference = ResumableDataLoader(IndexDataset(50), **kw), ResumableDataLoader(IndexDataset(50), **kw)
    for epoch in range(3):
        dl.sampler.set_epoch(epoch)
        planned, count = list(dl.sampler), len(dl.sampler)
        seen = [i for batch in dl for i in batch.tolist()]
        assert seen == planned and len(seen) == count == 17  # 50 over 3 ranks: 17, 17, 16, nothing dropped
        reference.set_epoch(epoch)
        assert seen == [i for batch in reference for i in batch.tolist()]
    it = iter(dl)
    first = next(it).tolist()
    left = list(dl.sampler)  # what the pass has left: read, not delivered
    assert len(left) == 17 - len(first) and len(dl.sampler) == 17  # len: the whole epoch's, as DistributedSampler's
    assert [i for batch in it for i in batch.tolist()] == left


@pytest.mark.parametrize("n, world", [(50, 3), (10_000, 3), (100, 2), (13, 4), (3, 4)])
def test_sampler_length_is_distributed_samplers_without_its_repeats(n, world):
    """drop_last=False: rank r gets n // W samples, one more for r < n mod W, as DistributedSampler would without
    the padding it repeats to give every rank ceil(n / W); only n < W drops (all n)."""
    ours = [
        len(ResumableDataLoader(IndexDataset(n), batch_size=4, rank=r, world_size=world).sampler) for r in range(world)
    ]
    theirs = [len(DistributedSampler(IndexDataset(n), num_replicas=world, rank=r)) for r in range(world)]
    assert theirs == [-(-n // world)] * world
    assert ours == ([n // world + (r < n % world) for r in range(world)] if n >= world else [0] * world)


@pytest.mark.parametrize("chunk", [2, 6, 1000])
def test_last_indices_are_the_delivered_batch_across_chunks_and_prefetch(monkeypatch, chunk):
    monkeypatch.setattr(sampler_module, "CHUNK_SAMPLES", chunk)  # chunks of 1 or 3 batches: prefetch spans several
    kw = dict(batch_size=2, shuffle=True, seed=4, num_workers=2, prefetch_factor=4, multiprocessing_context="fork")
    dl = ResumableDataLoader(IndexDataset(41), **kw)
    for _ in range(2):  # two epochs: the second pass must not slice the first one's chunks
        for batch in dl:
            assert dl.last_indices().tolist() == batch.tolist()


class SlowDataset(IndexDataset):
    def __getitem__(self, i):
        import time

        time.sleep(np.random.default_rng(i).uniform(0, 0.002))  # uneven worker timing
        return int(i)


@pytest.mark.parametrize("workers", [(0, False), (2, False), (3, True)])
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # more than the 2 cores: meant
def test_batches_do_not_depend_on_workers_or_timing(workers):
    num_workers, persistent = workers
    kw = dict(batch_size=3, shuffle=True, seed=9)
    reference = as_lists(
        batches(ResumableDataLoader(SlowDataset(30), **kw)) + batches(ResumableDataLoader(SlowDataset(30), **kw))
    )
    extra = dict(num_workers=num_workers, persistent_workers=persistent)
    if num_workers:
        extra["multiprocessing_context"] = "fork"
    dl = ResumableDataLoader(SlowDataset(30), **kw, **extra)
    assert as_lists(batches(dl)) == reference[:10]
    assert dl.epoch == 0
    second = as_lists(batches(dl))  # a new pass after a full pass starts the next epoch
    assert dl.epoch == 1 and sorted(sum(second, [])) == list(range(30)) and second != reference[:10]


def test_a_new_iter_after_a_partial_pass_continues_the_epoch():
    dl = ResumableDataLoader(IndexDataset(30), batch_size=3, shuffle=True, seed=1)
    whole = as_lists(batches(ResumableDataLoader(IndexDataset(30), batch_size=3, shuffle=True, seed=1)))
    first = as_lists(batches(dl, count=4))
    assert len(dl) == 10 and dl.batches_left == 6  # len: the whole epoch, as DataLoader's
    with pytest.warns(ContinuedPassWarning, match="the 4 batch"):
        rest = as_lists(batches(dl))
    assert first + rest == whole and dl.epoch == 0


def test_set_epoch():
    dl = ResumableDataLoader(IndexDataset(30), batch_size=3, shuffle=True)
    batches(dl, count=2)
    state = dl.state_dict()
    resumed = ResumableDataLoader(IndexDataset(30), batch_size=3, shuffle=True)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual call at the top of an epoch loop keeps the resumed progress
    assert len(resumed) == 10 and resumed.batches_left == 8
    with pytest.warns(AbandonedEpochWarning, match=r"set_epoch\(4\) abandons epoch 0 part way: 8 micro-batch"):
        resumed.set_epoch(4)  # leaving the resumed epoch 0 part way is said: an off-by-one epoch loop would skip
    assert resumed.epoch == 4 and len(resumed) == resumed.batches_left == 10
    first = as_lists(batches(resumed))
    other = ResumableDataLoader(IndexDataset(30), batch_size=3, shuffle=True)
    other.set_epoch(4)
    assert as_lists(batches(other)) == first


def test_drop_last_drops_the_same_positions_and_records_them():
    def run():
        ranks = [
            ResumableDataLoader(IndexDataset(53), batch_size=4, shuffle=True, drop_last=True, rank=r, world_size=2)
            for r in range(2)
        ]
        delivered = sorted(i for dl in ranks for b in dl for i in b.tolist())
        return delivered, merge_states([dl.state_dict() for dl in ranks])

    delivered, state = run()
    assert len(delivered) == 48 == len(set(delivered))
    (record,) = state["finished"]
    assert record["epoch"] == 0 and state["epoch"] == 1
    spans = np.asarray(record["dropped"]).reshape(-1, 2)
    assert int((spans[:, 1] - spans[:, 0]).sum()) == 5
    assert run() == (delivered, state)


def test_lockstep_state_is_small_and_cheap_at_a_billion_samples():
    class Huge(Dataset):
        def __len__(self):
            return 10**9

        def __getitem__(self, i):
            return i

    ranks = [ResumableDataLoader(Huge(), batch_size=64, shuffle=True, rank=r, world_size=4) for r in range(4)]
    for dl in ranks:
        batches(dl, count=5)
    states = [dl.state_dict() for dl in ranks]
    merged = merge_states(states)
    assert merged["committed"] == [[0, [0, 5 * 64 * 4]]]
    assert max(len(json.dumps(s)) for s in states + [merged]) < 1024
    # resume at position 5e8 at another world size: no O(N) work, the first batch comes from there
    merged["committed"] = [[0, [0, 5 * 10**8]]]
    resumed = ResumableDataLoader(Huge(), batch_size=64, shuffle=True, rank=1, world_size=3)
    resumed.load_state_dict(merged)
    first = next(iter(resumed))
    assert resumed.batches_left == (10**9 - 5 * 10**8) // (3 * 64)  # full updates, plus the short last one, minus one
    assert len(set(first.tolist())) == 64


def test_uneven_state_grows_with_intervals_only():
    ranks = [ResumableDataLoader(IndexDataset(10_000), batch_size=2, rank=r, world_size=2) for r in range(2)]
    batches(ranks[0], count=50)
    batches(ranks[1], count=10)
    merged = merge_states([dl.state_dict() for dl in ranks], uneven=True)
    ((epoch, flat),) = merged["committed"]
    # rank 0's 40 micro-batches beyond rank 1's progress leave 40 holes: the first merges into the prefix
    assert len(flat) == 2 * 40 and flat[:2] == [0, 42] and flat[-2:] == [49 * 4, 49 * 4 + 2]


class Seeds(IndexDataset):
    def __getitem__(self, i):
        assert isinstance(i, SampleIndex)
        return torch.tensor([int(i), i.seed])


def test_sample_seeds_reach_the_dataset_independent_of_rank_and_worker():
    def collect(**kw):
        dl = ResumableDataLoader(Seeds(24), batch_size=4, shuffle=True, seed=5, sample_seeds=True, **kw)
        return {int(row[0]): int(row[1]) for b in dl for row in b}

    single = collect()
    assert single == {i: sample_seed(5, 0, i) for i in range(24)}
    assert collect(num_workers=2, multiprocessing_context="spawn") == single
    split = {}
    for r in range(3):
        split.update(collect(rank=r, world_size=3))
    assert split == single
    assert pickle.loads(pickle.dumps(SampleIndex(7, 123))).seed == 123


def test_global_batch_is_the_same_before_and_after_a_resize():
    def updates(world, accum, state=None, count=None):
        ranks = [
            ResumableDataLoader(
                IndexDataset(96), batch_size=2, shuffle=True, rank=r, world_size=world, grad_accum=accum
            )
            for r in range(world)
        ]
        for dl in ranks:
            if state:
                dl.load_state_dict(state)
        per_rank = [as_lists(batches(dl, count)) for dl in ranks]
        steps = len(per_rank[0]) // accum
        grouped = [sorted(i for r in per_rank for b in r[g * accum : (g + 1) * accum] for i in b) for g in range(steps)]
        return grouped, merge_states([dl.state_dict() for dl in ranks])

    reference, _ = updates(4, 1)
    before, state = updates(2, 2, count=6)  # 3 updates at W=2
    after, _ = updates(4, 1, state=state)
    assert before + after == reference


# -- loading bad states ------------------------------------------------------------------------------------------


def saved_state(**kw):
    dl = ResumableDataLoader(IndexDataset(50), batch_size=5, shuffle=True, seed=1, **kw)
    batches(dl, count=3)
    return dl.state_dict()


def corrupt(state, path, value):
    state = json.loads(json.dumps(state))
    target = state
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


@pytest.mark.parametrize(
    "make_bad, message",
    [
        (
            lambda s: corrupt(s, ["base", "fingerprint", "num_samples"], 60),
            "num_samples is 60 in the saved state but 50",
        ),
        (lambda s: corrupt(s, ["base", "fingerprint", "seed"], 2), "seed is 2 .* but 1 .* seed=2"),
        (lambda s: corrupt(s, ["base", "fingerprint", "shuffle"], "none"), "shuffle is 'none' .* but 'global'"),
        # a state saved before the order's version was recorded: version 1, whose positions mean other samples
        (lambda s: corrupt(s, ["base", "fingerprint", "order_version"], KeyError), "order_version is 1 .* but 2"),
        (lambda s: corrupt(s, ["version"], 99), "version is 99, this loader reads version 1"),
        (lambda s: corrupt(s, ["format"], "other"), "format is 'other'"),
        (lambda s: corrupt(s, ["completed"], KeyError), "no field 'completed'.*truncated"),
        (lambda s: corrupt(s, ["completed"], 10_000), "reports 10000 completed micro-batches .* share is 10"),
        (lambda s: corrupt(s, ["epoch"], "1"), "epoch must be a non-negative int"),
        (lambda s: corrupt(s, ["base", "committed"], [[0, [9, 3]]]), "sorted, disjoint"),
        (lambda s: [corrupt(s, ["layout", "world_size"], 2)], "missing ranks \\[1\\]"),  # a list must hold every rank
        (lambda s: [s, s], "repeated ranks \\[0\\]"),
        (lambda s: "garbage", "must be a dict"),
    ],
)
def test_bad_states_are_rejected_and_change_nothing(make_bad, message):
    dl = ResumableDataLoader(IndexDataset(50), batch_size=5, shuffle=True, seed=1)
    batches(dl, count=2)
    before, upcoming = dl.state_dict(), len(dl)
    with pytest.raises(StateError, match=message):
        dl.load_state_dict(make_bad(saved_state()))
    assert dl.state_dict() == before and len(dl) == upcoming
    assert issubclass(StateError, ValueError)


# -- IterableDataset ---------------------------------------------------------------------------------------------


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class StatefulStream(Stream):
    """Counts what it yields and restores that, the way stateful iterable datasets do."""

    def __init__(self, n):
        super().__init__(n)
        self.position, self.loaded = 0, False

    def __iter__(self):
        if not self.loaded:
            self.position = 0
        self.loaded = False
        while self.position < self.n:
            self.position += 1
            yield self.position - 1

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position, self.loaded = state["position"], True


@pytest.mark.parametrize("make", [Stream, StatefulStream])
def test_iterable_dataset_resumes_at_the_same_world_size(make):
    reference = as_lists(batches(ResumableDataLoader(make(23), batch_size=4, grad_accum=2)))
    dl = ResumableDataLoader(make(23), batch_size=4, grad_accum=2)
    seen = as_lists(batches(dl, count=3))
    state = dl.state_dict()
    assert state["batches"] == 2 and (state["workers"][0]["dataset"] is not None) == (make is StatefulStream)
    resumed = ResumableDataLoader(make(23), batch_size=4, grad_accum=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert seen[:2] + as_lists(batches(resumed)) == reference
    assert as_lists(batches(resumed)) == reference and resumed.epoch == 1


def test_a_stream_shorter_than_its_saved_progress_ends_the_pass_cleanly():
    dl = ResumableDataLoader(Stream(20), batch_size=4)
    batches(dl, count=4)
    shorter = ResumableDataLoader(Stream(10), batch_size=4)  # the stream changed: only 3 batches now
    shorter.load_state_dict(dl.state_dict())
    assert batches(shorter) == [] and shorter.exhausted
    assert as_lists(batches(shorter)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and shorter.epoch == 1


def test_iterable_dataset_refuses_another_world_size():
    dl = ResumableDataLoader(Stream(10), batch_size=2, rank=0, world_size=2)
    other = ResumableDataLoader(Stream(10), batch_size=2, rank=1, world_size=2)
    state = merge_states([dl.state_dict(), other.state_dict()])
    with pytest.raises(StateError, match="saved at world_size 2, the loader runs at 3.*cannot be repartitioned"):
        ResumableDataLoader(Stream(10), batch_size=2, rank=0, world_size=3).load_state_dict(state)
    with pytest.raises(TypeError, match="no sample indices"):
        dl.last_indices()


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (3, 1), (3, 2), (4, 3)])
def test_unbatched_ranks_yield_the_same_number_of_samples_and_record_the_rest_as_dropped(world_size, grad_accum):
    """batch_size=None hands out single samples, so the tail cannot give a rank one more in a micro-batch (torch
    would hand it out as one more item, counted as a micro-batch it is not, and DDP would wait on that rank's extra
    backward): every rank yields len() samples, the same on every rank, and the rest is recorded as dropped."""
    for n in range(1, 3 * world_size * grad_accum + 2):
        loaders = [
            ResumableDataLoader(
                IndexDataset(n),
                batch_size=None,
                shuffle=True,
                seed=n,
                rank=r,
                world_size=world_size,
                grad_accum=grad_accum,
            )
            for r in range(world_size)
        ]
        yielded = [[int(x) for x in dl] for dl in loaders]
        assert {len(y) for y in yielded} == {len(loaders[0])} == {(n - n % (world_size * grad_accum)) // world_size}
        merged = merge_states([dl.state_dict() for dl in loaders])
        (finished,) = merged["finished"]
        positions = np.concatenate(
            [np.arange(a, b) for a, b in np.reshape(finished["dropped"], (-1, 2))] + [np.zeros(0, np.int64)]
        )
        dropped = loaders[0].resumable_sampler.order.for_epoch(0)(positions).tolist()
        delivered = sorted(sum(yielded, []))
        assert len(set(delivered)) == len(delivered) and sorted(delivered + dropped) == list(range(n))


def test_without_workers_torchs_profiler_event_per_batch_is_kept_when_a_profiler_runs():
    """With num_workers=0 the loader reads each batch without the record_function context torch enters around it,
    unless a profiler runs: under torch.profiler the trace still has torch's event for every next(). Either way
    the same batches, every index of the epoch exactly once."""
    event = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"

    def epoch() -> list[list[int]]:
        dl = ResumableDataLoader(IndexDataset(37), batch_size=4, shuffle=True, seed=1)
        batches = [batch.tolist() for batch in dl]
        assert sorted(i for batch in batches for i in batch) == list(range(37))
        return batches

    plain = epoch()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        profiled = epoch()
    assert profiled == plain
    assert sum(e.name == event for e in profile.events()) == len(plain) + 1  # the last one raised StopIteration


@pytest.mark.parametrize("persistent", [False, True])
def test_close_ends_the_workers_and_the_ledger_file_now_and_a_new_iter_serves_the_rest(tmp_path, persistent):
    """Before the process group goes, nothing of the loader may be left for the interpreter's exit: its workers
    (the active iterator's, or persistent ones) end and the ledger's file closes at close(), or a with block's end."""
    from loader.checkpoint import Ledger

    dl = ResumableDataLoader(
        IndexDataset(40),
        batch_size=4,
        shuffle=True,
        seed=0,
        num_workers=2,
        persistent_workers=persistent,
        multiprocessing_context="fork",
    )
    dl.ledger = Ledger.open(tmp_path, 0, 40)
    batches = iter(dl)
    trained = [i for batch in itertools.islice(batches, 3) for i in batch.tolist()]
    workers = list(batches._workers)
    with dl:
        pass
    assert not any(w.is_alive() for w in workers) and dl.ledger._file.closed
    with pytest.raises(RuntimeError, match="was closed"):
        next(batches)
    dl.ledger = None
    with pytest.warns(ContinuedPassWarning):
        trained += [i for batch in dl for i in batch.tolist()]
    assert sorted(trained) == list(range(40))
