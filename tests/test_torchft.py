"""The loader under torchft: each step's block dealt over the quorum of that step, exactly once across any sequence
of quorum changes and failed commits. First the pure deal (the production composition, StepDeal and the loader's
sampler, without a Manager), the ledger's rule and the state torchft transfers, then real processes: a lighthouse
and replica groups on gloo running examples/train_torchft.py, one SIGKILLed mid-epoch and restarted, one added
later; and two Managers whose fetches out of order are refused."""

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import multiprocessing as mp

from loader.core.order import Order
from loader.core.sampler import ResumableSampler
from loader.core.state import StateError

torchft = pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[torchft]' (CI does)")

from loader.integrations.torchft import StepDeal, check_step_state, step_state  # noqa: E402


def dealt(deal: StepDeal, order: Order, step: int, replicas: int, group_size: int) -> list[list[list[int]]]:
    """Each data-parallel rank's micro-batches of `step` under a quorum of `replicas` groups, as ManagedLoader
    deals them: the loader's sampler, loaded with the step's progress and laid out for the quorum."""
    block = deal.block(step)
    layout = deal.layout(block, replicas * group_size)
    out = []
    for dp_rank in range(replicas * group_size):
        sampler = ResumableSampler(order, layout, 0 if layout.world_size == 1 else dp_rank)
        sampler.load_state_dict(deal.progress(order.fingerprint(), block))
        sampler.relayout(layout, dp_rank)
        out.append([list(batch) for batch in sampler])
    return out


def run(deal: StepDeal, order: Order, events: list[tuple[int, bool]], group_size: int) -> dict[int, tuple]:
    """(samples, data-parallel ranks) of each committed step, for a sequence of (replica groups in the quorum,
    commit succeeded)."""
    step, committed = 0, {}
    for replicas, ok in events:
        samples = [i for rank in dealt(deal, order, step, replicas, group_size) for batch in rank for i in batch]
        counts = Counter(len(rank) for rank in dealt(deal, order, step, replicas, group_size))
        assert len(counts) == 1, f"ranks got unequal numbers of micro-batches: {counts}"
        if ok:
            committed[step] = samples, replicas * group_size
            step += 1
    return committed


def ramp(stretches: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(steps, G) stretches as a global batch schedule from step 0 (the last stretch runs on)."""
    firsts = [0, *itertools.accumulate(steps for steps, _ in stretches[:-1])]
    return [(first, g) for first, (_, g) in zip(firsts, stretches)]


ramps = st.lists(st.tuples(st.integers(1, 4), st.integers(4, 12)), min_size=1, max_size=3).map(ramp)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(5, 60),
    global_batch=st.integers(4, 12) | ramps,
    micro=st.integers(1, 4),
    group_size=st.integers(1, 2),
    drop_last=st.booleans(),
    events=st.lists(st.tuples(st.integers(1, 2), st.booleans()), min_size=1, max_size=40),
)
def test_every_sample_once_and_every_step_as_uninterrupted_across_quorum_changes_and_failed_commits(
    n, global_batch, micro, group_size, drop_last, events
):
    """A constant global batch or a ramp (G(s) positions at step s, epochs of differing steps before its last
    change): each committed step the uninterrupted run's samples, each finished epoch every sample once."""
    largest = max(g for _, g in global_batch) if isinstance(global_batch, list) else global_batch
    deal = StepDeal(n, global_batch, micro, drop_last) if drop_last <= (n >= largest) else None
    if deal is None:
        with pytest.raises(ValueError, match="drops them all"):
            StepDeal(n, global_batch, micro, drop_last)
        return
    order = Order(n, 7, "global")
    steps = run(deal, order, events, group_size)
    uninterrupted = run(deal, order, [(1, True)] * len(steps), 1)
    for step, (samples, ranks) in steps.items():  # a failed commit's block dealt again, to the next quorum
        block = deal.block(step)  # an epoch's last block of fewer samples than ranks: dropped by policy (below)
        assert block.global_batch == dict(deal.schedule)[max(f for f, _ in deal.schedule if f <= step)]
        expected = [] if block.size < ranks else sorted(uninterrupted[step][0])
        assert sorted(samples) == expected, f"step {step}"
    epoch = 0
    while deal.first_step(epoch + 1) <= len(steps):  # each finished epoch: every sample once, or dropped by policy
        seen = [i for s in range(deal.first_step(epoch), deal.first_step(epoch + 1)) for i in steps[s][0]]
        last = deal.first_step(epoch + 1) - 1
        a, b = deal.dropped(deal.block(last), steps[last][1])
        positions = order.for_epoch(epoch)(np.arange(n))
        assert b == n and sorted(seen) == sorted(positions[:a].tolist())
        assert len(seen) == len(set(seen)) and set(positions[a:].tolist()) == set(range(n)) - set(seen)
        epoch += 1


def test_a_step_deals_its_block_near_evenly_over_the_quorum():
    deal, order = StepDeal(100, 12, 2), Order(100, 0, "none")
    assert deal.steps_per_epoch == 9 and deal.block(9) == (1, 0, 0, 12, 12, False)
    assert deal.block(8) == (0, 8, 96, 4, 12, True)
    sizes = [[len(b) for b in rank] for rank in dealt(deal, order, 0, 5, 1)]  # 12 over 5 ranks: 3, 3, 2, 2, 2
    assert sizes == [[3], [3], [2], [2], [2]]
    sizes = [[len(b) for b in rank] for rank in dealt(deal, order, 0, 3, 1)]  # 12 = 3 ranks x 2 micro x 2
    assert sizes == [[2, 2]] * 3
    assert [len(b) for rank in dealt(deal, order, 8, 5, 1) for b in rank] == []  # 4 left, 5 ranks: dropped
    assert deal.dropped(deal.block(8), 5) == (96, 100) and deal.dropped(deal.block(8), 2) == (100, 100)
    with pytest.raises(ValueError, match="more than the global batch"):
        deal.layout(deal.block(0), 13)


def test_the_transferred_state_is_small_plain_and_checked_field_by_field():
    deal, order = StepDeal(50, 8, 2), Order(50, 3, "global")
    state = json.loads(json.dumps(step_state(order.fingerprint(), deal)))
    assert len(json.dumps(state)) < 400
    check_step_state(state, order.fingerprint(), deal)
    for field, value, message in (
        ("global_batch", 16, "global_batch is 16"),
        ("drop_last", 1, "drop_last is 1"),
        ("version", 3, "version is 3"),
        ("format", "x", "not a 'loader.torchft'"),
    ):
        with pytest.raises(StateError, match=message):
            check_step_state({**state, field: value}, order.fingerprint(), deal)
    with pytest.raises(StateError, match="fingerprint.seed is 4"):
        check_step_state({**state, "fingerprint": {**state["fingerprint"], "seed": 4}}, order.fingerprint(), deal)
    with pytest.raises(StateError, match="global_batch is 8 but 16"):
        check_step_state(state, order.fingerprint(), StepDeal(50, 16, 2))


class ManagerSteps:
    """What ManagedLoader's state and `change_mixture` read of a torchft Manager: its committed step, and where the
    state callbacks register. No quorum: a step is dealt below as ManagedLoader's iter() deals it once the quorum is
    known (the production composition); the real Manager runs in the process tests further down."""

    def __init__(self):
        self.step, self.callbacks = 0, {}

    def current_step(self) -> int:
        return self.step

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        self.callbacks[key] = load_state_dict, state_dict


def test_online_mixture_changes_ride_in_the_transferred_state_under_a_ramp_and_a_replayed_request_is_ignored():
    """Group A changes a Mixture's weights at step 2 of a batch-size ramp; the step fails its commit and is asked
    again (ignored: the recorded weights stand). Group B, which asked for weights of its own at step 0, heals from
    A's state (as JSON: plain data) and takes A's plan whole; the two deal the rest of two epochs: every position
    once, each the sample the recorded plan names, each source a permutation per source epoch."""
    from loader.integrations.torchft import ManagedLoader
    from loader.sources import Mixture
    from tests.test_mixture_online import WINDOW, N, check_exactly_once, sources

    def group() -> tuple[ManagerSteps, ManagedLoader]:
        manager, mix = ManagerSteps(), Mixture(sources(), [0.5, 0.2, 0.3], N, seed=5, window=WINDOW)
        managed = ManagedLoader(
            manager, mix, global_batch=[(0, 12), (3, 24)], batch_size=2, group_rank=0, group_size=1, shuffle=True
        )
        managed.loader.collate_fn = list
        return manager, managed

    trained = []

    def deal(groups: list[ManagedLoader], step: int) -> None:
        block = groups[0].deal.block(step)
        for dp_rank, managed in enumerate(groups):  # each group's own mixture names the samples
            dl = managed.loader
            dl.load_state_dict(managed.deal.progress(dl.resumable_sampler.order.fingerprint(), block))
            dl.resumable_sampler.relayout(managed.deal.layout(block, len(groups)), dp_rank)
            for batch in dl:
                trained.extend((block.epoch, p, int(s[0])) for p, s in zip(dl.last_indices().tolist(), batch))

    (a_steps, a), (_, b) = group(), group()
    deal([a], 0)
    deal([a], 1)
    a_steps.step = 2  # steps 0 and 1 committed
    assert a.change_mixture([0, 1, 1]) == (30, 2)  # the first whole window at or after step 2's block (24)
    failed = len(trained)
    deal([a], 2)
    del trained[failed:]  # its commit failed: the step is dealt again
    assert a.change_mixture([1, 1, 1]) is None and a.loader.dataset.plan.requests == ((2, 3),)
    deal([a], 2)
    assert b.change_mixture([5, 1, 1]) == (0, 0)  # B's own, before it healed: never stands
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.loader.dataset.plan == a.loader.dataset.plan
    for step in range(3, a.deal.first_step(2)):
        deal([a, b], step)
    check_exactly_once(trained, a.loader.dataset.plan, 2)
    paused = [v for e, p, v in trained if e == 0 and p >= 30]
    assert paused and all(v // 1000 != 0 for v in paused)  # source 0 at weight 0 from position 30 on


def test_a_peer_without_online_changes_resets_a_group_that_asked_alone_and_a_plain_dataset_refuses_a_plan():
    from loader.integrations.torchft import ManagedLoader
    from loader.sources import Mixture
    from tests.test_mixture_online import WINDOW, N, sources

    def managed(dataset):
        return ManagedLoader(ManagerSteps(), dataset, global_batch=12, batch_size=2, group_rank=0, group_size=1)

    peer, alone = (managed(Mixture(sources(), [0.5, 0.2, 0.3], N, seed=5, window=WINDOW)) for _ in range(2))
    built = alone.loader.dataset.plan
    alone.change_mixture([1, 1, 1])
    state = peer.state_dict()
    assert "mixture_plan" not in state and state["version"] == 2
    alone.load_state_dict({**state, "version": 1})  # a state of the release before: no plan, the same steps
    assert alone.loader.dataset.plan == built
    peer.change_mixture([1, 1, 1])
    with pytest.raises(StateError, match="the run changed a Mixture's weights online, but this loader's dataset is"):
        managed(torch.utils.data.TensorDataset(torch.arange(N))).load_state_dict(peer.state_dict())


def test_a_peer_over_other_data_of_the_same_length_is_refused_and_a_state_without_the_datasets_fingerprint_read():
    """The order's fingerprint says only the length and seed: a group built over other sources or weights of the
    same length would take the peer's steps and train other samples. Each ManagedLoader state carries the
    dataset's own fingerprint; one written before it did (no "dataset") is read as it was."""
    from loader.integrations.torchft import ManagedLoader
    from loader.sources import Mixture
    from tests.test_mixture_online import WINDOW, N, sources

    def managed(weights):
        mix = Mixture(sources(), weights, N, seed=5, window=WINDOW)
        return ManagedLoader(ManagerSteps(), mix, global_batch=12, batch_size=2, group_rank=0, group_size=1)

    peer, other = managed([0.5, 0.2, 0.3]), managed([0.2, 0.5, 0.3])
    state = json.loads(json.dumps(peer.state_dict()))
    assert isinstance(state["dataset"], str)
    managed([0.5, 0.2, 0.3]).load_state_dict(state)  # the same data: taken
    with pytest.raises(StateError, match="Mixture's sources, weights or schedule changed"):
        other.load_state_dict(state)
    other.load_state_dict({k: v for k, v in state.items() if k != "dataset"})  # the earlier layout: not checked


class CountedStream(torch.utils.data.IterableDataset):
    """A stream with a length, which StepDeal would take as a number of positions."""

    def __iter__(self):
        return iter(range(8))

    def __len__(self) -> int:
        return 8


def test_a_stream_is_refused_where_the_managed_loader_is_built():
    """ManagedLoader deals positions of a map-style dataset: a stream was built, then failed at its first step or
    state with an AttributeError of the loader's missing sampler."""
    from loader.integrations.torchft import ManagedLoader

    with pytest.raises(TypeError, match=r"an IterableDataset \(CountedStream\) does not have: give it a map-style"):
        ManagedLoader(ManagerSteps(), CountedStream(), global_batch=4, batch_size=2, group_rank=0, group_size=1)


def test_a_step_counts_by_its_committed_attempt_with_the_largest_key(tmp_path):
    """The ledger of processes that never restart as a whole: a step trained by an attempt whose commit failed
    does not count, any process's verdict (a healing one's too) commits an attempt, and of two committed attempts
    of one step (a lineage lost after its commit) the later one counts."""
    from loader.checkpoint.ledger import Ledger, read_ledger

    a, b, c = (Ledger.open_attempts(tmp_path, 10, name) for name in "abc")
    a.begin_attempt(0, (1, 0))
    a.record(0, np.array([0, 1]), True)
    a.verdict(0, (1, 0), False)  # the commit failed: b died in the step, before any verdict
    b.begin_attempt(0, (1, 0))
    b.record(0, np.array([2, 3]), True)
    a.begin_attempt(0, (2, 0))  # the step again, in the next quorum
    a.record(0, np.array([0, 1, 2, 3]), True)
    a.verdict(0, (2, 0), True)
    a.begin_attempt(1, (2, 0))
    a.record(0, np.array([4, 5]), True)  # no verdict of a's own: c's, healing (no batches), commits it
    c.begin_attempt(1, (2, 0))
    c.verdict(1, (2, 0), True)
    a.begin_attempt(2, (2, 0))
    a.record(0, np.array([6, 7]), True)
    a.verdict(2, (2, 0), True)  # committed, then a's lineage was lost: c trains the step again, later
    c.begin_attempt(2, (3, 0))
    c.record(0, np.array([6, 7]), True)
    c.verdict(2, (3, 0), True)
    for ledger in (a, b, c):
        ledger.close()
    records, _, _ = read_ledger(tmp_path)
    assert sorted((r.step, r.generation, r.indices.tolist()) for r in records) == [
        (1, 1, [0, 1, 2, 3]),
        (2, 1, [4, 5]),
        (3, 3, [6, 7]),
    ]


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_torchft.py"
SAMPLES, MICRO_BATCH, SEED, GROUP_SIZE = 96, 2, 5, 2
RAMP = [(0, 8), (6, 16)]  # the global batch: epoch 0 is 6 steps of 8 samples and 3 of 16, epoch 1 is 6 of 16
WEIGHTS, CHANGED, CHANGE_AT = [1, 1], [1, 3], 4  # the Mixture's weights, and the controller's before Manager step 4


def _lighthouse(address_out) -> None:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=50, heartbeat_timeout_ms=1500
    )
    address_out.send(server.address())
    signal.pause()  # until the test kills it


def _forked(target, what: str, timeout: float):
    """A forked child (a clean parent: torchft's runtime starts in children only) and the first thing it sends
    through the pipe it is given, waited for at most `timeout`; the child is killed if it sends nothing."""
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(send,))
    child.start()
    if receive.poll(timeout):
        return child, receive.recv()
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=10)
    raise AssertionError(f"{what}: nothing after {timeout} s")


def _end(process) -> None:
    if process.is_alive():
        os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=10)


def _steps_done(run_dir: Path, group: int) -> int:
    path = run_dir / f"progress-{group}.txt"
    lines = path.read_text().split() if path.exists() else []
    return int(lines[-1]) if lines else 0


def read_logs(log_dir: Path) -> str:
    return "\n".join(
        f"--- {path.relative_to(log_dir)}\n{path.read_text()[-3000:]}" for path in sorted(log_dir.rglob("*.log"))
    )


@pytest.mark.slow
def test_replica_groups_killed_restarted_and_added_train_every_sample_once_in_the_uninterrupted_steps(tmp_path, capsys):
    """examples/train_torchft.py with a lighthouse and replica groups of 2 ranks on gloo (forked processes), on a
    Mixture of two sources under a batch-size ramp: groups 0 and 1 start; before Manager step 4 each asks for new
    weights; group 1 is SIGKILLed inside step 4 (which then fails its commit in group 0 and is dealt again to the
    next quorum, group 0 asking again: ignored) and restarted, asking for weights of its own at step 0, then healed
    from group 0 while group 0 goes on; group 2 joins later, in epoch 1. The ledger's audit: every sample of both
    epochs exactly once, each source's a permutation per source epoch, each committed step's samples the
    uninterrupted run's (the step's block of the ramp, under the recorded weights), and every group's plan the one
    group 0 recorded (the healed groups took it, never their own)."""
    from loader.checkpoint.audit import Grouping, audit
    from loader.checkpoint.ledger import read_generations, read_ledger
    from loader.cli.main import main as cli
    from loader.sources import MixturePlan
    from tests.distributed import free_port
    from tests.elastic import _rank_main
    from tests.test_mixture_online import permutations_per_source_epoch

    ctx = mp.get_context("fork")  # a clean parent: torchft's runtime starts in the children only
    deal, procs = StepDeal(SAMPLES, RAMP, MICRO_BATCH), []
    steps, restart_at, add_at = deal.first_step(2), 7, deal.first_step(1) + 2  # group 0 waits before these steps
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(group: int, *extra: str) -> None:
        """A replica group's processes; returns once each is up (its Manager made)."""
        port, before = free_port(), set(tmp_path.glob(f"up-{group}-*"))
        argv = [
            "--run-dir",
            str(tmp_path),
            "--lighthouse",
            lighthouse,
            "--group",
            str(group),
            "--store-port",
            str(port),
            "--samples",
            str(SAMPLES),
            "--ramp",
            ",".join(f"{step}:{g}" for step, g in RAMP),
            "--mixture",
            ",".join(map(str, WEIGHTS)),
            "--change-mixture",
            f"{CHANGE_AT}:{','.join(map(str, CHANGED))}",
            "--micro-batch",
            str(MICRO_BATCH),
            "--seed",
            str(SEED),
            "--ledger",
            "--timeout",
            "5",
            *extra,
        ]
        (logs / f"group{group}").mkdir(exist_ok=True)
        for rank in range(GROUP_SIZE):  # RANK and WORLD_SIZE: the place in the group (the example's own store)
            p = ctx.Process(
                target=_rank_main, args=(rank, GROUP_SIZE, port, argv, str(logs / f"group{group}"), EXAMPLE, True)
            )  # True: with the garbage collector, as a job
            p.start()
            procs.append((group, p))
        wait_until(lambda: len(set(tmp_path.glob(f"up-{group}-*")) - before) == GROUP_SIZE, f"group {group} up")

    def wait_until(condition, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            failed = [(g, p.exitcode) for g, p in procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
            assert not failed, f"{failed} failed while waiting for {what}: {read_logs(logs)}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s: {read_logs(logs)}"
            time.sleep(0.05)

    house, lighthouse = _forked(_lighthouse, "the lighthouse", 30)
    try:
        # group 0 waits before step 0 for group 1, before step 7 for the restarted group 1 and before step 11 for
        # group 2, so that it is still training when they join (the lighthouse waits for it meanwhile)
        start(0, *(f"--wait-before={step}:{tmp_path / f'go-{step}'}" for step in (0, restart_at, add_at)))
        start(1, "--fail-at-step", str(CHANGE_AT))  # its processes SIGKILL themselves in step 4, before the allreduce
        (tmp_path / "go-0").touch()
        first = [p for g, p in procs if g == 1]
        wait_until(lambda: any(p.exitcode == -signal.SIGKILL for p in first), "group 1 killed")
        for p in first:  # as torchrun's agent would: a rank died, the group goes (a peer may be in a collective)
            _end(p)
        done_before = _steps_done(tmp_path, 0)
        wait_until(lambda: _steps_done(tmp_path, 0) >= done_before + 2, "group 0 going on alone")
        start(1, "--change-mixture", "0:3,1")  # restarted, asks for its own weights, then heals from group 0
        (tmp_path / f"go-{restart_at}").touch()
        wait_until(lambda: _steps_done(tmp_path, 0) >= deal.first_step(1) + 1, "group 0 in epoch 1")
        start(2)  # a group added later
        (tmp_path / f"go-{add_at}").touch()
        wait_until(lambda: all(p.exitcode is not None for _, p in procs), "the end of training", timeout=120)
        assert all(p.exitcode in (0, -signal.SIGKILL) for _, p in procs), read_logs(logs)
    finally:
        for _, p in procs + [(None, house)]:
            _end(p)

    printed = (logs / "group0" / "rank-0.log").read_text()  # the example's own steps, a failed commit among them
    assert "[group 0] step 1: " in printed and "not committed: dealt again" in printed, printed
    assert "[group 0] mixture: weights [1.0, 3.0] from mixture position 32 (step 5)" in printed, printed
    assert "[group 0] mixture: step 5 again: the weights it recorded stand" in printed, printed
    restarted = (logs / "group1" / "rank-0.log").read_text()
    assert "[group 1] mixture: weights [3.0, 1.0] from mixture position 0 (step 1)" in restarted, restarted
    plan = MixturePlan.load(tmp_path / "mixture-group0.json")
    assert plan.requests == ((CHANGE_AT, 4),)  # asked at step 4, from window 4: position 32, step 4's block
    counts, _ = plan.window_table(np.arange(2 * SAMPLES // 8))
    assert counts.tolist() == [[4, 4]] * 4 + [[2, 6]] * 20  # windows of 8: 1/1, then 1/3 from the change on
    for group in (1, 2):  # healed from group 0: its plan, not their own (group 1 asked at step 0; 2 asked nothing)
        assert MixturePlan.load(tmp_path / f"mixture-group{group}.json") == plan, group
    report = audit(tmp_path, Grouping(plan.names, plan.source_of, plan.num_samples))
    assert [(e.epoch, e.finished, e.seen_once, len(e.skipped), len(e.duplicated)) for e in report] == [
        (0, True, SAMPLES, 0, 0),
        (1, True, SAMPLES, 0, 0),
    ], read_logs(logs)
    for e in report:  # a row per source, as `python -m loader audit RUN_DIR --mixture PLAN` prints it
        assert [(g.name, g.seen_once, g.skipped, g.duplicated) for g in e.groups] == [
            (name, int((plan.source_of(np.arange(SAMPLES), e.epoch) == s).sum()), 0, 0)
            for s, name in enumerate(plan.names)
        ]
    assert cli(["audit", str(tmp_path), "--mixture", str(tmp_path / "mixture-group0.json")]) == 0
    out = capsys.readouterr().out
    assert "weights changed online at step 4: from position 32 (window 4" in out, out
    generations, every = read_generations(tmp_path)
    first = min(g.number for g in generations if g.attempts == "group0-rank0")
    tried = Counter((r.step, r.counted) for r in every if r.generation == first)
    assert tried[(5, False)] and tried[(5, True)], (
        "group 0's step 4 failed its commit (group 1 died in it), then committed in the next quorum: counted once"
    )
    records, _, _ = read_ledger(tmp_path)
    by_step: dict[int, list[int]] = {}
    for record in records:
        by_step.setdefault(record.step - 1, []).extend(record.indices.tolist())
    order = Order(SAMPLES, SEED, "self")  # the loader's under shuffle=True: a Mixture orders itself
    assert sorted(by_step) == list(range(steps))
    for step, samples in by_step.items():  # each the ramp's block of the uninterrupted run: under the one plan
        block = deal.block(step)
        assert block.global_batch == (8 if step < 6 else 16)
        uninterrupted = order.for_epoch(block.epoch)(np.arange(block.start, block.start + block.size))
        assert sorted(samples) == sorted(uninterrupted.tolist()), f"step {step}"
    stream = sorted(int(plan.in_epoch([i], r.epoch)[0]) for r in records for i in r.indices.tolist())
    assert stream == list(range(2 * SAMPLES))  # every mixture position once, both epochs continuing the stream
    sources, indices = plan.locate(np.asarray(stream))
    assert sources.tolist().count(0) == 4 * 4 + 20 * 2  # source a: 4 of 8 per window, then 2
    permutations_per_source_epoch((sources * 1000 + indices).tolist(), plan.lengths)  # a: 48, b: 32 samples
    names = {g.number: g.attempts for g in generations}
    counted = Counter(names[r.generation] for r in records)  # the processes whose batches count, each incarnation's
    restarted = [n for n, name in sorted(names.items()) if name == "group1-rank0"][1]
    assert sorted(counted) == [
        "group0-rank0",
        "group0-rank1",
        "group1-rank0",
        "group1-rank1",
        "group2-rank0",
        "group2-rank1",
    ] and any(r.generation == restarted for r in records), counted


@pytest.mark.slow
def test_the_example_prints_its_own_steps_and_keeps_torchfts_info_lines_out(tmp_path):
    """examples/train_torchft.py as a user starts it (one group of one rank, its own process): the steps it prints,
    and none of the INFO lines torchft's runtime writes for every quorum and commit, nor its NCCL warning."""
    from tests.distributed import free_port

    house, lighthouse = _forked(_lighthouse, "the lighthouse", 30)
    try:
        environment = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
        done = subprocess.run(
            [
                sys.executable,
                str(EXAMPLE),
                "--run-dir",
                str(tmp_path),
                "--lighthouse",
                lighthouse,
                "--group",
                "0",
                "--store-port",
                str(free_port()),
                "--samples",
                "16",
                "--epochs",
                "1",
                "--timeout",
                "5",
            ],
            env={**environment, "RANK": "0", "WORLD_SIZE": "1", "PYTHONPATH": str(EXAMPLE.parents[1])},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        _end(house)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"[group 0] step {s}: 1 group(s) in the quorum, 8 samples on rank 0, its loss {loss}, committed"
        for s, loss in enumerate(re.findall(r"its loss (\d+\.\d{4}), committed", done.stdout), start=1)
    ]
    assert len(done.stdout.splitlines()) == 2 and done.stderr == "", done.stderr


def _fetches(out) -> None:
    """Two replica groups of one rank, as threads of this process, under torchft's defaults (async quorum,
    init_sync): what each one's fetches raise, in order, or "dealt N" for a fetch that was served."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from torchft._torchft import LighthouseServer
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from loader.integrations.torchft import ManagedLoader
    from tests.conftest import IndexDataset

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200)
    results, both = {}, threading.Barrier(2, timeout=30)  # neither goes away while the other heals from it

    def group(number: int) -> None:
        seen = results[number] = []
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(),
            min_replica_size=1,
            load_state_dict=lambda state: None,
            state_dict=lambda: {},
            replica_id=f"group{number}",
            store_addr="127.0.0.1",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse.address(),
            timeout=timedelta(seconds=10),
            quorum_timeout=timedelta(seconds=10),
        )
        dl = ManagedLoader(manager, IndexDataset(40), global_batch=8, batch_size=2, group_rank=0, group_size=1)
        try:
            for start in (False, True, False):  # a fetch before the first quorum, one after it, one more
                if start:
                    manager.start_quorum()
                try:
                    seen.append(f"dealt {sum(len(b) for b in dl)}")
                except RuntimeError as err:
                    seen.append(str(err))
                if start:
                    both.wait()
        finally:
            manager.shutdown(wait=False)

    threads = [threading.Thread(target=group, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    lighthouse.shutdown()
    out.send([results.get(n) for n in range(2)])
    os._exit(0)


@pytest.mark.slow
def test_a_fetch_without_the_steps_quorum_and_init_syncs_step_0_heal_are_refused():
    """A fetch before the step's quorum started (the first, or a second in one step) is refused, saying to call
    optimizer.zero_grad() first. Under torchft's defaults a rank that heals at step 0 (init_sync) is counted as a
    participant while its gradients are zeroed: its share would be lost, so that fetch is refused, with the fix."""
    child, seen = _forked(_fetches, "the two replica groups", 90)
    _end(child)
    assert all(s is not None and len(s) == 3 for s in seen), seen
    healthy, healing = sorted(seen, key=lambda s: s[1] != "dealt 4")  # 8 over 2 groups
    assert all("call optimizer.zero_grad()" in s[0] for s in seen), seen  # before the first quorum
    assert healthy[1] == "dealt 4" and "call optimizer.zero_grad()" in healthy[2], seen  # then twice in one step
    assert "heals at step 0" in healing[1] and "init_sync=False" in healing[1] and healing[2] == healing[1], seen


class Draws(torch.utils.data.Dataset):
    """A draw of the loading worker's own generator per sample, which the loader seeds."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index):
        return torch.rand(())


def test_each_rank_and_step_of_a_deal_seeds_its_workers_apart():
    """A step's deal sets the rank on the loader's sampler alone: the workers' seed follows it (and the step), as
    under any other layout, so two ranks' augmentations differ and a rank's differ from step to step."""
    from loader import ResumableDataLoader

    deal = StepDeal(32, 8, 2)

    def first_draw(step: int, dp_rank: int) -> float:
        dl = ResumableDataLoader(
            Draws(), batch_size=2, rank=0, world_size=1, num_workers=1, multiprocessing_context="fork"
        )
        block = deal.block(step)
        dl.load_state_dict(deal.progress(dl.resumable_sampler.order.fingerprint(), block))
        dl.resumable_sampler.relayout(deal.layout(block, 2), dp_rank)
        return next(iter(dl))[0].item()

    draws = {(step, rank): first_draw(step, rank) for step in (0, 1) for rank in (0, 1)}
    assert len(set(draws.values())) == 4, draws
    assert first_draw(1, 1) == draws[(1, 1)]  # and the same again for the same rank and step
