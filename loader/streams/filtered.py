"""The records a stream's filter dropped, named by where they stand in the stream, so that the ledger can name them
(a stream's records have no dataset index).

A sharded stream's record is (shard, record number in the shard): the same at any world size and number of workers.
A plain stream's, which resumes at the same layout only, is (worker, batch, record): the record-th record its worker
drew while making its batch-th batch of the pass (its rank is the ledger file's). They travel as runs, rows of
[source, batch, first, past] (a sharded stream's batch is SHARDED), so that a batch carries a few rows however many
records the filter dropped before it: at most one per kept record and shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

SHARDED = -1  # the batch column of a sharded stream's run: its records are named by shard and record alone
WIDTH = 4  # the columns of a run: source (shard or worker), batch, first record, past the last


class Runs:
    """The runs of dropped records gathered while a batch is made (in the worker)."""

    def __init__(self) -> None:
        self._rows: list[list[int]] = []

    def add(self, source: int, batch: int, record: int) -> None:
        rows = self._rows
        if rows and rows[-1][0] == source and rows[-1][1] == batch and rows[-1][3] == record:
            rows[-1][3] += 1
        else:
            rows.append([source, batch, record, record + 1])

    def take(self) -> np.ndarray | None:
        """The runs gathered since the last take (None: none), as an (n, WIDTH) int64 array."""
        rows, self._rows = self._rows, []
        return np.array(rows, dtype=np.int64) if rows else None


def count(runs: np.ndarray | None) -> int:
    """How many records the runs name."""
    return 0 if runs is None else int((runs[:, 3] - runs[:, 2]).sum())


def check_runs(flat: np.ndarray) -> str | None:
    """What is wrong with runs as the ledger holds them (flat), or None."""
    if len(flat) % WIDTH:
        return f"a stream's filtered record holds {len(flat)} values, not runs of {WIDTH}"
    runs = flat.reshape(-1, WIDTH)
    if (
        len(runs)
        and not ((runs[:, 0] >= 0).all() and (runs[:, 1] >= SHARDED).all() and (0 <= runs[:, 2]).all())
        or (runs[:, 2] >= runs[:, 3]).any()
    ):
        return "a stream's filtered run is not [source >= 0, batch >= -1, first >= 0, past > first]"
    return None


def records_of(flat: np.ndarray, rank: int) -> np.ndarray:
    """Each record the runs (flat, as the ledger holds them) name, as a row (rank, source, batch, record): a sharded
    stream's rank is SHARDED (its records are the same whichever rank read them)."""
    runs = flat.reshape(-1, WIDTH)
    lengths = runs[:, 3] - runs[:, 2]
    repeated = np.repeat(runs, lengths, axis=0)
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    ranks = np.where(repeated[:, 1] == SHARDED, SHARDED, rank)
    return np.stack((ranks, repeated[:, 0], repeated[:, 1], repeated[:, 2] + offsets), axis=1)


def describe(row: Iterable[int]) -> str:
    """A record's name, from its row (rank, source, batch, record)."""
    rank, source, batch, record = (int(v) for v in row)
    if batch == SHARDED:
        return f"shard {source} record {record}"
    return f"rank {rank} worker {source} batch {batch} record {record}"
