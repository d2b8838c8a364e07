"""A Mixture under shuffle=True orders itself (each loader epoch continues its stream), and its weights change
online, at an update boundary, from the training loop: every position once, every source a permutation per source
epoch, the changes recorded with the checkpoint and replayed as recorded."""

import json
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, SampleIndex, merge_states
from loader.core.state import StateError
from loader.sources import Mixture, MixturePlan

LENGTHS = (23, 9, 14)


def sources():
    """Sample = source * 1000 + index: a batch shows which source and index each position drew."""
    return [torch.utils.data.TensorDataset(torch.arange(n) + 1000 * s) for s, n in enumerate(LENGTHS)]


def permutations_per_source_epoch(samples_in_stream_order: list[int], lengths=LENGTHS) -> None:
    """Each source's samples (source * 1000 + index), in mixture-position order, cut into runs of its length: every
    whole run is a permutation of the source, the last (partial) run has no repeat."""
    by_source = defaultdict(list)
    for v in samples_in_stream_order:
        by_source[v // 1000].append(v % 1000)
    for s, drawn in by_source.items():
        n = lengths[s]
        for start in range(0, len(drawn), n):
            run = drawn[start : start + n]
            assert len(set(run)) == len(run) and (len(run) < n or sorted(run) == list(range(n))), (s, start)


def test_shuffle_true_leaves_the_order_to_the_mixture_and_each_epoch_continues_its_stream():
    """Loader position p of epoch e is mixture position e N + p: every epoch has windows (arrangements) of its own,
    each source's draws running on, so over three epochs each source is a permutation per source epoch (a shuffled
    loader order served epoch 1 the same samples as epoch 0, in another order)."""
    mix = Mixture(sources(), [0.5, 0.2, 0.3], 40, seed=5, window=10)
    dl = ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1, collate_fn=list)
    stream = []
    for epoch in range(3):
        dl.set_epoch(epoch)
        served = [(p, int(s[0])) for batch in dl for p, s in zip(dl.last_indices().tolist(), batch)]
        assert [p for p, _ in served] == list(range(40))  # the loader's order is the identity
        assert [v for _, v in served] == [int(mix[SampleIndex(p, epoch=epoch)][0]) for p in range(40)]
        stream += [v for _, v in served]
    assert stream[:40] != stream[40:80]  # another epoch, other samples (draws running on)
    permutations_per_source_epoch(stream)
    assert mix.plan.epochs_continue and MixturePlan.from_dict(mix.plan.to_dict()) == mix.plan
    assert mix.plan.to_dict()["version"] == 3  # a release that reads versions 1 and 2 refuses it


def test_a_state_of_a_shuffled_mixture_order_is_refused_naming_the_release():
    """A checkpoint of an earlier release's shuffle=True Mixture run holds positions of a shuffled order, which name
    other samples now: refused, never resumed under the new meaning. shuffle_blocks= and lanes= are refused under
    shuffle=True, and an online change under lanes= (whose loader positions are not mixture positions)."""
    mix = Mixture(sources(), [0.5, 0.2, 0.3], 40, seed=5, window=10)
    dl = ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1)
    state = dl.state_dict()
    earlier = {**state, "base": {**state["base"], "fingerprint": {**state["base"]["fingerprint"], "shuffle": "global"}}}
    with pytest.raises(StateError, match="leaves the order to a Mixture .* resume it with the release that saved it"):
        ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1).load_state_dict(earlier)
    with pytest.raises(StateError, match="saved by a loader with shuffle=True over a Mixture"):
        ResumableDataLoader(
            Mixture(sources(), [0.5, 0.2, 0.3], 40, seed=5, window=10), batch_size=4, shuffle=False, seed=1
        ).load_state_dict(state)
    for option in ({"shuffle_blocks": 10}, {"lanes": 2}):
        with pytest.raises(ValueError, match="leaves the order to a Mixture .* drop them"):
            ResumableDataLoader(mix, batch_size=4, shuffle=True, **option)
    laned = ResumableDataLoader(Mixture(sources(), [0.5, 0.2, 0.3], 40, seed=5, window=10), batch_size=4, lanes=2)
    with pytest.raises(ValueError, match="lanes= spread them over the epoch"):
        laned.change_mixture([1, 1, 1])


N, GLOBAL_BATCH, WINDOW = 120, 12, 10  # positions per epoch, samples per update (any world size), mixture window


class Run:
    """Simulated ranks, each with its own Mixture (as each process holds its own) and loader, in lockstep updates
    of GLOBAL_BATCH samples; what they train is recorded as (epoch, position, sample)."""

    def __init__(self, world, shuffle, workers=0, persistent=False, resumed=None):
        self.ranks = []
        for r in range(world):
            mix = Mixture(sources(), [0.5, 0.2, 0.3], N, seed=5, window=WINDOW)
            dl = ResumableDataLoader(
                mix,
                batch_size=1,
                shuffle=shuffle,
                seed=2,
                rank=r,
                world_size=world,
                grad_accum=GLOBAL_BATCH // world,
                num_workers=workers,
                collate_fn=list,
                persistent_workers=persistent,
                multiprocessing_context="fork" if workers else None,
            )
            if resumed is not None:  # what resume does: the checkpoint's plan, then its progress and step
                state, plan, step = resumed
                mix.use_plan(mix.recorded_plan(plan))
                dl.load_state_dict(state)
                dl.step = step
            self.ranks.append([dl, None])
        self.trained: list[tuple[int, int, int]] = []
        self.last_epoch = 1  # no pass of a later epoch starts

    @property
    def plan(self) -> MixturePlan:
        return self.ranks[0][0].dataset.plan

    def update(self, rank) -> bool:
        """One update's micro-batches of `rank`; False at the end of the epoch (its pass ended)."""
        dl, it = rank
        for _ in range(dl.grad_accum):
            batch = next(it, None) if it is not None else None
            if batch is None and (it is None or dl.update_complete):
                if it is not None and dl.epoch >= self.last_epoch:
                    return False
                rank[1] = it = iter(dl)  # the next pass
                batch = next(it, None)
            if batch is None:
                return False
            self.trained += [(dl.epoch, p, int(s[0])) for p, s in zip(dl.last_indices().tolist(), batch)]
            if dl.update_complete:
                return True
        return True

    def updates(self, count, controller=lambda step: None):
        """`count` lockstep updates; before each (after the one before), every rank asks for the controller's
        weights at the step it is at, if any."""
        changes = []
        for _ in range(count):
            weights = controller(self.ranks[0][0].step)
            if weights is not None:
                asked = {rank[0].change_mixture(weights) for rank in self.ranks}
                assert len(asked) == 1  # every rank finds the same change, without communication
                changes += asked
            for rank in self.ranks:
                self.update(rank)
        return changes

    def stop(self, extra=()):
        """Ranks take `extra[r]` more updates each (unequal consumption), then stop: the merged state, the plan
        the checkpoint records and the step, for the next Run."""
        for rank, more in zip(self.ranks, extra):
            for _ in range(more):
                self.update(rank)
        state = merge_states([dl.state_dict(check_lockstep=False) for dl, _ in self.ranks], uneven=True)
        step = self.ranks[0][0].step
        for dl, _ in self.ranks:
            dl.close()
        return state, self.plan.to_dict(), step


def check_exactly_once(trained, plan: MixturePlan, epochs: int) -> None:
    """Every position of every epoch trained once, each the sample the final plan names there (the past as it
    was trained), and each source's samples, in mixture-position order, a permutation per source epoch."""
    seen = sorted((e, p) for e, p, _ in trained)
    assert seen == [(e, p) for e in range(epochs) for p in range(N)]
    stream = sorted((int(plan.in_epoch([p], e)[0]), v) for e, p, v in trained)
    sources_, indices = plan.locate(np.array([p for p, _ in stream]))
    assert [v for _, v in stream] == (sources_ * 1000 + indices).tolist()
    distinct = dict(stream)  # under shuffle=False epoch 1 repeats epoch 0's positions and samples
    permutations_per_source_epoch([distinct[p] for p in sorted(distinct)])


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_online_changes_across_restarts_at_4_3_2_ranks_train_every_position_once(shuffle, workers):
    """Weights changed by the loop at the very first update boundary (a source at 0), while workers hold batches
    prefetched, and after the epoch's last update; restarts at 4 -> 3 -> 2 ranks after unequal consumption, the
    plan with its changes taken from the checkpoint; a request at a step already recorded (a replayed step, whose
    controller would now ask for other weights) changes nothing."""
    asked = {0: [0, 1, 1], 2: [2, 1, 0], 3: [1, 3, 1]}
    first = Run(4, shuffle, workers)
    changes = first.updates(3, asked.get)
    assert changes[0] == ((30, 3) if workers else (0, 1))  # 2 x 2 micro-batches prefetched: a window from 24
    assert {dl.change_mixture(asked[3]) for dl, _ in first.ranks} == {(60, 6) if workers else (40, 4)}
    state, plan, step = first.stop(extra=(0, 1, 0, 2))  # the checkpoint of step 3, with its request
    assert [s for s, _ in MixturePlan.from_dict(plan).requests] == [0, 2, 3]
    second = Run(3, shuffle, workers, resumed=(state, plan, step))
    assert all(dl.change_mixture([1, 1, 1]) is None for dl, _ in second.ranks)  # step 3 again: recorded stands
    assert second.plan == MixturePlan.from_dict(plan)
    second.updates(1)
    state, plan, step = second.stop(extra=(1, 0, 0))
    third = Run(2, shuffle, workers, persistent=bool(workers), resumed=(state, plan, step))
    while not all(dl.exhausted for dl, _ in third.ranks):
        third.updates(1)
    if shuffle:  # after the epoch's last update: from epoch 1's start (mixture positions from N on)
        assert {dl.change_mixture([1, 2, 3]) for dl, _ in third.ranks} == {(N, None)}
    else:
        with pytest.raises(ValueError, match="no whole window of this epoch is left to change"):
            third.ranks[0][0].change_mixture([1, 2, 3])
    step = third.ranks[0][0].step
    third.updates(N // GLOBAL_BATCH, {step + 1: [3, 0, 1]}.get if shuffle else lambda step: None)
    state, _, _ = third.stop()
    check_exactly_once(first.trained + second.trained + third.trained, third.plan, 2)
    assert len(third.plan.requests) == (5 if shuffle else 3)


def one_rank(mix, **options):
    model = torch.nn.Linear(1, 1)
    return dict(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=ResumableDataLoader(mix, batch_size=6, grad_accum=2, shuffle=True, collate_fn=list, **options),
    )


def test_the_checkpoint_carries_the_changes_and_the_audit_shows_each(tmp_path, capsys):
    """save_checkpoint records the plan with its online changes in the manifest (JSON, a few hundred bytes); a
    restart builds the Mixture as at the start, and load_checkpoint takes the recorded plan back (a Mixture of other
    weights is refused); the replayed steps train the recorded weights; the audit by source names each change."""
    from loader.checkpoint.ledger import Ledger
    from loader.checkpoint.publish import CheckpointError
    from loader.checkpoint.save import load_checkpoint, save_checkpoint
    from loader.cli.main import main as cli

    def fresh(weights=(0.5, 0.2, 0.3)):
        return Mixture(sources(), list(weights), N, seed=5, window=WINDOW, names=["web", "code", "math"])

    run = one_rank(fresh())
    dl, trained = run["loader"], []
    dl.ledger = Ledger.open(tmp_path, 0, N)
    it = iter(dl)
    for update in range(4):
        if update in (1, 2):
            dl.change_mixture([[1, 0, 1], [1, 1, 2]][update - 1])
        for _ in range(2):
            trained += [int(s[0]) for s in next(it)]
    path = save_checkpoint(tmp_path, **run)
    manifest = json.loads((path / "manifest.json").read_text())
    recorded = MixturePlan.from_dict(manifest["extra"]["mixture_plan"])
    assert recorded == dl.dataset.plan and recorded.requests == ((1, 2), (2, 3))
    assert len(json.dumps(manifest["extra"]["mixture_plan"])) < 1000
    with pytest.raises(CheckpointError, match="not this mixture's plan with changes added"):
        load_checkpoint(path, **one_rank(fresh([0.4, 0.3, 0.3])))
    resumed = one_rank(fresh())
    assert load_checkpoint(path, **resumed) == 4 and resumed["loader"].dataset.plan == recorded
    dl = resumed["loader"]
    dl.ledger = Ledger.open(tmp_path, 4, N)
    assert dl.change_mixture([0, 0, 1]) == (50, 5)  # step 4 was not asked before: a new request
    trained += [int(s[0]) for batch in dl for s in batch]
    dl.ledger.close()
    plan = dl.dataset.plan
    assert sorted(trained) == sorted(int(dl.dataset[p][0]) for p in range(N))
    plan.save(tmp_path / "mixture.json")
    assert cli(["audit", str(tmp_path), "--mixture", str(tmp_path / "mixture.json")]) == 0
    out = capsys.readouterr().out
    for step, window in plan.requests:
        assert f"weights changed online at step {step}: from position {window * WINDOW} (window {window}" in out


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_any_sequence_of_online_changes_and_restarts_trains_every_position_once(data):
    """The model counts every sample: random world sizes, changes (weights with zeros), unequal stops and
    restarts, under either shuffle; shuffle=False runs epoch 0 (a change with no window left in it is refused),
    shuffle=True two epochs."""
    shuffle = data.draw(st.booleans(), label="shuffle")
    worlds = data.draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3), label="worlds")
    weights = st.lists(st.integers(0, 3), min_size=3, max_size=3).filter(any)
    last_epoch, resumed, trained, run = int(shuffle), None, [], None

    def controller(step):
        return data.draw(st.none() | weights, label=f"weights at step {step}")

    for i, world in enumerate(worlds):
        run = Run(world, shuffle, resumed=resumed)
        run.last_epoch = last_epoch
        final = i == len(worlds) - 1
        count = 10**6 if final else data.draw(st.integers(0, 6), label="updates")
        for _ in range(count):
            dl = run.ranks[0][0]
            if dl.epoch == last_epoch and all(r.exhausted for r, _ in run.ranks):
                break
            try:
                run.updates(1, controller)
            except ValueError as err:  # every rank alike: shuffle=False, no whole window of the epoch left
                assert not shuffle and "no whole window of this epoch is left" in str(err)
                run.updates(1)
        extra = (
            ()
            if final
            else data.draw(st.lists(st.integers(0, 2), min_size=world, max_size=world), label="unequal stop")
        )
        resumed = run.stop(extra)
        trained += run.trained
    check_exactly_once(trained, run.plan, last_epoch + 1)


def _ask(rank, world, weights_by_rank):
    mix = Mixture(sources(), [0.5, 0.2, 0.3], N, seed=5, window=WINDOW)
    dl = ResumableDataLoader(mix, batch_size=2, shuffle=True, collate_fn=list)  # rank and world: the group's
    it = iter(dl)
    next(it)
    same = dl.change_mixture([1, 1, 1])
    next(it)  # the next update: a request of another step
    try:
        dl.change_mixture(weights_by_rank[rank])
    except ValueError as err:
        return same, str(err), mix.plan.requests
    return same, None, mix.plan.requests


@pytest.mark.slow
def test_ranks_that_ask_for_different_weights_are_refused_alike():
    """Under torch.distributed every rank's change is compared (one all_gather of the plan's digest): the same
    weights apply on every rank, different ones are refused on every rank, the plan left as it was."""
    from tests.distributed import run_group

    results = run_group(_ask, 2, {0: [1, 0, 1], 1: [1, 0, 2]})
    assert results[0][0] == results[1][0] == (10, 3)  # window 1, in the third update of 4 samples
    for _, error, requests in results:
        assert "the ranks asked for different weights" in error and requests == ((1, 1),)
