"""filter=: samples dropped where they are read, each recorded as filtered by policy, every kept one trained once.

The exactly-once property over random runs (restarts at shrinking and growing world sizes, uneven stops, failed
batches, mixtures, worker processes) is in tests/test_exactly_once.py; here the batch a filter leaves, the ledger and
the audit across a 4 -> 3 -> 2 restart, the masked shape, and the edges (all filtered, none, a raising predicate).
"""

import os
import pickle
import signal
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from loader import ResumableDataLoader, Rows, merge_states
from loader.checkpoint.audit import EXACTLY_ONCE, Grouping, audit, audit_stream
from loader.checkpoint.audit import main as audit_main
from loader.checkpoint.ledger import Ledger, read_ledger
from loader.core.batch_policy import BatchPolicy
from loader.core.filtering import Sifting, emptied
from loader.streams.filtered import SHARDED
from tests.conftest import IndexDataset
from tests.streams import Plain
from tests.test_sharded_streams import LENGTHS, every_record, loaders, names, take, write_shards
from tests.test_worker_deaths import new_iter


def not_a_multiple_of_3(index, sample) -> bool:
    return int(index) % 3 != 0


class Counting:
    """A filter that remembers every index it was asked about (num_workers=0: in this process)."""

    def __init__(self, keep=not_a_multiple_of_3):
        self.keep, self.asked = keep, []

    def __call__(self, index, sample) -> bool:
        self.asked.append(int(index))
        return self.keep(index, sample)


def features(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).repeat(3, 1).T, torch.arange(n))


def test_a_batch_holds_its_kept_members_and_an_all_filtered_batch_is_empty_on_every_rank():
    """Rank 1's second batch is all filtered: it is still delivered, as an empty batch with the dtypes and trailing
    shapes of a full one, so every rank yields the same number of micro-batches (DDP never waits on a missing one)."""
    dropped = set(range(8, 12)) | {0, 5}
    keep = lambda index, sample: int(index) not in dropped  # noqa: E731
    ranks = [ResumableDataLoader(features(24), batch_size=4, rank=r, world_size=2, filter=keep) for r in range(2)]
    batches = [list(dl) for dl in ranks]
    assert [len(b) for b in batches] == [3, 3]
    x, y = batches[0][1]  # rank 0: positions 8..11, all filtered
    assert x.shape == (0, 3) and x.dtype == torch.float32 and y.shape == (0,) and y.dtype == torch.int64
    assert batches[0][0][1].tolist() == [1, 2, 3] and batches[1][0][1].tolist() == [4, 6, 7]
    trained = sorted(int(i) for b in batches for _, y in b for i in y)
    assert trained == sorted(set(range(24)) - dropped)


def test_a_filter_that_keeps_everything_changes_nothing():
    plain = [y.tolist() for _, y in ResumableDataLoader(features(30), batch_size=4, shuffle=True, seed=0)]
    dl = ResumableDataLoader(features(30), batch_size=4, shuffle=True, seed=0, filter=lambda index, sample: True)
    kept = []
    for _, y in dl:
        kept.append(y.tolist())
        assert dl.last_indices().tolist() == y.tolist() and dl.last_filtered().tolist() == []
    assert kept == plain


def train_rank(dl, micro_batches: int | None) -> None:
    """This rank's training loop for `micro_batches` (None: to the end of its pass); nothing else is asserted."""
    if micro_batches == 0:
        return
    for count, _ in enumerate(dl, start=1):
        if count == micro_batches:
            break


def test_the_ledger_and_audit_count_the_filtered_across_4_3_2_ranks_with_uneven_stops(tmp_path, capsys):
    """Three launches at 4, 3 and 2 ranks, each rank stopping at its own point: the audit finds every kept sample
    seen once and every filtered one filtered once, names them, and the epoch clean."""
    n, kw = 70, dict(batch_size=3, shuffle=True, seed=5, filter=not_a_multiple_of_3)
    state, resumed = None, 0
    for world, stops in ((4, [4, 1, 3, 0]), (3, [2, 0, 1]), (2, [None, None])):
        ranks = [ResumableDataLoader(IndexDataset(n), rank=r, world_size=world, **kw) for r in range(world)]
        first = Ledger.open(tmp_path, resumed, n)
        for r, dl in enumerate(ranks):  # in one process: each simulated rank writes its own file of the launch
            dl.ledger = first if r == 0 else Ledger(tmp_path, first.path.with_name(f"rank-{r:05d}.bin"), resumed)
            if state is not None:
                dl.load_state_dict(state)
            train_rank(dl, stops[r])
        state = merge_states([dl.state_dict() for dl in ranks], uneven=True)
        first.record_finished(state, ranks[0])
        for dl in ranks:
            dl.ledger.close()
        resumed += max(s or 0 for s in stops)
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean and epoch.dropped == 0
    assert epoch.filtered.tolist() == list(range(0, n, 3))
    assert epoch.seen_once == n - len(epoch.filtered)
    by_parity = Grouping(["even", "odd"], lambda ids: ids % 2, n)
    assert [(g.filtered, g.seen_once) for g in audit(tmp_path, by_parity)[0].groups] == [(12, 23), (12, 23)]
    assert audit_main(str(tmp_path)) == EXACTLY_ONCE
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-3:] == ["filtered", "by", "policy"]
    assert out.splitlines()[1].split()[-1] == str(len(epoch.filtered))
    assert "filtered by policy (consumed, not trained): 0, 3, 6," in out
    assert f"audit: {len(epoch.filtered)} sample(s) filtered by policy" in out


def test_a_filter_that_drops_everything_delivers_empty_batches_and_the_audit_names_every_sample(tmp_path, capsys):
    dl = ResumableDataLoader(IndexDataset(10), batch_size=4, grad_accum=2, filter=lambda index, sample: False)
    dl.ledger = Ledger.open(tmp_path, 0, 10)
    sizes = [len(batch) for batch in dl]
    assert sizes == [0, 0, 0]
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    records, _, _ = read_ledger(tmp_path)
    assert max(r.step for r in records) == 2  # empty batches still complete their updates
    (epoch,) = audit(tmp_path)
    assert epoch.clean and epoch.seen_once == 0 and epoch.filtered.tolist() == list(range(10))
    assert audit_main(str(tmp_path), limit=3) == EXACTLY_ONCE
    assert "filtered by policy (consumed, not trained): 0, 1, 2, ... (10 in all)" in capsys.readouterr().out


def test_a_sample_both_trained_and_filtered_is_a_duplicate(tmp_path, capsys):
    """The audit counts a filtered delivery as a delivery: filtered once and trained once, or filtered twice, is
    consumed twice (a loader that served it again), never reported clean."""
    ledger = Ledger.open(tmp_path, 0, 6)
    ledger.record(0, np.array([0, 1]), True, filtered=np.array([2, 3]))
    ledger.record(0, np.array([3, 4]), True, filtered=np.array([2, 5]))
    ledger.close()
    (epoch,) = audit(tmp_path)
    assert epoch.duplicated.tolist() == [2, 3] and epoch.filtered.tolist() == [5] and epoch.seen_once == 3
    assert not epoch.clean


def test_masked_batches_keep_their_shape_and_say_which_rows_to_train_on(tmp_path):
    dl = ResumableDataLoader(features(12), batch_size=4, filter=not_a_multiple_of_3, filtered="masked")
    dl.ledger = Ledger.open(tmp_path, 0, 12)
    for x, y in dl:
        assert x.shape == (4, 3) and dl.last_indices().tolist() == y.tolist()
        assert dl.last_kept().tolist() == [i % 3 != 0 for i in y.tolist()]
        assert dl.last_filtered().tolist() == [i for i in y.tolist() if i % 3 == 0]
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    (epoch,) = audit(tmp_path)
    assert epoch.clean and epoch.filtered.tolist() == [0, 3, 6, 9] and epoch.seen_once == 8


class Windows(Dataset):
    """Rows of a token file as one tensor per batch (as TokenSource reads them): row i is [i, i + 1, i + 2]."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.arange(i, i + 3)

    def __getitems__(self, indices):
        return Rows(torch.stack([self[i] for i in indices]))


def test_filtered_rows_are_the_kept_rows_of_the_batch_tensor():
    dl = ResumableDataLoader(Windows(), batch_size=4, filter=lambda index, row: int(row[0]) % 4 != 1 and index < 12)
    batches = list(dl)
    assert [b.shape for b in batches] == [(3, 3), (3, 3), (3, 3), (0, 3)]
    assert batches[1].tolist() == [[4, 5, 6], [6, 7, 8], [7, 8, 9]]
    masked = list(ResumableDataLoader(Windows(), batch_size=4, filter=lambda index, row: False, filtered="masked"))
    assert [b.shape for b in masked] == [(4, 3)] * 4  # fixed shapes: every row, the verdicts in last_kept()


def test_resume_never_asks_the_filter_about_what_was_consumed():
    """O(1) in what was trained: after a resume the predicate sees each remaining position once, none before."""
    first = Counting()
    dl = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=2, filter=first)
    train_rank(dl, 3)
    consumed = set(first.asked)
    assert len(first.asked) == len(consumed) == 12
    later = Counting()
    resumed = ResumableDataLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=2, filter=later)
    resumed.load_state_dict(dl.state_dict())
    train_rank(resumed, None)
    assert sorted(later.asked) == sorted(set(range(40)) - consumed)


def test_a_raising_filter_fails_its_batch_and_the_next_one_is_delivered(tmp_path):
    def keep(index, sample):
        if index == 5:
            raise ValueError("no verdict for 5")
        return index % 2 == 0

    dl = ResumableDataLoader(IndexDataset(12), batch_size=4, filter=keep)
    dl.ledger = Ledger.open(tmp_path, 0, 12)
    it = iter(dl)
    assert next(it).tolist() == [0, 2]
    with pytest.raises(ValueError, match="no verdict for 5"):
        next(it)
    assert next(it).tolist() == [8, 10] and dl.last_filtered().tolist() == [9, 11]
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    (epoch,) = audit(tmp_path)
    assert epoch.failed.tolist() == [4, 5, 6, 7] and epoch.filtered.tolist() == [1, 3, 9, 11] and epoch.clean


def test_peek_shows_the_filtered_batch_without_consuming_it():
    dl = ResumableDataLoader(IndexDataset(8), batch_size=4, filter=not_a_multiple_of_3)
    assert dl.peek().tolist() == [1, 2]
    assert [b.tolist() for b in dl] == [[1, 2], [4, 5, 7]]


def test_workers_see_the_dataset_through_the_view():
    """A worker_init_fn that configures get_worker_info().dataset configures the dataset; the view pickles."""
    dataset = IndexDataset(4)
    view = pickle.loads(pickle.dumps(Sifting(dataset, not_a_multiple_of_3, list, "removed")))
    view.n = 3
    assert view.dataset.n == 3 and len(view) == 3
    sifted = view.__getitems__([0, 1, 2])
    assert sifted.batch == [1, 2] and sifted.kept.tolist() == [False, True, True]


def test_an_empty_batch_keeps_the_structure_of_a_full_one():
    Pair = namedtuple("Pair", "x names")
    full = {"x": torch.ones(2, 5), "pair": Pair(torch.zeros(2), ["a", "b"]), "ids": [torch.ones(2)]}
    empty = emptied(full)
    assert empty["x"].shape == (0, 5) and type(empty["pair"]) is Pair and empty["pair"].names == []
    assert empty["pair"].x.shape == (0,) and empty["ids"][0].shape == (0,)
    with pytest.raises(TypeError, match="cannot be made empty.*filtered='masked'"):
        emptied(object())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(filtered="shorter"), "filtered must be 'removed'"),
        (dict(filter=3), "filter must be a function of"),
        (dict(filter=not_a_multiple_of_3, batch_size=None), "filter= needs batches"),
    ],
)
def test_bad_filter_arguments_say_what_to_pass(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResumableDataLoader(IndexDataset(4), **{"batch_size": 2, **kwargs})


# -- streams: the filter drops records before they are batched ------------------------------------------------------


def keep_record(index, record) -> bool:
    """Records "shard:number" of tests.test_sharded_streams; a stream's records have no index."""
    assert index is None
    shard, number = map(int, record.split(":"))
    return (shard + number) % 3 != 0


def kept_records() -> list:
    return [name for name in every_record() if keep_record(None, name)]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: starts worker processes
def test_a_filtered_sharded_stream_reads_every_kept_record_once_at_4_3_2_ranks(tmp_path, workers):
    """Ranks stop at their own points at 4 and 3 ranks; 2 ranks read the rest: every kept record once, no other."""
    paths, seen, state = write_shards(tmp_path), [], None
    for world, stops in ((4, [3, 1, 2, 0]), (3, [1, 0, 2]), (2, [None, None])):
        ranks = loaders(paths, world, workers, shuffle=True, filter=keep_record)
        for dl, stop in zip(ranks, stops):
            if state is not None:
                dl.load_state_dict(state)
            seen += list(dl) if stop is None else take(dl, stop)
        state = merge_states([dl.state_dict() for dl in ranks])
    assert sorted(names(seen)) == kept_records()


def test_a_filtered_stream_fills_its_batches_with_kept_records_and_counts_the_others(tmp_path):
    (dl,) = loaders(write_shards(tmp_path), 1, 0, filter=keep_record)
    batches = list(dl)
    assert all(len(batch) == 2 for batch in batches[:-1]) and sorted(names(batches)) == kept_records()
    metrics = dl.metrics()
    assert metrics["total/filtered"] == len(every_record()) - len(kept_records())
    assert metrics["total/samples"] == len(kept_records())
    with pytest.raises(TypeError, match="counted"):
        dl.last_filtered()


def test_a_stream_whose_filter_drops_everything_delivers_nothing_and_counts_every_record(tmp_path):
    (dl,) = loaders(write_shards(tmp_path), 1, 0, filter=lambda index, record: False)
    assert list(dl) == [] and dl.metrics()["total/filtered"] == len(every_record())


def test_a_raising_stream_filter_fails_its_batch_and_the_stream_goes_on(tmp_path):
    def keep(index, record):
        if record == "0:2":
            raise ValueError("no verdict for 0:2")
        return True

    (dl,) = loaders(write_shards(tmp_path, [5]), 1, 0, filter=keep)
    it = iter(dl)
    assert names([next(it)]) == ["0:0", "0:1"]
    with pytest.raises(ValueError, match="no verdict"):
        next(it)
    assert names(list(it)) == ["0:3", "0:4"]  # the failed batch consumed what it drew: 0:2, never read again


def test_a_stream_is_refused_masked_batches(tmp_path):
    with pytest.raises(ValueError, match="filtered='masked' keeps a map-style batch's members"):
        loaders(write_shards(tmp_path), 1, 0, filter=keep_record, filtered="masked")


def test_the_first_step_of_a_stream_counts_its_samples():
    """A stream's records were added before the step's start was marked, so its first step said 0 samples."""
    dl = ResumableDataLoader(Plain(10), batch_size=2)
    next(iter(dl))
    assert dl.metrics()["samples"] == 2


def test_metrics_count_the_samples_delivered_not_the_filtered():
    dl = ResumableDataLoader(IndexDataset(12), batch_size=3, grad_accum=2, filter=not_a_multiple_of_3)
    for _ in dl:
        pass
    metrics = dl.metrics()
    assert metrics["samples"] == 4 and metrics["total/samples"] == 8 and metrics["batches"] == 2


def test_a_filter_under_a_batch_size_ramp_across_2_to_3_ranks_is_audited_from_the_loaders_own_epoch_end(tmp_path):
    """filter= with batch_policy= (K follows the step and the world size) and the ledger's END records (flag 16;
    FILTERED is 32): two steps at 2 ranks, the rest of the epoch at 3 from the merged state, no record_finished. The
    audit finds the epoch finished, every kept sample trained once and every other filtered once."""
    n, policy = 60, BatchPolicy([(0, 12), (2, 24)], 2)
    trained, state = [], None
    for world, resumed, updates in ((2, 0, 2), (3, 2, None)):
        ranks = [
            ResumableDataLoader(
                TensorDataset(torch.arange(n)),
                batch_size=2,
                shuffle=True,
                seed=0,
                rank=r,
                world_size=world,
                batch_policy=policy,
                filter=not_a_multiple_of_3,
            )
            for r in range(world)
        ]
        first = Ledger.open(tmp_path, resumed, n)
        for r, dl in enumerate(ranks):
            if state is not None:
                dl.load_state_dict(state)
            dl.ledger = first if r == 0 else Ledger(tmp_path, first.path.parent / f"rank-{r:05d}.bin", resumed)
        for dl in ranks:
            it, done = iter(dl), 0
            for (x,) in it:
                assert x.tolist() == dl.last_indices().tolist() and not (x % 3 == 0).any()
                trained += x.tolist()
                done += dl.update_complete
                if done == updates:
                    break
        state = merge_states([dl.state_dict() for dl in ranks])
        for dl in ranks:
            dl.ledger.close()
    (epoch,) = audit(tmp_path)
    assert sorted(trained) == [i for i in range(n) if i % 3]
    assert epoch.finished and epoch.clean and epoch.seen_once == 40
    assert epoch.filtered.tolist() == list(range(0, n, 3))


# -- streams: the records the filter drops, named in the ledger -----------------------------------------------------

LONG_SHARDS = [40, 0, 75, 33, 90, 1, 61]  # 300 records "shard:number"


def stream_launch(run_dir, paths, world, workers, resumed, state, stops, kill=False):
    """One launch of a stream's job in this process, each rank with its file of the launch's ledger: each rank
    trains `stops[r]` batches (None: to its end) and the state is taken there (the checkpoint, at the step of the
    rank that trained most); that rank then trains two more, which the next launch replays, before the job dies.
    `kill`: rank 0's worker 0 is SIGKILLed after its first batches, and the rank goes on with a new iter(), as a
    training loop that skips errors does. Returns the records trained in the checkpoint's steps, the state and the
    step it stands for."""
    ranks = loaders(paths, world, workers, shuffle=True, filter=keep_record)
    first = Ledger.open_stream(run_dir, resumed)
    trained, its = [], []
    for r, dl in enumerate(ranks):
        if r:
            dl.ledger = Ledger(run_dir, first.path.with_name(f"rank-{r:05d}.bin"), resumed)
            dl.ledger.stream = True
        else:
            dl.ledger = first
        if state is not None:
            dl.load_state_dict(state)
        current = [None]
        it = new_iter(dl, current)
        if kill and r == 0:
            trained += names(take(it, 2))
            os.kill(it._inner._workers[0].pid, signal.SIGKILL)
            for _ in range(6):  # the batches on their way, then the death, then the loader's word to re-iter
                try:
                    trained += names([next(it)])
                except (RuntimeError, ConnectionError, EOFError) as err:
                    if "new iter()" in str(err):
                        it = new_iter(dl, current)
                        break
        while stops[r] is None or dl.ledger.step - resumed < stops[r]:
            batch = next(it, None)
            if batch is None:
                break
            trained += names([batch])
        its.append(it)
    states = [dl.state_dict() for dl in ranks]  # the checkpoint; a finished rank names its workers' last drops
    steps = [dl.ledger.step for dl in ranks]
    take(its[steps.index(max(steps))], 2)  # past the checkpoint's step: replayed by the next launch, not counted
    for dl in ranks:
        dl.close()
    return trained, merge_states(states), max(steps)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: starts worker processes
def test_a_filtered_streams_dropped_records_are_named_once_across_a_worker_kill_and_resumes(tmp_path, workers, capsys):
    """Three launches at 2, 3 and 1 ranks (another number of workers at 3), ranks stopping at their own points,
    with 2 workers a worker SIGKILLed mid-epoch: every record of the epoch trained once or named once by the
    ledger as filtered by policy, never both, never neither (each filtered record by shard and record)."""
    paths, run_dir = write_shards(tmp_path, LONG_SHARDS), tmp_path / "run"
    trained, state, resumed = [], None, 0
    for world, stops, count in ((2, [7, 3], workers), (3, [5, 0, 9], max(workers - 1, 0)), (1, [None], workers)):
        kill = world == 2 and workers > 0
        more, state, resumed = stream_launch(run_dir, paths, world, count, resumed, state, stops, kill)
        trained += more
    every = every_record(LONG_SHARDS)
    assert len(trained) == len(set(trained)) and sorted(trained) == [n for n in every if keep_record(None, n)]
    (epoch,) = audit_stream(run_dir)
    assert epoch.clean and all(rank == SHARDED and batch == SHARDED for rank, _, batch, _ in epoch.filtered.tolist())
    filtered = sorted(f"{shard}:{record}" for _, shard, _, record in epoch.filtered.tolist())
    assert filtered == [n for n in every if not keep_record(None, n)]
    assert audit_main(str(run_dir), limit=3) == EXACTLY_ONCE
    out = capsys.readouterr().out
    assert f"audit: a stream's run: {len(filtered)} record(s) filtered by policy" in out
    assert "filtered by policy (consumed, not trained): shard 0 record 0, shard 0 record 3, shard 0 record 6, .." in out


def keep_short(index, record) -> bool:
    """keep_record's, and no record past a shard's 5th (a plain stream's record is its number, none past 30): so
    the stream ends with records dropped after its last batch, which is full (16 and 20 kept)."""
    shard, number = map(int, record.split(":")) if isinstance(record, str) else (0, record)
    return (shard + number) % 3 != 0 and number < (5 if isinstance(record, str) else 30)


@pytest.mark.parametrize("saved_after_the_end", [False, True])
@pytest.mark.parametrize("kind", ["sharded", "plain"])
def test_records_dropped_after_a_workers_last_batch_are_named_once_wherever_the_checkpoint_stood(
    tmp_path, kind, saved_after_the_end
):
    """A stream's last records are dropped after its last batch: consumed by the state that holds the stream's end.
    Launch 1 reads the whole stream, its checkpoint taken after the last batch, before the stream's end came in (or
    after, once the pass ended); launch 2 resumes from it. Either the end was committed and launch 1 names them, or
    launch 2 reads them again and names them: once, never twice, never not at all."""

    def loader():
        if kind == "plain":
            return ResumableDataLoader(Plain(40), batch_size=4, filter=keep_short)
        (dl,) = loaders(write_shards(tmp_path), 1, 0, filter=keep_short)
        return dl

    dl, trained, run_dir = loader(), [], tmp_path / "run"
    dl.ledger = Ledger.open_stream(run_dir, 0)
    for batch in dl:
        trained.append(batch)
        state = dl.state_dict()  # a checkpoint each step: the last one before the stream's end came in
    if saved_after_the_end:
        state = dl.state_dict()
    dl.close()
    resumed = loader()
    resumed.ledger = Ledger.open_stream(run_dir, len(trained))
    resumed.load_state_dict(state)
    if not saved_after_the_end:  # else the epoch is over: the next pass would read the next one
        trained += list(resumed)
    resumed.state_dict()
    resumed.close()
    every = [f"{s}:{r}" for s, n in enumerate(LENGTHS) for r in range(n)] if kind == "sharded" else list(range(40))
    kept = [record for record in every if keep_short(None, record)]
    assert sorted(names(trained) if kind == "sharded" else torch.cat(trained).tolist()) == sorted(kept)
    (epoch,) = audit_stream(run_dir)
    assert epoch.clean and len(epoch.filtered) == len(every) - len(kept)
    if kind == "sharded":
        named = sorted(f"{shard}:{record}" for _, shard, _, record in epoch.filtered.tolist())
        assert named == sorted(set(every) - set(kept))
    else:  # (rank 0, worker 0, batch, record of its draw): batch 0 drew 0..5 (kept 1, 2, 4, 5), dropping 0 and 3
        assert epoch.filtered[:2].tolist() == [[0, 0, 0, 0], [0, 0, 0, 3]]
