"""Streams (IterableDataset) with any num_workers: each worker's state travels with its batches, so a resume at
"k batches delivered" continues exactly, bit-identically for streams that draw random numbers, without replay for
streams with state. Every test counts each record of the pass: delivered exactly once, or consumed by a failure.
"""

import copy
import gc
import itertools
import json
import random
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import get_worker_info

from loader import ContinuedPassWarning, ResumableDataLoader, StateError
from loader.streams import rng
from loader.streams.rng import UNCHANGED, RngWatch, rng_state, set_rng_state
from tests.streams import (
    FORK,
    Continuing,
    DatasetState,
    Failing,
    IteratorState,
    NowAndThen,
    Plain,
    SelfIterating,
    ids,
    share,
)

KINDS = [Plain, IteratorState, DatasetState, SelfIterating]
SETUPS = {
    "main process": dict(num_workers=0),
    "2 workers": dict(num_workers=2, **FORK),
    "3 persistent workers, prefetch 3": dict(num_workers=3, persistent_workers=True, prefetch_factor=3, **FORK),
}
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # > 2 cores: meant


def make(kind, setup, n=23, random_draws=True, seed=1, **kw):
    """A loader whose workers' base seeds come from a generator of `seed`, as a job's restored RNG would give."""
    generator = torch.Generator().manual_seed(seed)
    return ResumableDataLoader(
        kind(n, random_draws), batch_size=3, collate_fn=list, generator=generator, **SETUPS[setup], **kw
    )


def assert_each_once(n, delivered):
    counts = sorted(ids(delivered))
    assert counts == list(range(n)), f"skipped or repeated: {sorted(set(range(n)) ^ set(counts))}"


def stop_and_resume(kind, setup, stop, **kw):
    """`stop` batches from a first loader, its state through JSON, and a new loader resumed from it: what each
    delivered. In the main process the stream draws from the training's generators: they are restored as a
    checkpoint restores them."""
    first = make(kind, setup, **kw)
    it = iter(first)
    seen = [next(it) for _ in range(stop)]
    state, rng = json.loads(json.dumps(first.state_dict())), rng_state()
    del it
    resumed = make(kind, setup, **kw)
    resumed.load_state_dict(state)
    set_rng_state(rng)
    return seen, resumed


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_at_any_batch_continues_bit_identically(kind, setup):
    reference_loader = make(kind, setup)
    set_rng_state(rng := rng_state())
    reference = [list(reference_loader), list(reference_loader)]  # two passes: the epoch and the next one
    # a stream without state replays its pass where it is read; in the main process that draws the training's
    # random numbers again, so there only the records are the same, not their draws
    same = ids if (kind, setup) == (Plain, "main process") else list
    for stop in (0, 1, 4, len(reference[0])):
        set_rng_state(rng)
        seen, resumed = stop_and_resume(kind, setup, stop)
        rest = list(resumed)
        assert same(seen + rest) == same(reference[0]), f"stopped after {stop} batches"
        assert_each_once(23, seen + rest)
        assert same(list(resumed)) == same(reference[1]), f"the pass after, stopped after {stop} batches"


@pytest.mark.parametrize("setup", ["main process", "2 workers"])
@pytest.mark.parametrize("kind", [Plain, IteratorState])
def test_a_state_mid_update_resumes_at_the_last_completed_update(kind, setup):
    reference = list(make(kind, setup, grad_accum=2, random_draws=False))
    seen, resumed = stop_and_resume(kind, setup, 3, grad_accum=2, random_draws=False)
    assert resumed.state_dict()["batches"] == 2
    assert seen[:2] + list(resumed) == reference  # the half-accumulated update comes again


def test_another_num_workers_is_refused_naming_both_counts():
    dl = make(IteratorState, "2 workers")
    next(iter(dl))
    for setup, count in (("main process", 0), ("3 persistent workers, prefetch 3", 3)):
        other = make(IteratorState, setup)
        with pytest.raises(StateError, match=f"saved with num_workers=2, the loader has num_workers={count}"):
            other.load_state_dict(dl.state_dict())
        assert other.state_dict()["batches"] == 0  # unchanged


def test_a_state_of_the_earlier_release_is_refused():
    state = make(Plain, "main process").state_dict()
    del state["num_workers"]
    with pytest.raises(StateError, match="earlier release, which did not record num_workers"):
        make(Plain, "main process").load_state_dict(state)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_new_iter_in_the_middle_of_a_pass_continues_after_the_last_delivered_batch(setup):
    reference = list(make(IteratorState, setup, random_draws=False))
    dl = make(IteratorState, setup, random_draws=False)
    first = list(itertools.islice(dl, 5))  # workers prefetched beyond these
    with pytest.warns(ContinuedPassWarning):
        rest = list(dl)
    assert first + rest == reference


# -- a batch that fails to load, an interrupt -------------------------------------------------------------------------


def train_skipping_errors(loader, limit=None):
    delivered, errors = [], 0
    iterator = iter(loader)
    while limit is None or len(delivered) < limit:
        try:
            delivered.append(next(iterator))
        except StopIteration:
            break
        except ValueError:
            errors += 1
    return delivered, errors


@pytest.mark.parametrize("setup", SETUPS)
def test_a_failed_batch_is_consumed_and_a_resume_after_it_neither_skips_nor_repeats(setup):
    bad = {4, 11, 12}

    def loader():
        return ResumableDataLoader(Failing(30, bad), batch_size=3, collate_fn=list, **SETUPS[setup])

    reference, errors = train_skipping_errors(loader())
    lost = set(range(30)) - set(ids(reference))
    assert errors == 3 and bad <= lost and len(lost) <= 3 * len(bad) and len(ids(reference)) == 30 - len(lost)
    for stop in (1, 3):
        first = loader()
        before, _ = train_skipping_errors(first, limit=stop)
        resumed = loader()
        resumed.load_state_dict(first.state_dict())
        after, _ = train_skipping_errors(resumed)
        assert before + after == reference, f"stopped after {stop} delivered batches"


@pytest.mark.parametrize("kind", [Plain, IteratorState])
def test_an_interrupt_in_the_main_process_serves_the_batch_again(kind):
    class Interrupted(kind):
        armed = True

        def __iter__(self):
            for r in super().__iter__():
                if r == 7 and self.armed:
                    self.armed = False
                    raise KeyboardInterrupt
                yield r

    dl = ResumableDataLoader(Interrupted(20), batch_size=3, collate_fn=list)
    it = iter(dl)
    delivered = [next(it), next(it)]
    with pytest.raises(KeyboardInterrupt):
        next(it)
    with pytest.warns(ContinuedPassWarning):
        delivered += list(dl)
    assert delivered == list(ResumableDataLoader(kind(20), batch_size=3, collate_fn=list))


# -- StatefulDataLoader's protocol -------------------------------------------------------------------------------------


@pytest.mark.parametrize("setup", ["main process", "3 persistent workers, prefetch 3"])
def test_the_datasets_own_epoch_counter_survives_a_resume_at_the_epoch_boundary(setup):
    """DatasetState counts its epochs itself, where it lives on (the main process, persistent workers)."""
    live = make(DatasetState, setup, random_draws=False)
    first = list(live)
    end_of_pass = live.state_dict()
    second = list(live)
    assert {epoch for batch in first for _, epoch in batch} == {0}
    assert {epoch for batch in second for _, epoch in batch} == {1}
    resumed = make(DatasetState, setup, random_draws=False)
    list(itertools.islice(resumed, 2))  # the dataset object moves on before the state is loaded
    resumed.load_state_dict(end_of_pass)
    assert list(resumed) == second


def test_a_second_iter_before_any_batch_starts_the_pass_once_with_persistent_workers():
    reference = make(DatasetState, "3 persistent workers, prefetch 3", random_draws=False)
    passes = [list(reference), list(reference)]
    dl = make(DatasetState, "3 persistent workers, prefetch 3", random_draws=False)
    assert list(dl) == passes[0]
    iter(dl)  # the workers go on to the next pass, and prefetch
    assert list(dl) == passes[1]  # a new iter(): they start that pass again, from where the last one left them


def test_a_dataset_state_is_loaded_after_torch_draws_its_base_seed():
    """A dataset that keeps torch's generator in its state (StatefulDataLoader's own tests do): loaded before
    DataLoader.__iter__, the base seed torch draws from that generator would shift every draw after the resume."""

    class TorchRngInState(DatasetState):
        def state_dict(self):
            return {**super().state_dict(), "rng": torch.get_rng_state().tolist()}

        def load_state_dict(self, state):
            super().load_state_dict(state)
            torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))

    def torch_draws(batches):
        return [(r[0][0], r[0][1]) for batch in batches for r in batch]  # (id, torch draw) of (record, epoch)

    torch.manual_seed(0)
    reference = list(ResumableDataLoader(TorchRngInState(20, random_draws=True), batch_size=3, collate_fn=list))
    torch.manual_seed(0)
    first = ResumableDataLoader(TorchRngInState(20, random_draws=True), batch_size=3, collate_fn=list)
    seen = list(itertools.islice(first, 2))
    resumed = ResumableDataLoader(TorchRngInState(20, random_draws=True), batch_size=3, collate_fn=list)
    resumed.load_state_dict(first.state_dict())
    assert torch_draws(seen + list(resumed)) == torch_draws(reference)


def test_a_state_before_the_first_batch_rewinds_a_dataset_object_that_moved_on():
    dl = make(DatasetState, "main process", random_draws=False)
    it = iter(dl)
    state = dl.state_dict()
    expected = list(it)
    dl.load_state_dict(state)  # the dataset object stands at the end of the pass now
    assert list(dl) == expected


@pytest.mark.parametrize(
    "setup, saved, into",
    [
        ("main process", "before iter()", "the same loader"),
        ("main process", "before iter()", "a new loader"),
        ("main process", "after iter()", "a new loader"),
        ("2 workers", "before iter()", "the same loader"),
        ("2 workers", "after iter()", "a new loader"),
    ],
)
def test_a_state_before_the_first_batch_rewinds_a_dataset_object_that_keeps_its_place(setup, saved, into):
    """The state of a pass not begun (before iter(), or before its first next()) loaded into this process again, onto
    a dataset object that moved on meanwhile: the pass starts from its beginning, as StatefulDataLoader's does."""
    dataset = Continuing(20)
    dl = ResumableDataLoader(dataset, batch_size=3, collate_fn=list, **SETUPS[setup])
    it = iter(dl) if saved == "after iter()" else None
    state = json.loads(json.dumps(dl.state_dict()))
    list(itertools.islice(it or dl, 3))  # in the main process, the dataset object moves on
    target = (
        dl
        if into == "the same loader"
        else ResumableDataLoader(dataset, batch_size=3, collate_fn=list, **SETUPS[setup])
    )
    target.load_state_dict(state)
    assert_each_once(20, list(target))


def test_an_iterator_that_is_the_dataset_keeps_its_state_once():
    dl = make(SelfIterating, "2 workers")
    list(itertools.islice(dl, 3))
    for snapshot in dl.state_dict()["workers"]:
        assert snapshot["dataset"] is None and snapshot["iterator"] == {"i": snapshot["batches"] * 3}


@pytest.mark.parametrize("setup", ["main process", "2 workers"])
def test_a_state_does_not_change_as_the_loader_goes_on(setup):
    class LiveState(IteratorState):
        """Its iterator's state_dict returns one dict it keeps updating."""

        def __iter__(self):
            cursor, live = super().__iter__(), {}
            cursor.state_dict = lambda: live.update(i=cursor.i) or live
            return cursor

    dl = ResumableDataLoader(LiveState(20), batch_size=2, collate_fn=list, **SETUPS[setup])
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    frozen = copy.deepcopy(state)
    for _ in range(4):
        next(it)
    assert state == frozen and dl.state_dict() != frozen


@pytest.mark.parametrize("setup", ["main process", "2 workers"])
def test_editing_a_state_taken_changes_nothing_the_loader_holds(setup):
    """A state taken after k batches stays the loader's progress at k whatever is done to it afterwards: edited
    snapshots change neither the next state nor where a new iter() goes on (the loader once handed out the very
    snapshots it resumes from, so such an edit moved its workers, here past the rest of the pass)."""
    dl = make(IteratorState, setup)
    it = iter(dl)
    seen = [next(it) for _ in range(3)]  # with workers, taken between batches: each has prefetched more
    state = dl.state_dict()
    taken = copy.deepcopy(state)
    for snapshot in state["workers"]:
        snapshot.update(batches=0, ended=True, shard=[0, 0], check=0)
    assert dl.state_dict() == taken
    del it
    with pytest.warns(ContinuedPassWarning):  # a new iter() in the middle of the pass goes on after batch 3
        rest = list(dl)
    assert_each_once(23, seen + rest)


class CountingIter(IteratorState):
    """Counts its __iter__ calls in its own (per worker) copy, and reports the count in its state."""

    calls = 0

    def __iter__(self):
        self.calls += 1
        cursor, calls = super().__iter__(), self.calls
        cursor.state_dict = lambda: {"i": cursor.i, "calls": calls}
        return cursor


@pytest.mark.parametrize("setup", ["main process", "2 workers"])
def test_iter_is_called_once_per_worker_and_pass_also_after_a_resume(setup):
    dl = ResumableDataLoader(CountingIter(12), batch_size=2, collate_fn=list, **SETUPS[setup])
    it = iter(dl)
    for _ in range(SETUPS[setup]["num_workers"] + 1):
        next(it)
    state = dl.state_dict()
    assert [s["iterator"]["calls"] for s in state["workers"]] == [1] * max(1, SETUPS[setup]["num_workers"])
    resumed = ResumableDataLoader(CountingIter(12), batch_size=2, collate_fn=list, **SETUPS[setup])
    resumed.load_state_dict(state)
    it = iter(resumed)
    for _ in range(SETUPS[setup]["num_workers"] + 1):
        next(it)
    assert [s["iterator"]["calls"] for s in resumed.state_dict()["workers"]] == [1] * max(
        1, SETUPS[setup]["num_workers"]
    )


def test_worker_init_fn_sees_the_logical_worker_and_the_users_dataset_after_a_resume():
    def init(worker_id):
        info = get_worker_info()
        assert info.id == worker_id and isinstance(info.dataset, Plain)
        info.dataset.n = 15  # the documented idiom: configure this worker's copy

    kw = dict(batch_size=2, collate_fn=list, num_workers=3, worker_init_fn=init, **FORK)
    reference = list(ResumableDataLoader(Plain(100), **kw))
    assert_each_once(15, reference)
    first = ResumableDataLoader(Plain(100), **kw)
    seen = list(itertools.islice(first, 4))  # the next batch comes from worker 1: torch's worker 0 runs it now
    resumed = ResumableDataLoader(Plain(100), **kw)
    resumed.load_state_dict(first.state_dict())
    assert seen + list(resumed) == reference


def test_spawned_workers_resume_too():
    """What a spawned worker gets is pickled: the source, its plan and the worker_init_fn that reads it."""
    kw = dict(batch_size=2, collate_fn=list, num_workers=2)
    reference = list(ResumableDataLoader(IteratorState(10), **kw, **FORK))
    first = ResumableDataLoader(IteratorState(10), **kw, **FORK)
    seen = list(itertools.islice(first, 3))
    resumed = ResumableDataLoader(IteratorState(10), **kw, multiprocessing_context="spawn")
    resumed.load_state_dict(first.state_dict())
    assert seen + list(resumed) == reference


# -- epochs ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setup", ["main process", "2 workers"])
def test_the_set_epoch_loop_resumed_at_every_checkpoint_trains_each_epoch_once(setup):
    epochs = 3

    def run(state, crash_after):
        dl = make(IteratorState, setup, n=7, random_draws=False)
        if state is not None:
            dl.load_state_dict(state)
        trained, checkpoints = [], []
        for epoch in range(dl.epoch, epochs):
            dl.set_epoch(epoch)
            for batch in dl:
                trained.append((dl.epoch, batch))
                checkpoints.append(dl.state_dict())
                if len(trained) == crash_after:
                    return trained, checkpoints
        return trained, checkpoints

    reference, _ = run(None, None)
    assert [e for e, _ in reference] == [0] * 3 + [1] * 3 + [2] * 3
    for crash_after in range(1, len(reference)):
        trained, saved = run(None, crash_after)
        resumed, _ = run(saved[-1], None)
        assert trained + resumed == reference, f"crash after {crash_after} batches"


def test_set_epoch_of_the_epoch_whose_pass_ended_gives_an_empty_pass():
    dl = make(Plain, "main process", random_draws=False)
    list(dl)
    dl.set_epoch(0)
    assert list(dl) == [] and dl.epoch == 0
    assert len(ids(list(dl))) == 23 and dl.epoch == 1


def test_an_empty_pass_after_a_resume_at_the_end_of_an_epoch_keeps_the_restored_dataset_state():
    """The loop that restores its epoch counter, saved before its increment: set_epoch(e) after a resume at the end
    of epoch e gives an empty pass; the next pass starts from the dataset state of the checkpoint."""
    live = make(DatasetState, "main process", random_draws=False)
    list(live)
    state = live.state_dict()
    resumed = make(DatasetState, "main process", random_draws=False)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert list(resumed) == []
    assert {epoch for batch in resumed for _, epoch in batch} == {1}  # the dataset's own count, restored


def test_workers_without_records_and_a_stream_shorter_than_its_progress():
    dl = ResumableDataLoader(Plain(2), batch_size=1, collate_fn=list, num_workers=3, **FORK)
    first = list(itertools.islice(dl, 1))
    state = dl.state_dict()
    resumed = ResumableDataLoader(Plain(2), batch_size=1, collate_fn=list, num_workers=3, **FORK)
    resumed.load_state_dict(state)
    assert first + list(resumed) == [[0], [1]]
    shorter = ResumableDataLoader(Plain(1), batch_size=1, collate_fn=list, num_workers=3, **FORK)
    shorter.load_state_dict(dl.state_dict())  # the stream changed: worker 1's saved batch no longer exists
    assert list(shorter) == [] and shorter.exhausted


@pytest.mark.parametrize("in_place", [True, False])
def test_a_workers_random_state_is_sent_again_only_after_a_draw(monkeypatch, in_place):
    """numpy's and Python's generators are read in place where they are found (Python's after CPython's object
    header, 16 bytes on 64 bits; numpy's cached gaussian by a probe); where not (a wrong header, a failed probe
    here), their get_state() and getstate() tell. Either way, a changed state is the process's whole state."""
    if not in_place:
        monkeypatch.setattr(rng, "_HEADER", 8)
        monkeypatch.setattr(rng, "_numpy_gaussian", lambda generator: None)
    watch = RngWatch()
    assert (watch._python is rng._python_state, watch._numpy is rng._numpy_state) == (not in_place,) * 2
    first = watch.state()
    assert first == rng_state() and watch.state() == UNCHANGED
    gauss = lambda: random.gauss(0, 1)  # noqa: E731
    cached = lambda: np.random.set_state(np.random.get_state()[:3] + (1, 0.5))  # noqa: E731 - the words stay
    for draw in (
        lambda: torch.rand(1),
        np.random.rand,
        random.random,
        np.random.randn,
        np.random.randn,
        gauss,
        gauss,
        cached,
    ):
        draw()  # each second gaussian is a cached one: its generator's words do not change
        changed = watch.state()
        assert changed not in (UNCHANGED, first) and changed == rng_state() and watch.state() == UNCHANGED


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [2, 3])
def test_a_resume_after_any_batch_of_a_stream_that_draws_now_and_then_is_bit_identical(workers, persistent):
    """A worker sends its random state only when it changed since its previous batch: a state served stale (after
    a batch that drew nothing, or changed one generator only, or only used up a cached gaussian; in a persistent
    worker's next pass; in a worker restarted by a resume) would change the draws after the resume. Checkpoints
    after every batch of the first epoch and the first ones of the next."""

    def loader():
        return ResumableDataLoader(
            NowAndThen(8 * workers),
            batch_size=1,
            collate_fn=list,
            num_workers=workers,
            persistent_workers=persistent,
            generator=torch.Generator().manual_seed(5),
            **FORK,
        )

    live, states, reference = loader(), [], []
    for _ in range(2):
        for batch in live:
            reference.append(batch)
            states.append(json.loads(json.dumps(live.state_dict())))
    for stop in range(1, 8 * workers + workers + 3):
        resumed = loader()
        resumed.load_state_dict(states[stop - 1])
        rest = list(resumed) + (list(resumed) if stop <= 8 * workers else [])
        assert reference[:stop] + rest == reference, f"resumed after {stop} batches"


def test_random_state_round_trips():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    torch.rand(3), np.random.randn(), random.gauss(0, 1)  # a cached gaussian in random's state
    state = rng_state()
    before = (torch.rand(2).tolist(), np.random.randn(3).tolist(), random.gauss(0, 1), random.random())
    set_rng_state(state)
    assert (torch.rand(2).tolist(), np.random.randn(3).tolist(), random.gauss(0, 1), random.random()) == before


@pytest.mark.parametrize("workers", [dict(num_workers=0), dict(num_workers=2, persistent_workers=True, **FORK)])
def test_a_failed_batch_leaves_no_cycle_that_keeps_the_workers_alive(workers):
    """A loader whose batch failed is freed as soon as the loop that skipped the error lets go of it: a reference
    cycle through the error's traceback would keep it and its workers alive until the garbage collector ran (and
    workers forked meanwhile would inherit them: shutting those down then stalls for seconds)."""

    def a_loop_that_skips_a_bad_batch():
        dl = ResumableDataLoader(Failing(30, {1}), batch_size=3, collate_fn=list, **workers)
        assert train_skipping_errors(dl, limit=3)[1] == 1
        return weakref.ref(dl)

    gc.disable()
    try:
        assert a_loop_that_skips_a_bad_batch()() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("setup", ["main process", "3 persistent workers, prefetch 3"])
def test_a_stream_with_a_length_passes_torchs_length_check(setup):
    """torch warns when an iterator yields more than len(dataset) items (workers that all read everything): each
    worker's end comes as one more item from torch's iterator, which must not count."""

    class Sized(Plain):
        def __len__(self):
            return self.n

    dl = ResumableDataLoader(Sized(7), batch_size=None, **SETUPS[setup])
    assert len(dl) == 7
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Length of IterableDataset")
        for _ in range(2):  # persistent workers: the second pass resets torch's iterator
            assert sorted(dl) == list(range(7))


def test_a_stream_goes_through_save_checkpoint_and_resume(tmp_path):
    from loader.checkpoint.save import resume, save_checkpoint

    def objects():
        model = torch.nn.Linear(1, 1)
        loader = ResumableDataLoader(
            IteratorState(20, random_draws=True),
            batch_size=3,
            collate_fn=list,
            num_workers=2,
            generator=torch.Generator().manual_seed(4),
            **FORK,
        )
        return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=loader)

    reference = list(objects()["loader"])
    saved = objects()
    seen = list(itertools.islice(saved["loader"], 3))
    save_checkpoint(tmp_path, 3, **saved)
    restored = objects()
    assert resume(tmp_path, **restored) == 3
    assert seen + list(restored["loader"]) == reference


# -- records of any type -----------------------------------------------------------------------------------------------


class Arrays(Plain):
    """Bare NumPy arrays, which `==` compares element-wise: the loader must never compare a record by value."""

    def __iter__(self):
        worker, workers = share()
        for i in range(worker, self.n, workers):
            yield np.full(3, i)


@pytest.mark.parametrize("setup", ["main process", "2 workers"])
def test_a_stream_of_bare_numpy_arrays_gives_torchs_batches_and_resumes_exactly(setup):
    kw = dict(batch_size=2, **SETUPS[setup])
    reference = list(ResumableDataLoader(Arrays(11), **kw))
    torchs = list(torch.utils.data.DataLoader(Arrays(11), **kw))
    assert len(reference) == len(torchs) == 6
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(reference, torchs))
    first = ResumableDataLoader(Arrays(11), **kw)
    seen = list(itertools.islice(first, 3))
    resumed = ResumableDataLoader(Arrays(11), **kw)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    delivered = seen + list(resumed)
    assert len(delivered) == len(reference)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(delivered, reference))
    assert sorted(int(row[0]) for batch in delivered for row in batch) == list(range(11))


# -- DataPipes --------------------------------------------------------------------------------------------------------


def test_an_iterdatapipe_is_refused_at_construction_and_a_mapdatapipe_is_served_exactly_once():
    """torch shards a DataPipe graph per worker (`sharding_filter()`) and seeds its shuffles from a shared seed only
    when it iterates the DataPipe itself; the loader's workers iterate its own source, so 2 workers would each yield
    every sample. A MapDataPipe is a map-style dataset: the loader deals its indices."""
    from torch.utils.data.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.map import SequenceWrapper

    pipe = IterableWrapper(range(20)).shuffle().sharding_filter()
    with pytest.raises(ValueError, match="IterDataPipe.*would yield every sample once per worker.*map-style"):
        ResumableDataLoader(pipe, batch_size=2, num_workers=2, **FORK)
    dl = ResumableDataLoader(SequenceWrapper(range(20)), batch_size=2, shuffle=True, num_workers=2, **FORK)
    assert sorted(i for batch in dl for i in batch.tolist()) == list(range(20))


def test_a_sharded_stream_goes_through_save_checkpoint_and_resume(tmp_path):
    """The checkpoint validates the progress on a fresh keeper first, which has no source to deal shards to."""
    from loader.checkpoint.save import resume, save_checkpoint
    from loader.sources.sharded import FileShards

    paths = []
    for s in range(4):
        (tmp_path / f"{s}.txt").write_text("".join(f"{s}:{r}\n" for r in range(5)))
        paths.append(str(tmp_path / f"{s}.txt"))

    def objects():
        model = torch.nn.Linear(1, 1)
        loader = ResumableDataLoader(FileShards(paths, open), batch_size=3, collate_fn=list, shuffle=True, seed=2)
        return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=loader)

    saved = objects()
    seen = list(itertools.islice(saved["loader"], 3))
    save_checkpoint(tmp_path / "checkpoints", 3, **saved)
    restored = objects()
    assert resume(tmp_path / "checkpoints", **restored) == 3
    records = [r for batch in seen + list(restored["loader"]) for r in batch]
    assert sorted(records) == sorted(f"{s}:{r}\n" for s in range(4) for r in range(5))
