"""Edges of streams that the other stream tests do not reach: shards that fail as they are opened or at the end of
a pass, ranks dealt no shard, a worker process that dies and a worker_init_fn that raises. Every test counts every
record: delivered exactly once, or lost loudly with the batch that failed, the same whether or not the run was
resumed.
"""

import os
import re
import signal
import sys
import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import AbandonedEpochWarning, ContinuedPassWarning, ResumableDataLoader, ShardedStream, merge_states
from loader.dataloader import WorkerInitError
from loader.sources.sharded import FileShards
from tests.streams import FORK, DatasetState, Plain, record_id
from tests.test_map_edges import InitFailingOnce, kill
from tests.test_sharded_streams import every_record, read_lines, take, write_shards
from tests.test_streams import train_skipping_errors


def opened_at_once(path):
    """A reader that checks its file when called, before any record is drawn: shard 1 fails there."""
    if path.endswith("part-1.txt"):
        raise ValueError(f"{path} has a corrupt header")
    return read_lines(path)


def test_a_shard_that_cannot_be_opened_fails_one_batch_and_the_worker_goes_on(tmp_path):
    paths = write_shards(tmp_path, [4, 3, 6])
    iterator = iter(ResumableDataLoader(FileShards(paths, opened_at_once), batch_size=2, collate_fn=list))
    delivered, errors = [], 0
    for _ in range(20):  # bounded: a worker stuck on the shard fails every batch
        try:
            delivered += next(iterator)
        except StopIteration:
            break
        except ValueError:
            errors += 1
    assert errors == 1 and delivered == every_record([4, 0, 6])  # shard 0 ends on a batch: nothing else is lost


def breaking_in_the_last_shard(path):
    for record in read_lines(path):
        if record == "2:3":
            raise ValueError("corrupt record 2:3")
        yield record


@pytest.mark.parametrize("new_world", [1, 2])
def test_a_resume_after_the_last_shard_failed_does_not_read_the_rest_of_it_again(tmp_path, new_world):
    paths = write_shards(tmp_path, [4, 2, 6])

    def loader(rank=0, world_size=1):
        return ResumableDataLoader(
            FileShards(paths, breaking_in_the_last_shard),
            batch_size=2,
            collate_fn=list,
            rank=rank,
            world_size=world_size,
        )

    reference, errors = train_skipping_errors(loader())
    assert errors == 1  # the batch [2:2, 2:3] fails, and the rest of shard 2 with it
    expected = [r for r in every_record([4, 2, 6]) if r not in {"2:2", "2:3", "2:4", "2:5"}]
    assert sorted(r for batch in reference for r in batch) == expected
    first = loader()
    iterator = iter(first)
    before = [next(iterator) for _ in reference]
    with pytest.raises(ValueError, match="corrupt record 2:3"):
        next(iterator)  # the failed batch is the pass's last: the state after it is the end of the pass
    after, errors = [], 0
    for rank in range(new_world):
        resumed = loader(rank, new_world)
        resumed.load_state_dict(first.state_dict())
        batches, failed = train_skipping_errors(resumed)
        after, errors = after + batches, errors + failed
    assert errors == 0 and after == [] and before == reference


def test_a_rank_dealt_no_shard_saved_before_its_first_batch_resumes_at_another_world_size(tmp_path):
    paths = write_shards(tmp_path, [5, 4])
    first = [
        ResumableDataLoader(FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank, world_size=3)
        for rank in range(3)
    ]
    iterators = [iter(dl) for dl in first]  # rank 2 is dealt no shard: its state names no task
    seen = [next(iterators[0]), next(iterators[1])]
    state = merge_states([dl.state_dict() for dl in first])
    for rank in range(2):
        resumed = ResumableDataLoader(
            FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank, world_size=2
        )
        resumed.load_state_dict(state)
        seen += take(resumed, 10)
    assert sorted(r for batch in seen for r in batch) == every_record([5, 4])


@pytest.mark.parametrize("new_world, new_workers", [(1, 0), (2, 0), (1, 2)])
def test_a_state_after_the_last_record_before_the_end_of_the_pass_ends_that_epoch_at_any_layout(
    tmp_path, new_world, new_workers
):
    paths = write_shards(tmp_path, [5, 4])  # 9 records: the last batch is short, its snapshot says the reader ended

    def loader(rank=0, world_size=1, num_workers=0):
        return ResumableDataLoader(
            FileShards(paths, read_lines),
            batch_size=2,
            collate_fn=list,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            **(FORK if num_workers else {}),
        )

    first = loader()
    assert len(take(first, 5)) == 5  # every record, and no StopIteration yet: the pass of epoch 0 has not ended
    seen = []
    for rank in range(new_world):
        resumed = loader(rank, new_world, new_workers)
        resumed.load_state_dict(first.state_dict())
        assert list(resumed) == [] and resumed.epoch == 0  # the rest of epoch 0: nothing, as if never stopped
        epoch_1 = [record for batch in resumed for record in batch]
        assert resumed.epoch == 1
        seen += epoch_1
    assert sorted(seen) == every_record([5, 4])


# -- a training loop of sharded-stream passes, stopped and resumed at other world sizes, with shards that fail -------


class Shards(ShardedStream):
    """Shard s holds records (s, 0) ... (s, lengths[s] - 1); `bad[s]` is None, "open" (iter_shard raises on the
    call) or the record that raises."""

    def __init__(self, lengths, bad):
        self.lengths, self.bad = lengths, bad

    def shards(self):
        return [f"shard {s}" for s in range(len(self.lengths))]

    def iter_shard(self, index, start):
        if self.bad[index] == "open":
            raise ValueError(f"shard {index} cannot be opened")
        return self._records(index, start)

    def _records(self, index, start):
        for r in range(start, self.lengths[index]):
            if r == self.bad[index]:
                raise ValueError(f"shard {index} is corrupt at record {r}")
            yield index, r


class Run:
    """Every rank of one world size over the shards, as a training loop drives them: passes one after another, each
    record noted with the epoch the loader was in; every failed batch noted with its epoch and shard."""

    def __init__(self, stream, world_size, seed, shuffle, state):
        self.loaders = [
            ResumableDataLoader(
                stream, batch_size=2, collate_fn=list, rank=rank, world_size=world_size, seed=seed, shuffle=shuffle
            )
            for rank in range(world_size)
        ]
        for dl in self.loaders:
            if state is not None:
                dl.load_state_dict(state)
        self.iterators = [None] * world_size

    def step(self, rank, delivered, failed) -> bool:
        """One next() of the rank; False when it ended a pass."""
        dl = self.loaders[rank]
        if self.iterators[rank] is None:
            self.iterators[rank] = iter(dl)
        try:
            delivered.extend((dl.epoch, record) for record in next(self.iterators[rank]))
        except StopIteration:
            self.iterators[rank] = None
            return False
        except ValueError as err:
            failed[(dl.epoch, int(re.search(r"shard (\d+)", str(err)).group(1)))] += 1
        return True

    def state(self):
        return merge_states([dl.state_dict() for dl in self.loaders])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from([None, None, None, "open", 0, 1, 3])), min_size=1, max_size=6
    ),
    st.integers(0, 9),
    st.booleans(),
    st.data(),
)
def test_a_loop_of_passes_stopped_and_resumed_at_any_world_size_reads_each_epoch_once(shards, seed, shuffle, data):
    lengths, bad = [n for n, _ in shards], [b for _, b in shards]
    stream, delivered, failed, state = Shards(lengths, bad), [], Counter(), None
    for _ in range(data.draw(st.integers(1, 3))):  # stop after some steps of each rank, resume at a world size
        run = Run(stream, data.draw(st.integers(1, 3)), seed, shuffle, state)
        if state is not None:  # a resumed rank stands in an epoch some rank of the state stood in
            saved = [r["epoch"] for r in state["ranks"]]
            assert all(min(saved) <= dl.epoch <= max(saved) for dl in run.loaders)
        for rank in range(len(run.loaders)):
            for _ in range(data.draw(st.integers(0, 12))):
                run.step(rank, delivered, failed)
            if run.iterators[rank] is None and data.draw(st.booleans()):  # a pass begun, its first batch not drawn
                run.iterators[rank] = iter(run.loaders[rank])
        state = run.state()
    last = max([epoch for epoch, _ in delivered], default=0)
    run = Run(stream, data.draw(st.integers(1, 3)), seed, shuffle, state)
    for rank, dl in enumerate(run.loaders):  # every rank to the end of epoch `last`
        for _ in range(4 * sum(lengths) + 20):  # bounded: a rank stuck failing every batch never gets there
            if dl.epoch > last or (dl.epoch == last and run.iterators[rank] is None and dl.exhausted):
                break
            run.step(rank, delivered, failed)
        else:
            raise AssertionError(f"rank {rank} did not reach the end of epoch {last}")
    assert max(failed.values(), default=1) == 1, "a shard failed twice in one epoch"
    for epoch in range(last + 1):
        records = Counter(record for e, record in delivered if e == epoch)
        assert max(records.values(), default=1) == 1, f"a record delivered twice in epoch {epoch}"
        lost = {(s, r) for s, n in enumerate(lengths) for r in range(n)} - set(records)
        errors = sum(count for (e, _), count in failed.items() if e == epoch)
        broken = {(s, r) for s, r in lost if (epoch, s) in failed and (bad[s] == "open" or r >= bad[s])}
        assert len(lost - broken) <= errors, f"epoch {epoch}: more lost than the failed batches had drawn"


def test_a_state_whose_base_has_finished_shards_loads_again(tmp_path):
    paths = write_shards(tmp_path, [2, 5, 5])

    def loader(rank=0, world_size=1):
        return ResumableDataLoader(
            FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank, world_size=world_size
        )

    first = [loader(rank, 2) for rank in range(2)]
    seen = take(first[0], 2) + take(first[1], 1)  # rank 0 reads shard 0, then shard 2: shard 0 is done
    resized = loader()
    resized.load_state_dict(merge_states([dl.state_dict() for dl in first]))
    seen += take(resized, 1)
    again = loader()
    again.load_state_dict(resized.state_dict())  # its base lists shard 0 as done
    seen += list(again)
    assert sorted(r for batch in seen for r in batch) == every_record([2, 5, 5])


def test_set_epoch_back_to_an_epoch_before_a_resize_reads_it_whole_and_its_state_loads(tmp_path):
    paths = write_shards(tmp_path, [3, 4, 2])

    def loader(rank=0, world_size=1):
        return ResumableDataLoader(
            FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank, world_size=world_size
        )

    first = loader()
    list(first), list(first)  # epochs 0 and 1
    resized = [loader(rank, 2) for rank in range(2)]
    for dl in resized:
        dl.load_state_dict(first.state_dict())  # its base starts at epoch 2
        dl.set_epoch(0)  # as a loader of the same layout does: epoch 0 again, from its start
    seen = take(resized[0], 1)
    state = merge_states([dl.state_dict() for dl in resized])
    for rank in range(2):
        resumed = loader(rank, 2)
        resumed.load_state_dict(state)
        assert resumed.epoch == 0
        seen += list(resumed)
    assert sorted(r for batch in seen for r in batch) == every_record([3, 4, 2])


class StallOnce:
    """Wraps a stream: the worker that reaches record `at` first writes its pid to `mark` and stops there (bounded),
    to be killed while the main process waits for its batch. Later passes read on."""

    def __init__(self, records, at, mark):
        self.records, self.at, self.mark = records, at, mark

    def __call__(self, *args):
        for record in self.records(*args):
            if record == self.at and not self.mark.exists():
                self.mark.write_text(str(os.getpid()))
                time.sleep(30)
            yield record


class PlainStallingOnce(Plain):
    def __init__(self, n, stall):
        super().__init__(n)
        self.stall = stall

    def __iter__(self):
        return self.stall(super().__iter__)()


def stream_loader(kind, tmp_path, stall_at=None, **kw):
    """A plain stream of 24 records, or a sharded one of 18, at 2 fork workers (its reader stalling once at
    `stall_at`, see StallOnce); and every record of its epoch."""
    kw.update(batch_size=2, collate_fn=list, num_workers=2, **FORK)
    stall = lambda read: StallOnce(read, stall_at, tmp_path / "stalled")  # noqa: E731
    if kind == "plain":
        return ResumableDataLoader(PlainStallingOnce(24, stall), **kw), list(range(24))
    paths = write_shards(tmp_path, [5, 4, 6, 3])
    return ResumableDataLoader(FileShards(paths, stall(read_lines)), **kw), every_record([5, 4, 6, 3])


def kill_when_awaited(it, mark):
    """SIGKILL the stalled worker once the main thread waits inside next() for its batch: torch's SIGCHLD handler
    then raises there (a worker killed at another moment is noticed after torch's 5 s status check)."""
    main = threading.main_thread().ident
    inner = it._inner
    for _ in range(2000):  # bounded: 20 s
        frame = sys._current_frames()[main]
        while frame is not None and frame.f_code.co_name != "_try_get_data":
            frame = frame.f_back
        if frame is not None and mark.exists() and mark.read_text():
            pid = int(mark.read_text())
            awaited = inner._task_info.get(inner._rcvd_idx, (None,))[0]
            if awaited is not None and inner._workers[awaited].pid == pid:
                os.kill(pid, signal.SIGKILL)
                return
        time.sleep(0.01)
    raise TimeoutError("the stalled worker was never awaited")


def going_on(loader, it, error):
    """The iterator a loop that skips a bad batch goes on with after `error`: a new one where the loader says so."""
    if "new iter()" not in str(error):
        return it
    with pytest.warns(ContinuedPassWarning):
        return iter(loader)


def through_a_stop_then_resumed(make, it, delivered):
    """Go on with `it` past the errors, save a state after the second error's next batch (or at the end), and read
    the rest of the epoch from it in a new loader: the records up to the state, then the rest."""
    errors = []
    while len(errors) < 5:
        try:
            delivered += next(it)
        except StopIteration:
            break
        except Exception as err:  # noqa: BLE001 - any error a training loop would skip
            errors.append(err)
            it = going_on(make.loader, it, err)
            continue
        if len(errors) == 2 and make.state is None:
            make.state, make.upto = make.loader.state_dict(), len(delivered)
    if make.state is None:
        make.state, make.upto = make.loader.state_dict(), len(delivered)
    resumed, _ = make()
    resumed.load_state_dict(make.state)
    records = delivered[: make.upto] + [r for batch in resumed for r in batch]
    for dl in (make.loader, resumed):  # persistent workers, shut down here: at garbage collection, torch waits 5 s
        if dl._iterator is not None:  # for each of them
            dl._iterator._shutdown_workers()
    return errors, records


class Maker:
    """The same loader again (for the resume), and the one under test with the state it saved."""

    def __init__(self, kind, tmp_path, **kw):
        self.args, self.state, self.upto = (kind, tmp_path, kw), None, 0
        self.loader, self.expected = self()

    def __call__(self):
        kind, tmp_path, kw = self.args
        return stream_loader(kind, tmp_path, **kw)


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("kind, persistent, at", [("plain", False, 9), ("sharded", True, "2:3")])
def test_a_stream_whose_worker_died_stops_and_a_new_iter_reads_each_record_once(tmp_path, kind, persistent, at):
    """torch went on with the other worker and ended the pass: the loader marked the epoch read, the dead worker's
    records after its last delivered batch were skipped without a word, and a state saved then was refused as
    corrupted (its snapshots did not add up to an ended pass)."""
    make = Maker(kind, tmp_path, stall_at=at, persistent_workers=persistent)
    it = iter(make.loader)
    killer = threading.Thread(target=kill_when_awaited, args=(it, tmp_path / "stalled"), daemon=True)
    killer.start()
    errors, records = through_a_stop_then_resumed(make, it, [])
    killer.join(20)
    assert Counter(records) == Counter(make.expected)
    assert len(errors) == 2 and "worker process of this iterator died" in str(errors[1])


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("kind, persistent", [("plain", True), ("sharded", False)])
def test_a_stream_worker_init_fn_that_raises_consumes_no_batch(tmp_path, kind, persistent):
    """torch raised the worker's init error, then an UnboundLocalError for each of its batches, forever: a loop
    that skips a bad batch never ended that iterator, nor read that worker's records in it."""
    make = Maker(kind, tmp_path, persistent_workers=persistent, worker_init_fn=InitFailingOnce(tmp_path / "failed"))
    errors, records = through_a_stop_then_resumed(make, iter(make.loader), [])
    assert Counter(records) == Counter(make.expected)
    assert isinstance(errors[0], WorkerInitError) and "could not open the database" in str(errors[0])
    assert isinstance(errors[0], ConnectionError)  # its own type too, as torch re-raises it
    assert len(errors) == 2 and make.loader.metrics()["total/failed_batches"] == 0


@pytest.mark.slow  # starts worker processes
def test_a_persistent_worker_that_died_between_passes_is_started_as_it_ended():
    """New workers started in place of persistent ones (one died between passes) went on to the next pass from fresh
    copies of the dataset: its own state (here its epoch counter) and random state were not the ones the epoch's end
    left, which an uninterrupted run and a resume from a state saved there both have."""
    runs = []
    for killed in (False, True):
        dl = ResumableDataLoader(
            DatasetState(12, random_draws=True),
            batch_size=2,
            collate_fn=list,
            num_workers=2,
            persistent_workers=True,
            **FORK,
        )
        first = [r for batch in dl for r in batch]
        if killed:
            kill(dl._iterator._workers[0])
        runs.append((first, [r for batch in dl for r in batch]))
        dl._iterator._shutdown_workers()
    assert runs[0] == runs[1] and sorted(record_id(r) for r in runs[1][1]) == list(range(12))


def test_set_epoch_that_leaves_a_stream_part_way_warns_and_the_natural_calls_do_not():
    """As for a map-style loader: an epoch loop off by one (set_epoch(e + 1) with epoch e's stream not read to its
    end) would skip the rest silently. set_epoch of the current epoch, and of the next after the stream's end, say
    nothing (the project's warnings are errors here)."""
    dl = ResumableDataLoader(Plain(12), batch_size=2)
    it = iter(dl)
    next(it), next(it)
    dl.set_epoch(0)  # the current epoch: what is left of it
    with pytest.warns(
        AbandonedEpochWarning,
        match=r"set_epoch\(1\) abandons epoch 0 part way: rank 0's stream was "
        r"not read to its end \(after 2 batch\(es\)\)",
    ):
        dl.set_epoch(1)
    assert len(list(dl)) == 6  # epoch 1 whole
    dl.set_epoch(2)  # the natural advance after its end
    assert dl.epoch == 2 and len(list(dl)) == 6
