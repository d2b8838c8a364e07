"""The loader under torchft: exactly once while replica groups leave and join a running job.

Why: torchft (`pip install loader[torchft]`) keeps training when a replica group dies or joins, with a new quorum
at the next step and a joining group healed from a live peer; its own DistributedSampler takes a fixed number of
replica groups, so a group that is down leaves its share untrained. Here the Manager's committed step counter is the
progress: it advances only on a successful `should_commit`, and torchft transfers it to a healing group. Step s maps,
as a pure function, to a block of `global_batch` consecutive positions of an epoch's order (`StepDeal.block`), and
each step that block is dealt anew over the groups of the step's quorum and the ranks inside each group, with the
loader's own partition (a quorum change is a resume at another world size, of the one block). So a group that
leaves leaves nothing behind, a failed commit deals the same block again to the next quorum, a joining group starts
at the step, and every step trains the same samples as an uninterrupted run.

A replica group that is not participating in the step (healing under torchft's async quorum, a spare) gets the
batches of participant 0 so that its forward and backward run (torchft zeroes its gradients); they are not counted.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from loader.checkpoint.ledger import Ledger
from loader.checkpoint.save import check_dataset, dataset_fingerprint, plan_record, recorded_plan
from loader.core.checks import check_positive_int, check_rank
from loader.core.partition import EpochPlan, Layout, samples_of_updates, updates_of_samples
from loader.core.state import Progress, StateError, check_fingerprint, schedule_from, short
from loader.dataloader import MixtureChange, ResumableDataLoader, check_mixture, planned_change

if TYPE_CHECKING:
    from torch.utils.data import Dataset

FORMAT = "loader.torchft"
VERSION = 2  # 2: global_batch may be a schedule, and mixture_plan carries a Mixture's online changes
READS = (1, VERSION)
STATE_KEY = "loader"  # the key of the loader's state among the Manager's state_dict callbacks


# The functional form, where mypy takes a field named `index` (in the class form it refuses it, as tuple's own
# index() method): the same class.
Block = NamedTuple(  # noqa: UP014
    "Block", [("epoch", int), ("index", int), ("start", int), ("size", int), ("global_batch", int), ("last", bool)]
)
Block.__doc__ = """The positions [start, start + size) of the epoch's order that a step trains, the epoch's step
`index`, the step's `global_batch` (size is less for the epoch's short last step) and whether it is the epoch's
`last`."""


@dataclass(frozen=True)
class StepDeal:
    """The pure arithmetic: which positions a step trains, and how they are dealt over a quorum.

    An epoch of N samples is steps of G = `global_batch` positions, the last one short, as DataLoader's last batch;
    with `drop_last` that short one is dropped by policy. `global_batch` may be a batch-size ramp, (first step, G)
    pairs from step 0 as `BatchPolicy` takes them: step s then trains G(s) positions, an epoch's steps following
    on from the previous epoch's last (so epochs before the ramp's last change differ in steps, the later ones
    not), and every step still trains the same samples whatever the quorum."""

    num_samples: int
    global_batch: int | tuple[tuple[int, int], ...]
    micro_batch: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        for name in ("num_samples", "micro_batch"):
            check_positive_int(name, getattr(self, name))
        if isinstance(self.global_batch, (list, tuple)):
            object.__setattr__(self, "global_batch", schedule_from(self.global_batch, "global_batch"))
        else:
            check_positive_int("global_batch", self.global_batch)
        too_large = [(first, g) for first, g in self.schedule if g > self.num_samples]
        if self.drop_last and too_large:
            first, g = too_large[0]
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of {g}"
                f"{f' (from step {first})' if first else ''}, and drop_last=True drops them all: lower global_batch"
            )

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """The global batch by step, (first step, G) pairs: one pair for a constant global batch."""
        return self.global_batch if isinstance(self.global_batch, tuple) else ((0, self.global_batch),)

    def _steps_from(self, first: int) -> int:
        """The steps of an epoch whose first step is `first`: its full ones, and the short last one unless
        drop_last."""
        updates = updates_of_samples(self.schedule, first, self.num_samples)
        return updates - (self.drop_last and samples_of_updates(self.schedule, first, updates) > self.num_samples)

    @cached_property
    def _firsts(self) -> tuple[list[int], int]:
        """The first step of each epoch up to the first that starts at or after the ramp's last change, and the
        steps of that epoch, which every later one has too."""
        firsts = [0]
        while firsts[-1] < self.schedule[-1][0]:
            firsts.append(firsts[-1] + self._steps_from(firsts[-1]))
        return firsts, self._steps_from(firsts[-1])

    def first_step(self, epoch: int) -> int:
        """The step that starts `epoch`: `first_step(E)` steps train epochs 0 .. E - 1."""
        firsts, steps = self._firsts
        return firsts[epoch] if epoch < len(firsts) else firsts[-1] + (epoch - len(firsts) + 1) * steps

    @property
    def steps_per_epoch(self) -> int:
        """The steps of every epoch, for a constant global batch (a ramp's epochs differ: `first_step`)."""
        if len(self.schedule) > 1:
            raise ValueError("under a batch-size ramp the epochs differ in steps: use first_step(epoch)")
        return self._firsts[1]

    def block(self, step: int) -> Block:
        """The positions step `step` (the Manager's `current_step()`: steps committed before it) trains."""
        firsts, steps = self._firsts
        if step < firsts[-1]:
            epoch = bisect.bisect_right(firsts, step) - 1
        else:
            epoch = len(firsts) - 1 + (step - firsts[-1]) // steps
        first = self.first_step(epoch)
        index, global_batch = step - first, samples_of_updates(self.schedule, step, 1)
        start = samples_of_updates(self.schedule, first, index)
        size = min(global_batch, self.num_samples - start)
        return Block(epoch, index, start, size, global_batch, index + 1 == self._steps_from(first))

    def layout(self, block: Block, ranks: int) -> Layout:
        """One optimizer update over `ranks` data-parallel ranks: micro-batches of `micro_batch` samples at most
        (B + 1 where the block does not divide evenly, as the loader's tail rule has it), as many as the block needs
        at this size. A full block fewer than the ranks cannot give each one a sample: refused."""
        if block.size == block.global_batch and block.global_batch < ranks:
            raise ValueError(
                f"the quorum has {ranks} data-parallel ranks (replica groups x ranks per group), more "
                f"than the global batch of {block.global_batch} samples: every rank needs one. Raise "
                f"global_batch, or cap the replica groups (torchft's WorldSizeMode.FIXED_WITH_SPARES)"
            )
        accum = -(-block.global_batch // (ranks * self.micro_batch))
        return Layout(ranks, accum, self.micro_batch, False)

    def dropped(self, block: Block, ranks: int) -> tuple[int, int] | None:
        """Positions [a, b) of the block's epoch that no step deals, often none (a == b), recorded when the epoch's
        last step commits (None for another step): the drop_last tail, and an epoch's last block of fewer samples
        than the quorum's ranks (the README's rule: fewer samples than ranks are dropped by policy)."""
        if not block.last:
            return None
        return block.start + EpochPlan(block.size, self.layout(block, ranks)).served, self.num_samples

    def progress(self, fingerprint: dict, block: Block) -> dict:
        """The loader's progress that leaves exactly the block to deal: every other position of its epoch counted
        (and the steps before it, so that the workers' seeds differ from step to step)."""
        spans = [[a, b] for a, b in ((0, block.start), (block.start + block.size, self.num_samples)) if a < b]
        committed = {block.epoch: np.asarray(spans, dtype=np.int64).reshape(-1, 2)} if spans else {}
        return Progress(
            fingerprint, block.epoch, committed, done_in_epoch=block.index, samples_done_in_epoch=block.start
        ).to_dict()


def _private(manager: Any, name: str) -> Any:
    """What torchft 0.2 keeps private: the quorum's future (to tell the step's quorum from the last step's) and,
    once it is done, its id (which every replica group of it shares)."""
    try:
        return getattr(manager, name)
    except AttributeError:
        raise RuntimeError(
            "this torchft Manager has no _quorum_future/_quorum_id: loader.integrations.torchft "
            "supports torchft 0.2; report the torchft version"
        ) from None


class ManagedLoader:
    """A ResumableDataLoader whose progress is a torchft Manager's committed step. Each `iter()` is one step: this
    rank's micro-batches of the step's block, dealt after the step's quorum is known (call
    `optimizer.zero_grad()`, which starts it, first). `update_complete` is True after the last of them.

    `group_rank` and `group_size` are this process's place in its replica group (default: torchft's RANK and
    WORLD_SIZE). The loader registers its state with the Manager (key "loader"): a few hundred bytes that check a
    healing group deals the same data, since the step itself is the Manager's. Other arguments are
    ResumableDataLoader's (`batch_size` is the largest micro-batch)."""

    def __init__(
        self,
        manager: Any,  # a torchft Manager, which this module leaves the user's script to import
        dataset: Dataset[Any],
        *,
        global_batch: int,
        batch_size: int,
        group_rank: int | None = None,
        group_size: int | None = None,
        drop_last: bool = False,
        **loader_args: Any,
    ) -> None:
        for name in ("rank", "world_size", "grad_accum", "dp_mesh", "dp_group"):
            if name in loader_args:
                raise ValueError(f"{name}= is the quorum's to decide under torchft: give group_rank= and group_size=")
        self.group_size = int(os.environ["WORLD_SIZE"]) if group_size is None else group_size
        self.group_rank = int(os.environ["RANK"]) if group_rank is None else group_rank
        check_positive_int("group_size", self.group_size)
        check_rank(self.group_rank, self.group_size)
        self.manager = manager
        self.loader = ResumableDataLoader(
            dataset, batch_size=batch_size, drop_last=False, rank=0, world_size=1, **loader_args
        )
        if self.loader.resumable_sampler is None:
            raise TypeError(
                "ManagedLoader deals each step a block of a map-style dataset's positions, which an IterableDataset "
                f"({type(dataset).__name__}) does not have: give it a map-style dataset"
            )
        self._sampler = self.loader.resumable_sampler  # the loader's, for good
        self.deal = StepDeal(len(cast(Sized, dataset)), global_batch, batch_size, drop_last)
        mixture = callable(getattr(self.loader.dataset, "use_plan", None))
        self._built_plan = cast(Any, self.loader.dataset).plan if mixture else None  # a Mixture's, before any change
        self.ledger: Ledger | None = None  # Ledger.open_attempts(...): the batches of the steps that commit
        self.participating = False  # whether this rank's batches of the current step count
        self._dealt: tuple | None = None  # (quorum future, step, attempt key, block, ranks) of the last deal
        self._tries = (-1, -1, 0)  # (step, quorum id, attempts of that step in that quorum) of the last deal
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    # -- a step --------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator:
        future = _private(self.manager, "_quorum_future")
        if future is None or (self._dealt is not None and self._dealt[0] is future):
            raise RuntimeError(
                "iter() of a ManagedLoader deals one step over that step's quorum, which has not "
                "started: call optimizer.zero_grad() (torchft's OptimizerWrapper starts the quorum "
                "there; or manager.start_quorum()) before each step's iter()"
            )
        self.manager.wait_quorum()  # bounded by the Manager's quorum_timeout
        quorum_id = _private(self.manager, "_quorum_id")
        self._close_attempt()
        step, replicas = self.manager.current_step(), self.manager.num_participants()
        participant = self.manager.participating_rank()
        self.participating = self.manager.is_participating()
        if replicas < 1:
            raise RuntimeError(f"the quorum of step {step} has no participating replica group")
        if not self.participating and participant is not None:
            raise RuntimeError(
                f"replica group rank {self.group_rank} heals at step {step} while the quorum counts it as participant "
                f"{participant} of {replicas}: torchft zeroes its gradients, so its share of the step would never be "
                f"trained. This is torchft's init_sync at step 0 under the async quorum: build the Manager with "
                f"init_sync=False (seed the model alike in every group) or use_async_quorum=False"
            )
        ranks = replicas * self.group_size
        dp_rank = (participant if self.participating else 0) * self.group_size + self.group_rank
        block = self.deal.block(step)
        tries = self._tries[2] if self._tries[:2] == (step, quorum_id) else 0  # a step's tries are consecutive
        key, self._tries = (quorum_id, tries), (step, quorum_id, tries + 1)
        self.loader.load_state_dict(self.deal.progress(self._sampler.order.fingerprint(), block))
        self._sampler.relayout(self.deal.layout(block, ranks), dp_rank)
        self._dealt = future, step, key, block, ranks
        self.loader.ledger = self.ledger if self.participating else None  # a non-participant's batches never count
        if self.ledger is not None:
            self.ledger.begin_attempt(step, key)
        return iter(self.loader)

    def _close_attempt(self) -> None:
        """Record the verdict on the last step dealt here: committed when the Manager now stands right after it
        (by its own commit, or healed from a group that committed it: in that very attempt, or a later one, which
        the ledger's largest-key rule prefers), failed when it still stands at it, and nothing when a heal took it
        further (the other groups' verdicts decide). A healing group's verdict counts as much: its commit takes
        the participants' gradients."""
        if self._dealt is None or self.ledger is None:
            return
        _, step, key, block, ranks = self._dealt
        now = self.manager.current_step()
        if now > step + 1:
            return
        self.ledger.verdict(step, key, now == step + 1)
        dropped = self.deal.dropped(block, ranks) if now == step + 1 else None
        if dropped is not None:  # the epoch is finished: the audit judges it whole
            record = {"epoch": block.epoch, "dropped": list(dropped) if dropped[0] < dropped[1] else []}
            self.ledger.record_finished({"finished": [record]}, self.loader)

    def close(self) -> None:
        """After the last step's `optimizer.step()`: record its verdict, close the ledger."""
        self._close_attempt()
        self.loader.ledger = self._dealt = None
        if self.ledger is not None:
            self.ledger.close()

    @property
    def update_complete(self) -> bool:
        """True after this rank's last micro-batch of the step (the loader's own, see ResumableDataLoader)."""
        return self.loader.update_complete

    @property
    def epoch(self) -> int:
        """The epoch of the Manager's current step."""
        return self.deal.block(self.manager.current_step()).epoch

    def change_mixture(self, weights: Sequence[float]) -> MixtureChange | None:
        """Change a Mixture's weights from the training loop (`ResumableDataLoader.change_mixture` under torchft):
        call it on every rank of every replica group with the same weights (the controller's inputs all-reduced
        through the Manager) after `optimizer.step()` and before the next step's `zero_grad()`, which starts the
        quorum in which a healing group takes a peer's state. The change applies from the first whole window of the
        mixture at or after the next step's block (nothing is dealt past a step's block), the plan records it as
        asked at the Manager's step, and a request at a step the plan already recorded one at or after (the step
        again after a failed commit) is ignored: the recorded weights stand (returns None then). A healing group
        takes the peers' plan whole, whatever it asked itself. Returns where the change applies: its mixture
        position, and the step whose block first holds a sample under the new weights (None past this epoch)."""
        order = self._sampler.order
        check_mixture(self.loader.dataset, order)
        step = self.manager.current_step()
        block = self.deal.block(step)
        plan = planned_change(self.loader.dataset, weights, step, block.epoch, block.start, order.num_samples)
        if plan is None:
            return None
        cast(Any, self.loader.dataset).use_plan(plan)  # a Mixture's (check_mixture above)
        at = plan.requests[-1][1] * plan.window
        local = at - block.epoch * order.num_samples if plan.epochs_continue else at
        if local >= order.num_samples:
            return MixtureChange(at, None)
        first = self.deal.first_step(block.epoch)
        return MixtureChange(at, first + updates_of_samples(self.deal.schedule, first, local + 1) - 1)

    # -- the state torchft transfers -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """`step_state`, the dataset's own fingerprint (its files, a Mixture's sources and plan: the order's says only
        its length and seed) and a Mixture's plan once it changed online (`change_mixture`): a few hundred bytes."""
        state = step_state(self._sampler.order.fingerprint(), self.deal)
        return {**state, "dataset": dataset_fingerprint(self.loader), **plan_record(self.loader)}

    def load_state_dict(self, state: dict) -> None:
        """A peer's state (torchft's heal) or a checkpoint's: checked; the step is the Manager's. A Mixture takes
        the peer's plan: with its online changes, or the plan as built when the peer recorded none (changes this
        group asked for alone, e.g. at step 0 before it healed, never stand)."""
        check_step_state(state, self._sampler.order.fingerprint(), self.deal)
        plan = recorded_plan(state, self.loader, _WHERE, self._built_plan) or self._built_plan
        check_dataset(state.get("dataset"), self.loader, _WHERE, plan)  # absent before this release: not checked
        if plan is not None:
            cast(Any, self.loader.dataset).use_plan(plan)  # a Mixture's: a plan is recorded or built for one only


_WHERE = "the loader state (from torchft's heal or a checkpoint)"


def _plain(value: Any) -> Any:
    """A global batch as JSON holds it: an int, or a schedule as [[first step, G], ...] (tuples as lists)."""
    if isinstance(value, (list, tuple)):
        return [list(pair) if isinstance(pair, (list, tuple)) else pair for pair in value]
    return value


def step_state(fingerprint: dict, deal: StepDeal) -> dict:
    """What a healing group checks: the same data (fingerprint) in the same steps (global batch or its schedule,
    drop_last). The step itself is the Manager's own state, which torchft transfers with it."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint,
        "global_batch": _plain(deal.global_batch),
        "drop_last": deal.drop_last,
    }


def check_step_state(state: object, fingerprint: dict, deal: StepDeal) -> None:
    """Refuse, naming the field, a state that would deal other data or other steps than this replica group."""
    where = _WHERE
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise StateError(f"{where} is not a {FORMAT!r} state: got {short(state)}")
    if state.get("version") not in READS:
        raise StateError(f"{where}.version is {short(state.get('version'))}, this loader reads {list(READS)}")
    saved = state.get("fingerprint")
    if not isinstance(saved, dict):
        raise StateError(f"{where}.fingerprint must be a dict, got {short(saved)}")
    check_fingerprint(saved, fingerprint, where)
    for name, ours in (("global_batch", _plain(deal.global_batch)), ("drop_last", deal.drop_last)):
        theirs = _plain(state.get(name))
        if type(theirs) is not type(ours) or theirs != ours:
            raise StateError(
                f"{where}.{name} is {short(theirs)} but {ours!r} in this replica group: every group "
                f"must build its ManagedLoader with the same {name}, or the steps would train other "
                f"samples"
            )
