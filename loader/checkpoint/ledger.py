"""The identity ledger: each rank appends the dataset indices of every batch it delivers, labelled with the step.

Why: exactly-once is a claim about sample identities across crashes, restarts and world sizes; the ledger is the
evidence. Each launch of the job is a *generation* that starts from a checkpoint step. A record is labelled with
the optimizer step its batch feeds, so when a later generation resumes from step S, the records past S of the
earlier ones are the replayed steps and are discarded by the reader (`read_ledger`); nothing is rewritten in place.

Layout under RUN_DIR/ledger/: gen-NNNNNN/meta.json and gen-NNNNNN/rank-NNNNN.bin (one append-only file per rank),
dropped/epoch-NNNNNN.npy (indices dropped by policy when an epoch finished) and skipped/epoch-NNNNNN.npy (indices
skipped on request, `ResumableDataLoader.skip`, as the newest checkpoint's progress holds them).

An epoch's end is a record too (END), which the loader writes itself when a rank's share of an epoch is all handed
out, labelled with the step of the epoch's last update: so it is discarded like the batches when a later
generation replays that step, and every flow that iterates the loader (DCP, Lightning, Accelerate, a loop of one's
own) records it without a call of its own. Rank 0's carries the indices dropped by policy and skipped on request,
as the progress its state stands for holds them; an epoch is finished when every rank of one generation recorded
its end. `save_checkpoint` still writes dropped/ and skipped/ (skips are known between epochs' ends only there).
The members of a delivered batch that the loader's `filter=` dropped are a record of their own (FILTERED, a bit of
its own: 16 is END's), written before the batch's for the same step, so it counts exactly when the batch does.

Reading validates every file in one place (`read_run`): a file that cannot be read, or that contradicts the
others, raises a `LedgerError` naming the file and the field, never an IndexError or a MemoryError later.

Jobs that keep training through membership changes (torchft) never restart as a whole, so no generation supersedes
another: each process opens an *attempts* generation of its own (`Ledger.open_attempts`), and a step counts by the
vote of the processes that tried it. Each try of a step is an attempt with a key every process of it shares (the
quorum and the try's number in it); its records follow an ATTEMPT record and may be followed by a VERDICT (whether
the step committed). The records of a step that count are those of its committed attempt with the largest key:
none when every attempt failed its commit.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from torch.distributed import ProcessGroup

from loader.checkpoint.publish import fsync
from loader.core.checks import MAX_SAMPLES, is_int
from loader.core.collectives import from_rank0, rank, world_size
from loader.core.order import Order
from loader.core.progress import EMPTY
from loader.streams.filtered import check_runs

_HEADER = struct.Struct("<qqIB")  # step, epoch, number of indices, flags:
COMPLETE, FAILED = 1, 2  # the batch completed its update; its loading raised (consumed, never trained)
ATTEMPT, VERDICT = 4, 8  # an attempt's start, payload its key; its verdict, payload its key and 1 if it committed
END = 16  # this rank's share of the epoch is all handed out; rank 0's payload: [number dropped, dropped...,
# skipped on request...] (dataset indices)
FILTERED = 32  # the members of a delivered batch that the loader's filter dropped (consumed, never trained)
_FLAGS = COMPLETE | FAILED | ATTEMPT | VERDICT | END | FILTERED
_RANK_FILE = re.compile(r"rank-(\d{5,})\.bin")


class LedgerError(ValueError):
    """A ledger file that cannot be read, or that contradicts the rest of the ledger: the message names the file and
    the field."""


def _ledger_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "ledger"


def _generations(run_dir: str | os.PathLike) -> list[Path]:
    root = _ledger_dir(run_dir)
    return sorted(root.glob("gen-[0-9][0-9][0-9][0-9][0-9][0-9]")) if root.is_dir() else []


class Ledger:
    """This rank's append-only record for one generation.

    Attach it with `loader.checkpoint.ledger = Ledger.open(...)`.
    """

    def __init__(self, run_dir: str | os.PathLike, path: Path, resumed_step: int) -> None:
        self.run_dir, self.path, self.step = Path(run_dir), path, resumed_step
        self.rank = int(path.stem[5:])
        self.attempts = False  # an attempts generation's (torchft): ends are recorded by the caller, who deals
        self.stream = False  # a stream's (`open_stream`): its batches hold no indices, its filtered records runs
        self._ended: set[tuple[int, int]] = set()  # (epoch, step) of the ends recorded
        self._file = open(path, "ab")

    @property
    def generation(self) -> int:
        """This launch's number (1 for the job's first): what tells a replayed step's records, and metrics, apart."""
        return int(self.path.parent.name[4:])

    @classmethod
    def open(
        cls, run_dir: str | os.PathLike, resumed_step: int, num_samples: int, group: ProcessGroup | None = None
    ) -> Ledger:
        """Start a new generation (rank 0 creates it, every rank learns its number, or its error); a collective when
        torch.distributed is initialised."""
        made = from_rank0(lambda: _new_generation(run_dir, resumed_step, world_size(group), num_samples), group)
        return cls(run_dir, made / f"rank-{rank(group):05d}.bin", resumed_step)

    @classmethod
    def open_stream(cls, run_dir: str | os.PathLike, resumed_step: int, group: ProcessGroup | None = None) -> Ledger:
        """`open` for a loader of a stream (IterableDataset): its records have no index, so its batches are recorded
        without any (they count the steps) and the records its filter dropped by where they stand in the stream
        (`loader.streams.filtered`)."""
        made = from_rank0(lambda: _new_generation(run_dir, resumed_step, world_size(group), 0, stream=True), group)
        ledger = cls(run_dir, made / f"rank-{rank(group):05d}.bin", resumed_step)
        ledger.stream = True
        return ledger

    @classmethod
    def open_attempts(cls, run_dir: str | os.PathLike, num_samples: int, name: str) -> Ledger:
        """This process's own generation of attempts (no collective: the processes of a torchft job share no
        group that outlives a membership change); `name` says whose it is (e.g. its replica group and rank)."""
        path = _new_generation(run_dir, 0, 1, num_samples, attempts=name)
        ledger = cls(run_dir, path / "rank-00000.bin", 0)
        ledger.attempts = True
        return ledger

    def begin_attempt(self, step: int, key: tuple[int, int]) -> None:
        """The batches recorded next feed step `step` + 1 in the attempt `key` (shared by every process of it)."""
        self.step = step
        self._write(-1, np.asarray(key), ATTEMPT)

    def verdict(self, step: int, key: tuple[int, int], committed: bool) -> None:
        """Whether the attempt `key` of step `step` + 1 committed, as this process saw it."""
        self._write(-1, np.asarray([*key, committed]), VERDICT, step + 1)
        self._file.flush()

    def record(
        self, epoch: int, indices: np.ndarray, update_complete: bool, filtered: np.ndarray | None = None
    ) -> None:
        """One delivered batch, its trained `indices` and those its loader's filter dropped (`filtered`, recorded
        first, for the same step: the audit lists them as filtered by policy); flushed at each completed update so a
        crash loses only the replayed tail."""
        if filtered is not None:
            self.record_filtered(epoch, filtered)
        self._write(epoch, indices, COMPLETE if update_complete else 0)
        if update_complete:
            self.step += 1
            self._file.flush()

    def record_filtered(self, epoch: int, filtered: np.ndarray, step: int | None = None) -> None:
        """Records the loader's filter dropped (dataset indices; a stream's runs), for the step under way unless
        `step` says which: a stream's records dropped after a worker's last batch are consumed by the state that
        holds its end, which is taken after the step it stands for (see `ResumableDataLoader.state_dict`)."""
        if len(filtered):
            self._write(epoch, filtered, FILTERED, step)

    def record_failed(self, epoch: int, indices: np.ndarray, update_complete: bool) -> None:
        """A batch whose loading raised: consumed and never served again, so the audit lists its samples as
        failed, neither trained nor skipped. It feeds no optimizer step of its own, but it may be the last
        micro-batch of one (`update_complete`): the step is then complete, and the next batch feeds the next."""
        self._write(epoch, indices, FAILED | (COMPLETE if update_complete else 0))
        if update_complete:
            self.step += 1
            self._file.flush()

    def record_end(self, loader: Any) -> None:
        """The loader handed out this rank's whole share of its epoch, whose last update is the step just completed
        (or, in a pass that had nothing left, the step it resumed from). Rank 0 records what the epoch dropped by
        policy and skipped on request, as the global progress its state stands for at this point holds them (every
        rank's share is then done: in lockstep, or later by ranks that lag). Once per epoch and step."""
        sampler = loader.resumable_sampler
        epoch = sampler.epoch
        if self.attempts or (epoch, self.step) in self._ended:
            return
        payload = np.zeros(0, np.int64)
        if self.rank == 0:
            progress = sampler.standing()
            dropped = dict(progress.finished).get(epoch)
            if dropped is None:  # not finished as its state stands (a share's end always is): no claim made
                return
            order = sampler.order.for_epoch(epoch)
            dropped = order(_positions(dropped))
            payload = np.concatenate(([len(dropped)], dropped, order(_positions(progress.skipped.get(epoch, EMPTY)))))
        self._ended.add((epoch, self.step))
        self._write(epoch, payload, END, self.step)
        self._file.flush()

    def _write(self, epoch: int, indices: np.ndarray, flags: int, step: int | None = None) -> None:
        ids = np.ascontiguousarray(indices, dtype="<i8")
        self._file.write(_HEADER.pack(self.step + 1 if step is None else step, epoch, len(ids), flags) + ids.tobytes())

    def record_finished(self, progress: dict, loader: Any) -> None:
        """Store the indices dropped by policy of the epochs a merged progress reports finished, and those skipped
        on request (`loader.skip`) of the epochs it holds, as that progress has them (rank 0, with the
        checkpoint: a drop or skip lost with a later checkpoint is no longer recorded either). A save that was lost
        (failed, torn, damaged: the run resumed before the epoch's end) may have recorded an epoch finished that
        the run that counts has not finished yet, or finishes dropping other positions: so the records of epochs
        not finished are removed, and those of finished ones rewritten."""
        order = loader.resumable_sampler.order
        dropped = _ledger_dir(self.run_dir) / "dropped"
        if "epoch" in progress:  # every epoch from it on is unfinished
            for stale in dropped.glob("epoch-[0-9]*[0-9].npy"):
                if int(stale.stem[6:]) >= progress["epoch"]:
                    stale.unlink()
        for record in progress.get("finished", []):
            _save_indices(dropped / f"epoch-{record['epoch']:06d}.npy", order, record["epoch"], record["dropped"])
        skipped = dict(progress.get("skipped", []))
        held = {e for e, _ in progress.get("committed", [])} | {r["epoch"] for r in progress.get("finished", [])}
        for epoch in sorted(held | set(skipped)):
            target = _ledger_dir(self.run_dir) / "skipped" / f"epoch-{epoch:06d}.npy"
            if epoch in skipped:
                _save_indices(target, order, epoch, skipped[epoch])
            elif target.exists():
                target.unlink()

    def sync(self) -> None:
        """Make this rank's records durable, as the checkpoint about to be published will be: else a power loss
        could keep a checkpoint that counts steps whose records were lost, and the audit would call them skipped."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _positions(spans: ArrayLike) -> np.ndarray:
    """Every position of a set of intervals (flat [a, b, ...] or shape (k, 2))."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    return np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])


def _save_indices(target: Path, order: Order, epoch: int, flat_spans: list) -> None:
    """The dataset indices at these positions of the epoch, written atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp.npy")  # writers may race (torchft)
    np.save(tmp, order.for_epoch(epoch)(_positions(flat_spans)))
    fsync(tmp)  # durable before the checkpoint that reports it is published
    os.replace(tmp, target)
    fsync(target.parent)


def _new_generation(
    run_dir: str | os.PathLike,
    resumed_step: int,
    world_size: int,
    num_samples: int,
    attempts: str | None = None,
    stream: bool = False,
) -> Path:
    root = _ledger_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    existing = _generations(run_dir)
    number = int(existing[-1].name[4:]) + 1 if existing else 1
    while True:  # another launcher may take the same number: mkdir is the arbiter
        path = root / f"gen-{number:06d}"
        try:
            path.mkdir()
            break
        except FileExistsError:
            number += 1
    meta: dict[str, int | str | bool] = {
        "resumed_step": resumed_step,
        "world_size": world_size,
        "num_samples": num_samples,
    }
    if attempts is not None:
        meta["attempts"] = attempts
    if stream:
        meta["stream"] = True
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@dataclass(frozen=True)
class Record:
    generation: int
    rank: int
    step: int
    epoch: int
    indices: np.ndarray
    complete: bool
    failed: bool
    counted: bool = True  # False: a later generation replayed its step, or its rank never completed the step
    filtered: bool = False  # members of a delivered batch that the loader's filter dropped: consumed, never trained


@dataclass(frozen=True)
class Generation:
    """One launch of the job: its number, the checkpoint step it resumed from, and its world size."""

    number: int
    resumed_step: int
    world_size: int
    num_samples: int
    attempts: str | None = None  # whose attempts generation it is (see the module), None for a launch
    stream: bool = False  # a stream's launch (`Ledger.open_stream`)


@dataclass(frozen=True)
class RunLedger:
    """What the ledger of a run holds, read and checked (`read_run`)."""

    generations: list[Generation]
    records: list[Record]  # every batch record, each marked whether it counts
    dropped: dict[int, np.ndarray]  # per finished epoch: the indices it dropped by policy
    requested: dict[int, np.ndarray]  # per epoch: the indices skipped on request
    num_samples: int  # the last generation's: every index recorded must be below it
    stream: bool = False  # a stream's run: batches without indices, filtered records as runs (`Ledger.open_stream`)


_META = {"resumed_step": 0, "world_size": 1, "num_samples": 0}  # meta.json's fields and their least values


def _read_meta(path: Path) -> Generation:
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_bytes())
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LedgerError(
            f"{file}: unreadable ({err}); a launch that died while opening its ledger leaves this: "
            f"remove {path} if it holds no rank-*.bin"
        ) from None
    if not isinstance(meta, dict):
        raise LedgerError(f"{file}: holds a JSON {type(meta).__name__}, not an object with the fields {list(_META)}")
    for field, least in _META.items():
        value = meta.get(field)
        if not is_int(value) or not least <= value <= MAX_SAMPLES:
            raise LedgerError(f"{file}: field {field!r} must be an int in [{least}, {MAX_SAMPLES}], got {value!r}")
    attempts = meta.get("attempts")
    if attempts is not None and not isinstance(attempts, str):
        raise LedgerError(f"{file}: field 'attempts' must be a string (whose attempts they are), got {attempts!r}")
    stream = meta.get("stream", False)
    if not isinstance(stream, bool):
        raise LedgerError(f"{file}: field 'stream' must be true or false (a stream's launch or not), got {stream!r}")
    return Generation(
        int(path.name[4:]), meta["resumed_step"], meta["world_size"], meta["num_samples"], attempts, stream
    )


def _rank_files(path: Path) -> list[tuple[Path, int]]:
    found = []
    for file in sorted(path.glob("rank-*.bin")):
        match = _RANK_FILE.fullmatch(file.name)
        if match is None:
            raise LedgerError(
                f"{file}: not a rank file's name (rank-NNNNN.bin, the rank in decimal): move it out of the ledger"
            )
        found.append((file, int(match[1])))
    return found


def _payload_error(step: int, epoch: int, ids: np.ndarray, flags: int, stream: bool) -> str | None:
    """What is wrong with a record's header or payload length, besides its indices' range (None: nothing); a
    stream's filtered record holds runs (`loader.streams.filtered`)."""
    if flags & ~_FLAGS:
        return f"flags {flags:#x} has bits this reader does not know"
    if flags & FILTERED and flags != FILTERED:
        return f"flags {flags:#x}: a filtered record ({FILTERED:#x}) carries no other flag"
    if flags & FILTERED and stream:
        return check_runs(ids)
    if flags & ATTEMPT:
        return None if len(ids) == 2 else f"an attempt's key must be 2 ints, got {len(ids)}"
    if flags & VERDICT:
        return None if len(ids) == 3 and ids[2] in (0, 1) else "a verdict must be a key of 2 ints and 0 or 1"
    if epoch < 0:
        return f"epoch {epoch} is negative"
    if flags & END and len(ids) and not 0 <= ids[0] < len(ids):
        return f"an epoch's end counts {ids[0]} dropped indices of the {len(ids) - 1} it holds"
    return None


def _read_file(
    path: Path, num_samples: int, where: str, stream: bool = False
) -> list[tuple[int, int, np.ndarray, int]]:
    """A rank file's records (step, epoch, payload, flags), checked: every index of a batch or an epoch's end in
    [0, num_samples) (`where` says whose num_samples); a `stream` ledger's filtered records hold runs instead."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise LedgerError(f"{path}: unreadable ({err})") from None
    records, at = [], 0
    while at + _HEADER.size <= len(data):
        step, epoch, count, flags = _HEADER.unpack_from(data, at)
        end = at + _HEADER.size + 8 * count
        if end > len(data):
            break  # a record torn by a crash: its update never completed, so it is replayed anyway
        ids = np.frombuffer(data, dtype="<i8", count=count, offset=at + _HEADER.size)
        wrong = _payload_error(step, epoch, ids, flags, stream)
        if wrong is not None:
            raise LedgerError(f"{path}: the record at byte {at} (step {step}): {wrong}; the file is damaged")
        records.append((step, epoch, ids, flags))
        at = end
    named = ATTEMPT | VERDICT | (FILTERED if stream else 0)  # flags of records whose payload holds no indices
    indexed = [ids[1:] if flags & END else ids for _, _, ids, flags in records if not flags & named]
    every = np.concatenate(indexed + [np.zeros(0, np.int64)])
    if len(every) and (every.min() < 0 or every.max() >= num_samples):
        step, epoch, ids, _ = next(
            r for r in records if not r[3] & named and len(r[2]) and (r[2].min() < 0 or r[2].max() >= num_samples)
        )
        bad = ids[(ids < 0) | (ids >= num_samples)][0]
        raise LedgerError(
            f"{path}: a record of step {step}, epoch {epoch} holds index {bad}, outside [0, "
            f"{num_samples}) ({where}): the file is damaged, or the run's meta.json is another run's"
        )
    return records


def _load_indices(path: Path, num_samples: int, where: str) -> np.ndarray:
    """A dropped/ or skipped/ file's indices: a 1-d integer array in [0, num_samples), its size checked against the
    file before anything is allocated."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(f)
            room = os.fstat(f.fileno()).st_size - f.tell()
        if dtype.kind not in "iu" or len(shape) != 1 or shape[0] * dtype.itemsize > room:
            raise ValueError(
                f"holds an array of {dtype} and shape {shape}, not a 1-d integer array of what the file holds"
            )
        values = np.load(path).astype(np.int64)
    except (OSError, ValueError, EOFError) as err:
        raise LedgerError(f"{path}: unreadable ({err}); the file is damaged") from None
    if len(values) and (values.min() < 0 or values.max() >= num_samples):
        bad = values[(values < 0) | (values >= num_samples)][0]
        raise LedgerError(f"{path}: holds index {bad}, outside [0, {num_samples}) ({where})")
    return values


def _read_epochs(run_dir: str | os.PathLike, kind: str, num_samples: int, where: str) -> dict[int, np.ndarray]:
    """The indices dropped by policy (kind "dropped") or skipped on request ("skipped") per epoch, as
    `Ledger.record_finished` wrote them (a writer's leftover temporary files are not read)."""
    found = {}
    for path in sorted((_ledger_dir(run_dir) / kind).glob("epoch-*.npy")):
        match = re.fullmatch(r"epoch-(\d+)\.npy", path.name)
        if match is not None:
            found[int(match[1])] = _load_indices(path, num_samples, where)
    return found


def read_run(run_dir: str | os.PathLike) -> RunLedger:
    """Every generation of the run, every record each wrote, and what finished epochs dropped and skips skipped.

    A record of generation g counts when its step is at most the step every later generation resumed from, and
    at most the last step its rank completed in generation g. An epoch is finished when its dropped/ file exists,
    or when every rank of a generation (its world size, and any other that wrote) recorded a counted end of it;
    the latest such generation's rank 0 says what it dropped and skipped. Raises FileNotFoundError when there is
    no ledger, LedgerError when a file is unreadable or inconsistent."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory (the run directory whose ledger/ to read)")
    paths = _generations(run_dir)
    if not paths:
        raise FileNotFoundError(f"{_ledger_dir(run_dir)} holds no ledger: run the job with a Ledger attached")
    generations = [_read_meta(g) for g in paths]
    n, stream = generations[-1].num_samples, generations[-1].stream
    where = f"the field 'num_samples' of {paths[-1] / 'meta.json'}"
    for path, generation in zip(paths, generations):
        if generation.stream != stream:
            raise LedgerError(
                f"{path / 'meta.json'}: a {'stream' if generation.stream else 'map-style'} loader's launch in the "
                f"ledger of a {'stream' if stream else 'map-style'} loader's run ({paths[-1]}): one run, one kind"
            )
    records, ended = [], {}
    launches = [g for g in generations if g.attempts is None]
    for path, generation in zip(paths, generations):
        if generation.attempts is not None:
            continue
        cutoff = min((g.resumed_step for g in launches if g.number > generation.number), default=float("inf"))
        ranks = set(range(generation.world_size))
        ends: defaultdict[int, dict[int, np.ndarray]] = defaultdict(dict)
        for file, rank_number in _rank_files(path):
            ranks.add(rank_number)
            raw = _read_file(file, n, where, stream)
            completed = max((step for step, _, _, flags in raw if flags & COMPLETE), default=generation.resumed_step)
            for step, epoch, ids, flags in raw:
                counted = step <= min(cutoff, completed)
                if not flags & END:
                    records.append(
                        Record(
                            generation.number,
                            rank_number,
                            step,
                            epoch,
                            ids,
                            bool(flags & COMPLETE),
                            bool(flags & FAILED),
                            counted,
                            bool(flags & FILTERED),
                        )
                    )
                elif counted:
                    ends[epoch][rank_number] = ids
        ended.update({e: by_rank[0] for e, by_rank in ends.items() if ranks <= by_rank.keys()})
    records += _attempt_records([(g, p) for g, p in zip(generations, paths) if g.attempts], n, where)
    dropped = {**_read_epochs(run_dir, "dropped", n, where), **{e: ids[1 : 1 + ids[0]] for e, ids in ended.items()}}
    requested = _read_epochs(run_dir, "skipped", n, where)
    for e, ids in ended.items():
        requested[e] = np.union1d(requested.get(e, np.zeros(0, np.int64)), ids[1 + ids[0] :])
    return RunLedger(generations, records, dropped, requested, n, stream)


def read_generations(run_dir: str | os.PathLike) -> tuple[list[Generation], list[Record]]:
    """Every generation of the run, and every record each wrote, marked whether it counts (see `read_run`)."""
    run = read_run(run_dir)
    return run.generations, run.records


def _attempt_records(generations: list[tuple[Generation, Path]], num_samples: int, where: str) -> list[Record]:
    """The records of attempts generations, each counted when its attempt is its step's committed attempt with
    the largest key (see the module); a process's records before its first ATTEMPT belong to none."""
    tried = []
    committed: dict[int, tuple[int, ...]] = {}
    for generation, path in generations:
        key = None
        for step, epoch, payload, flags in _read_file(path / "rank-00000.bin", num_samples, where):
            if flags & ATTEMPT:
                key = tuple(payload.tolist())
            elif flags & VERDICT:
                if payload[-1]:
                    committed[step] = max(committed.get(step, ()), tuple(payload[:-1].tolist()))
            elif not flags & END:
                tried.append((generation.number, step, epoch, payload, flags, key))
    return [
        Record(
            number,
            0,
            step,
            epoch,
            ids,
            bool(flags & COMPLETE),
            bool(flags & FAILED),
            key is not None and committed.get(step) == key,
            bool(flags & FILTERED),
        )
        for number, step, epoch, ids, flags, key in tried
    ]


def read_ledger(run_dir: str | os.PathLike) -> tuple[list[Record], dict[int, np.ndarray], int]:
    """The records that count (completed steps not replayed later), the dropped indices per finished epoch, and N."""
    run = read_run(run_dir)
    return [r for r in run.records if r.counted], run.dropped, run.num_samples
