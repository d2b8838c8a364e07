"""The identity ledger: each rank appends the dataset indices of every batch it delivers, labelled with the step.

Why: exactly-once is a claim about sample identities across crashes, restarts and world sizes; the ledger is the
evidence. Each launch of the job is a *generation* that starts from a checkpoint step. A record is labelled with
the optimizer step its batch feeds, so when a later generation resumes from step S, the records past S of the
earlier ones are the replayed steps and are discarded by the reader (`read_ledger`); nothing is rewritten in place.

Layout under RUN_DIR/ledger/: gen-NNNNNN/meta.json and gen-NNNNNN/rank-NNNNN.bin (one append-only file per rank),
dropped/epoch-NNNNNN.npy (indices dropped by policy when an epoch finished) and skipped/epoch-NNNNNN.npy (indices
skipped on request, `ResumableDataLoader.skip`, as the newest checkpoint's progress holds them).

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
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loader.checkpoint.publish import fsync
from loader.core.collectives import from_rank0, rank, world_size
_HEADER = struct.Struct("<qqIB")  # step, epoch, number of indices, flags:
COMPLETE, FAILED = 1, 2  # the batch completed its update; its loading raised (consumed, never trained)
FILTERED = 16  # the members of a delivered batch that the loader's filter dropped (consumed, never trained)
ATTEMPT, VERDICT = 4, 8  # an attempt's start, payload its key; its verdict, payload its key and 1 if it committed


def _ledger_dir(run_dir) -> Path:
    return Path(run_dir) / "ledger"


def _generations(run_dir) -> list[Path]:
    root = _ledger_dir(run_dir)
    return sorted(root.glob("gen-[0-9][0-9][0-9][0-9][0-9][0-9]")) if root.is_dir() else []


class Ledger:
    """This rank's append-only record for one generation. Attach it with `loader.checkpoint.ledger = Ledger.open(...)`."""

    def __init__(self, run_dir, path: Path, resumed_step: int):
        self.run_dir, self.path, self.step = Path(run_dir), path, resumed_step
        self._file = open(path, "ab")

    @property
    def generation(self) -> int:
        """This launch's number (1 for the job's first): what tells a replayed step's records, and metrics, apart."""
        return int(self.path.parent.name[4:])

    @classmethod
    def open(cls, run_dir, resumed_step: int, num_samples: int, group=None) -> "Ledger":
        """Start a new generation (rank 0 creates it, every rank learns its number, or its error); a collective when
        torch.distributed is initialised."""
        made = from_rank0(lambda: _new_generation(run_dir, resumed_step, world_size(group), num_samples), group)
        return cls(run_dir, made / f"rank-{rank(group):05d}.bin", resumed_step)

    @classmethod
    def open_attempts(cls, run_dir, num_samples: int, name: str) -> "Ledger":
        """This process's own generation of attempts (no collective: the processes of a torchft job share no
        group that outlives a membership change); `name` says whose it is (e.g. its replica group and rank)."""
        path = _new_generation(run_dir, 0, 1, num_samples, attempts=name)
        return cls(run_dir, path / "rank-00000.bin", 0)

    def begin_attempt(self, step: int, key: tuple[int, int]) -> None:
        """The batches recorded next feed step `step` + 1 in the attempt `key` (shared by every process of it)."""
        self.step = step
        self._write(-1, np.asarray(key), ATTEMPT)

    def verdict(self, step: int, key: tuple[int, int], committed: bool) -> None:
        """Whether the attempt `key` of step `step` + 1 committed, as this process saw it."""
        self._write(-1, np.asarray([*key, committed]), VERDICT, step + 1)
        self._file.flush()

    def record(self, epoch: int, indices: np.ndarray, update_complete: bool,
               filtered: np.ndarray | None = None) -> None:
        """One delivered batch, its trained `indices` and those its loader's filter dropped (`filtered`, recorded
        first, for the same step: the audit lists them as filtered by policy); flushed at each completed update so a
        crash loses only the replayed tail."""
        if filtered is not None and len(filtered):
            self._write(epoch, filtered, FILTERED)
        self._write(epoch, indices, COMPLETE if update_complete else 0)
        if update_complete:
            self.step += 1
            self._file.flush()

    def record_failed(self, epoch: int, indices: np.ndarray, update_complete: bool) -> None:
        """A batch whose loading raised: consumed and never served again, so the audit lists its samples as
        failed, neither trained nor skipped. It feeds no optimizer step of its own, but it may be the last
        micro-batch of one (`update_complete`): the step is then complete, and the next batch feeds the next."""
        self._write(epoch, indices, FAILED | (COMPLETE if update_complete else 0))
        if update_complete:
            self.step += 1
            self._file.flush()

    def _write(self, epoch: int, indices: np.ndarray, flags: int, step: int | None = None) -> None:
        ids = np.ascontiguousarray(indices, dtype="<i8")
        self._file.write(_HEADER.pack(self.step + 1 if step is None else step, epoch, len(ids), flags) + ids.tobytes())

    def record_finished(self, progress: dict, loader) -> None:
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


def _save_indices(target: Path, order, epoch: int, flat_spans: list) -> None:
    """The dataset indices at these positions of the epoch, written atomically."""
    spans = np.asarray(flat_spans, dtype=np.int64).reshape(-1, 2)
    positions = np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp.npy")  # writers may race (torchft)
    np.save(tmp, order.for_epoch(epoch)(positions))
    fsync(tmp)  # durable before the checkpoint that reports it is published
    os.replace(tmp, target)
    fsync(target.parent)


def _new_generation(run_dir, resumed_step: int, world_size: int, num_samples: int, attempts: str | None = None) -> Path:
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
    meta = {"resumed_step": resumed_step, "world_size": world_size, "num_samples": num_samples}
    if attempts is not None:
        meta["attempts"] = attempts
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


def _read_file(path: Path) -> list[tuple[int, int, np.ndarray, int]]:
    data, records, at = path.read_bytes(), [], 0
    while at + _HEADER.size <= len(data):
        step, epoch, count, flags = _HEADER.unpack_from(data, at)
        end = at + _HEADER.size + 8 * count
        if end > len(data):
            break  # a record torn by a crash: its update never completed, so it is replayed anyway
        records.append((step, epoch, np.frombuffer(data, dtype="<i8", count=count, offset=at + _HEADER.size), flags))
        at = end
    return records


def read_generations(run_dir) -> tuple[list[Generation], list[Record]]:
    """Every generation of the run, and every record each wrote, marked whether it counts.

    A record of generation g counts when its step is at most the step every later generation resumed from, and
    at most the last step its rank completed in generation g."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory (the run directory whose ledger/ to read)")
    paths = _generations(run_dir)
    if not paths:
        raise FileNotFoundError(f"{_ledger_dir(run_dir)} holds no ledger: run the job with a Ledger attached")
    metas = [json.loads((g / "meta.json").read_text()) for g in paths]
    generations = [Generation(int(g.name[4:]), m["resumed_step"], m["world_size"], m["num_samples"],
                              m.get("attempts")) for g, m in zip(paths, metas)]
    records = []
    launches = [g for g in generations if g.attempts is None]
    for i, (path, generation) in enumerate(zip(paths, generations)):
        if generation.attempts is not None:
            continue
        cutoff = min((g.resumed_step for g in launches if g.number > generation.number), default=float("inf"))
        for file in sorted(path.glob("rank-*.bin")):
            raw = _read_file(file)
            completed = max((step for step, _, _, flags in raw if flags & COMPLETE), default=generation.resumed_step)
            records += [Record(generation.number, int(file.stem[5:]), step, epoch, ids, bool(flags & COMPLETE),
                               bool(flags & FAILED), step <= min(cutoff, completed), bool(flags & FILTERED))
                        for step, epoch, ids, flags in raw]
    return generations, records + _attempt_records([(g, p) for g, p in zip(generations, paths) if g.attempts])


def _attempt_records(generations: list[tuple[Generation, Path]]) -> list[Record]:
    """The records of attempts generations, each counted when its attempt is its step's committed attempt with
    the largest key (see the module); a process's records before its first ATTEMPT belong to none."""
    tried, committed = [], {}
    for generation, path in generations:
        key = None
        for step, epoch, payload, flags in _read_file(path / "rank-00000.bin"):
            if flags & ATTEMPT:
                key = tuple(payload.tolist())
            elif flags & VERDICT:
                if payload[-1]:
                    committed[step] = max(committed.get(step, ()), tuple(payload[:-1].tolist()))
            else:
                tried.append((generation.number, step, epoch, payload, flags, key))
    return [Record(number, 0, step, epoch, ids, bool(flags & COMPLETE), bool(flags & FAILED),
                   key is not None and committed.get(step) == key, bool(flags & FILTERED))
            for number, step, epoch, ids, flags, key in tried]


def read_dropped(run_dir, kind: str = "dropped") -> dict[int, np.ndarray]:
    """The indices dropped by policy, per finished epoch (an epoch is finished when its record exists); with
    kind="skipped", those skipped on request, per epoch."""
    return {
        int(p.stem[6:]): np.load(p) for p in sorted((_ledger_dir(run_dir) / kind).glob("epoch-[0-9]*[0-9].npy"))
    }


def read_ledger(run_dir) -> tuple[list[Record], dict[int, np.ndarray], int]:
    """The records that count (completed steps not replayed later), the dropped indices per finished epoch, and N."""
    generations, records = read_generations(run_dir)
    return [r for r in records if r.counted], read_dropped(run_dir), generations[-1].num_samples
