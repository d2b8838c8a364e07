"""Progress of a stream (IterableDataset) in the main process: per worker, the snapshot of the last batch delivered.

Batches arrive in torch's round robin over the workers, each with its worker's snapshot (see
`loader.streams.source`); the snapshot of a batch is kept when the batch is delivered (or fails to load: the stream
moved past it), and the snapshots as they stood after the last completed update are the state. A new torch iterator
(a resume, a new iter() in the middle of a pass, another epoch) starts every worker from its snapshot, and torch's
round robin at the worker after the one that delivered last. Persistent workers go on to the next pass as they are
when their pass ended cleanly.

A plain stream resumes at the same world size and number of workers; a sharded stream (`loader.streams.shards`) at any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

from loader.core.checks import is_int
from loader.core.sampler import warn_abandoned
from loader.core.state import StateError
from loader.streams.rng import UNCHANGED
from loader.streams.shards import ShardProgress, is_sharded, shard_digest
from loader.streams.source import Plan, StreamSource, check_loadable, is_stateful, standing
from loader.streams.state import (
    RNG,
    PassState,
    RankStream,
    Shards,
    check_identity,
    check_payloads,
    rank_streams,
    regathered,
    snapshot_dict,
    snapshot_of,
    stream_identity,
)

_ENDED_ELSEWHERE = (0, True, None, None, (0, 0), None)  # a snapshot (see `loader.streams.state.BATCHES`)


class StreamProgress:
    def __init__(
        self,
        dataset: Any,
        world_size: int,
        rank: int,
        grad_accum: int,
        num_workers: int,
        persistent: bool,
        seed: int,
        shuffle: bool,
    ) -> None:
        self.dataset, self.world_size, self.rank, self.grad_accum = dataset, world_size, rank, grad_accum
        self.num_workers, self.persistent = num_workers, persistent and num_workers > 0
        self.workers = max(num_workers, 1)
        self.shards: Shards | None = None
        if is_sharded(dataset):
            names = list(dataset.shards())
            self.shards = Shards(len(names), shard_digest(names), seed, bool(shuffle), ShardProgress(len(names)))
        self.source: StreamSource | None = None
        self._pass_state: PassState | None = None  # a state's fields that stay while a pass runs; None: to build
        # again, after one of them changed (`_start`, `started`, `_rebase`, `place`)
        self._seen: list[tuple | None] = [None] * self.workers  # per worker, the snapshot last serialised and its
        self._checks: list[int | None] = [None] * self.workers  # check (see `_serialised`)
        self._pass_id, self._rotation = 0, 0
        self._reusable = False  # persistent workers ended their pass cleanly, unrotated: they may go on as they are
        self._origins_live = False  # the main process's dataset stands at the origin (it ran the pass that ended)
        self._running = False  # a torch iterator runs the current pass (an empty pass after set_epoch() has none)
        self._unread = True  # no pass of this loader read the dataset, and no state was loaded: see `_standing_origin`
        self._start(0, (None,) * self.workers)

    def attach(
        self,
        batch_size: int | None,
        drop_last: bool,
        collate_fn: Callable,
        worker_init_fn: Callable | None,
        keep: Callable[[None, Any], bool] | None = None,
    ) -> StreamSource:
        """The dataset torch iterates: this stream's batches, made where it is read, each with its worker's state;
        of the records `keep(None, record)` keeps, if given."""
        deal = None if self.shards is None else self.shards.deal(self.world_size, self.workers)
        self.source = StreamSource(
            self.dataset, batch_size, drop_last, collate_fn, self.num_workers, worker_init_fn, self.rank, deal, keep
        )
        return self.source

    def _start(
        self,
        epoch: int,
        origins: tuple,
        *,
        delivered: int = 0,
        latest: Sequence[tuple | None] | None = None,
        next_worker: int = 0,
        base_seed: int | None = None,
        exhausted: bool = False,
        ended: bool = False,
    ) -> None:
        self.epoch, self.delivered, self.exhausted, self.ended = epoch, delivered, exhausted, ended
        self.origins, self.base_seed, self.next_worker = origins, base_seed, next_worker
        self._pass_state = None
        self.latest = list(latest or (None,) * self.workers)
        self._pass_id, self._running = self._pass_id + 1, False
        self._commit()

    def _commit(self) -> None:
        self._committed = (self.delivered, tuple(self.latest), self.next_worker)

    def place(self, world_size: int, rank: int) -> None:
        """The rank this stream is read as, resolved at the first iter() (nothing was delivered before): a sharded
        stream's shards are dealt to it again (dealt at another world size, every rank read all of them)."""
        self.world_size, self.rank, self._pass_state = world_size, rank, None
        if self.source is not None:
            self.source.rank = rank
            if self.shards is not None:
                self._rebase(self.shards)

    @cached_property
    def identity(self) -> dict:
        """The stream's identity, read once, when a state is first saved or loaded (see `stream_identity`)."""
        return stream_identity(self.dataset)

    @property
    def finished(self) -> bool:
        return self.exhausted

    @property
    def delivered_any(self) -> bool:
        """A batch was delivered in this loader's life so far (rank and world size can no longer change)."""
        return self.delivered > 0 or self.epoch > 0

    # -- passes ----------------------------------------------------------------------------------------------------

    def _advance(self) -> None:
        """The next epoch, as the live loader goes on to it: worker states carry over where the dataset objects
        live on (the main process, persistent workers); other workers start from fresh copies."""
        carried = self.num_workers == 0 or self.persistent
        self._start(self.epoch + 1, tuple(self.latest) if carried else (None,) * self.workers)

    def begin_pass(self, workers_standing: bool) -> Plan | None:
        """At iter(): the plan every worker of a new torch iterator starts from; None when the persistent workers
        go on to the next pass as they are (`workers_standing`: none of them died). New workers in their place start
        from the snapshots the pass's end left, as a resume from there would."""
        if self.ended:
            self._advance()
        if self._reusable and not self.delivered and workers_standing:
            return None
        origins = (None,) * self.workers if self._origins_live and not self.num_workers else self.origins
        return Plan(self._pass_id, self.epoch, self.base_seed, self.next_worker, tuple(zip(origins, self.latest)))

    def started(self, torch_iterator: Any, plan: Plan | None) -> None:
        """A torch iterator was made (or persistent workers reset) for the plan: note torch's base seed where the
        workers took it, and, in the main process, the stream's state before its first batch."""
        self._reusable = self._origins_live = self._unread = False  # the workers (the dataset) move on from the
        self._running = True  # pass's start now
        if plan is None:
            return
        self._rotation = plan.rotation
        if self.num_workers and plan.base_seed is None:
            self.base_seed, self._pass_state = torch_iterator._base_seed, None
        assert self.source is not None, "attach() made the dataset that torch iterates"
        if not self.num_workers and self.latest[0] is None and self.source._live is not None:
            self.latest[0] = self.source._live.snapshot(ended=False)
            if not self.delivered:
                self._commit()

    def receive(self, worker: int, snapshot: tuple) -> None:
        """A worker's snapshot came in (with a batch to deliver or fail, or its end): it stands there now. Its random
        state is sent only when it changed since the worker's previous snapshot, which came in just before."""
        if snapshot[RNG] == UNCHANGED:
            previous = self.latest[worker]
            assert previous is not None, "sent only after the worker's previous snapshot, which came in before"
            snapshot = snapshot[:RNG] + (previous[RNG],)
        self.latest[worker] = snapshot
        self.next_worker = (worker + 1) % self.workers

    def deliver(self) -> None:
        self.delivered += 1
        if self.delivered % self.grad_accum == 0:
            self._commit()

    def end_pass(self) -> None:
        self.exhausted = self.ended = True
        if self._running:  # its workers (the main process's dataset) ended the pass, and stand at its end
            self._reusable, self._origins_live = self.persistent and self._rotation == 0, True
        self._commit()

    @property
    def settled(self) -> bool:
        """Every snapshot received is in the committed state (none came in after the last commit)."""
        return all(a is b for a, b in zip(self._committed[1], self.latest))

    @property
    def completed(self) -> int:
        return self._committed[0]

    def set_epoch(self, epoch: int) -> bool:
        """The current epoch: what is left of it (nothing after its end was handed out). The next one after an
        exhausted pass: the natural advance. Any other: that epoch from its start. Returns whether anything changed."""
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch == self.epoch:
            changed, self.ended = self.ended, False
            return changed
        if epoch == self.epoch + 1 and self.exhausted:
            self._advance()
        else:
            if self.delivered and not self.exhausted:
                warn_abandoned(
                    epoch,
                    self.epoch,
                    f"rank {self.rank}'s stream was not read to its end (after "
                    f"{self.delivered} batch(es)): its rest is not delivered",
                )
            self._reusable = self._origins_live = False
            if self.shards is not None:
                self._rebase(self.shards.from_epoch(epoch))
            self._start(epoch, (None,) * self.workers)
        return True

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        delivered, latest, next_worker = self._committed
        passing = self._pass_state or self._new_pass_state()
        return passing.state(delivered, self.exhausted, self.ended, next_worker, self._serialised(latest))

    def _new_pass_state(self) -> PassState:
        """The state's fields that stay while the pass runs, kept until one of them changes; not while the pass's
        origin is the dataset as it stands (see `_standing_origin`), which can move before the pass."""
        standing_now = self._standing_origin()
        origins = (standing(self.dataset),) if standing_now else self.origins
        passing = PassState(
            self.world_size,
            self.rank,
            self.epoch,
            self.num_workers,
            self.base_seed,
            [None if o is None else snapshot_dict(o) for o in origins],
            self.shards,
            self.identity,
        )
        if not standing_now:
            self._pass_state = passing
        return passing

    def _serialised(self, snapshots: Sequence[tuple | None]) -> list:
        """The snapshots as a state holds them, new dicts. Each one's check is computed once: a worker that
        delivered nothing since the last state keeps its snapshot, and its check."""
        seen, checks = self._seen, self._checks
        serialised: list[dict | None] = []
        for worker, snapshot in enumerate(snapshots):
            if snapshot is None:
                serialised.append(None)
            elif snapshot is seen[worker]:
                serialised.append(snapshot_dict(snapshot, checks[worker]))
            else:
                value = snapshot_dict(snapshot)
                seen[worker], checks[worker] = snapshot, value["check"]
                serialised.append(value)
        return serialised

    def _standing_origin(self) -> bool:
        """Whether a state's origin is the dataset as it stands now: before the loader's first pass at
        num_workers=0, the pass begins where the main process's dataset stands, so that a resume rewinds the object
        if it moved on since (as StatefulDataLoader's does). Not after a pass left it part way (set_epoch() to
        another epoch): its state then says where that pass stood, which the next pass does not resume; nor with
        workers, each of which starts from a copy of the main process's dataset, which the loader never moves."""
        return self._unread and not self.num_workers and self.shards is None and self.origins[0] is None

    def check(self, state: Any) -> None:
        """Validate `state` in full, as load_state_dict does, changing nothing: on a fresh keeper of this
        configuration (restoring touches only the keeper; the dataset's own state is loaded in its workers)."""
        seed, shuffle = (self.shards.seed, self.shards.shuffle) if self.shards is not None else (0, False)
        fresh = StreamProgress(
            self.dataset, self.world_size, self.rank, self.grad_accum, self.num_workers, self.persistent, seed, shuffle
        )
        fresh.attach(None, False, list, None)  # a source of its own, which a sharded stream's state is dealt to
        # (never iterated: its collate_fn is never called)
        fresh.load_state_dict(state)

    def load_state_dict(self, state: Any) -> None:
        ranks = rank_streams(state)
        for r in ranks:
            check_identity(r.stream, self.identity, r.rank)
        check_payloads(ranks, self.dataset, is_stateful(self.dataset))
        saved = ranks[0]
        if (saved.shards is None) != (self.shards is None):
            raise StateError(
                f"this state was saved for a {'plain' if saved.shards is None else 'sharded'} stream, but "
                f"{type(self.dataset).__name__} is {'sharded' if saved.shards is None else 'not sharded'}: "
                f"construct the loader with the dataset that saved it"
            )
        if self.shards is not None:
            assert saved.shards is not None, "both sharded (checked above)"
            self._check_same_shards(saved.shards)
            if (saved.world_size, saved.num_workers) != (self.world_size, self.num_workers):
                return self._redeal(ranks)
        self._check_layout(saved)
        check_loadable(self.dataset, ranks[self.rank])
        self._restore(ranks[self.rank])

    def _check_layout(self, saved: RankStream) -> None:
        if saved.world_size != self.world_size:
            raise StateError(
                f"this IterableDataset progress was saved at world_size {saved.world_size}, the loader runs at "
                f"{self.world_size}: an IterableDataset has no random access, so its progress cannot be "
                f"repartitioned. Restart at world_size {saved.world_size}, or make the stream sharded "
                f"(loader.ShardedStream) or map-style to change the world size"
            )
        if saved.num_workers != self.num_workers:
            raise StateError(
                f"this IterableDataset progress was saved with num_workers={saved.num_workers}, the loader has "
                f"num_workers={self.num_workers}: each worker's stream resumes in its own worker, so the count must "
                f"stay. Construct the loader with num_workers={saved.num_workers}, or make the stream sharded "
                f"(loader.ShardedStream) to change it"
            )

    def _check_same_shards(self, saved: Shards) -> None:
        ours = self.shards
        assert ours is not None, "compared for a sharded stream only"
        for name, theirs, mine, hint in (
            ("count", saved.count, ours.count, "the stream lists another number of shards"),
            ("digest", saved.digest, ours.digest, "the stream lists other shards, or in another order"),
            ("seed", saved.seed, ours.seed, f"construct the loader with seed={saved.seed}"),
            ("shuffle", saved.shuffle, ours.shuffle, f"construct the loader with shuffle={saved.shuffle}"),
        ):
            if theirs != mine:
                raise StateError(
                    f"state.shards.{name} is {theirs!r} in the saved state but {mine!r} in this loader: {hint}"
                )

    def _restore(self, mine: RankStream) -> None:
        if self.shards is not None:
            assert mine.shards is not None, "both sharded (checked in load_state_dict)"
            self._rebase(mine.shards)
        self._reusable = self._origins_live = self._unread = False
        self._start(
            mine.epoch,
            tuple(map(snapshot_of, mine.origins)),
            delivered=mine.batches,
            latest=list(map(snapshot_of, mine.workers)),
            next_worker=mine.next_worker,
            base_seed=mine.base_seed,
            exhausted=mine.exhausted,
            ended=mine.ended,
        )

    def _redeal(self, ranks: list[RankStream]) -> None:
        """Another world size or number of workers: deal every rank's unfinished shards again, from their records."""
        progress, epoch, over = regathered(ranks)
        assert self.shards is not None, "dealt again for a sharded stream only"
        self._rebase(Shards(self.shards.count, self.shards.digest, self.shards.seed, self.shards.shuffle, progress))
        self._reusable = self._origins_live = self._unread = False
        consumed = epoch < progress.epoch  # every record of the epoch read: the pass ends without a batch
        ends = (_ENDED_ELSEWHERE,) * self.workers if consumed else None
        self._start(epoch, (None,) * self.workers, latest=ends, exhausted=consumed, ended=over)

    def _rebase(self, shards: Shards) -> None:
        self.shards, self._pass_state = shards, None
        assert self.source is not None, "attach() made the source the shards are dealt to"
        self.source.deal = shards.deal(self.world_size, self.workers)
