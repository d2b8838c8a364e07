"""A Mixture of TokenSources read by its batch reader (what the loader calls with num_workers=0) and by its fast
path for small batches: the same tensors as the samples one by one, located without the per-process cache, for
fixed weights, schedules and a changed schedule; a changed token file still refused; the loader's batches the same
with 0 and 2 workers, every position once."""

import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, SampleIndex
from loader.core.rows import batch_reader, collate
from loader.sources import Mixture, TokenFileError
from loader.sources.mixture import BLOCK
from tests.test_mixture import fused_mixture, general

SCHEDULE = [{"from": [5, 3, 2], "to": [1, 1, 8], "windows": 300}, {"weights": [2, 1, 1]}]
CHANGED = [{"weights": [1, 6, 3], "windows": 100}, {"from": [1, 6, 3], "to": [7, 2, 1], "windows": 150}]


def expected(mix, positions) -> torch.Tensor:
    """The batch from the plan (no cache) and each source's samples one at a time."""
    source, index = mix.plan.locate(np.asarray(positions, dtype=np.int64))
    rows = [mix.sources[s][i] for s, i in zip(source.tolist(), index.tolist())]
    return torch.stack(rows) if rows else torch.empty((0, mix._span), dtype=torch.int64)


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory):
    """Fixed weights, a ramp then constant weights, and that schedule changed inside its ramp, each over more
    than two cache blocks; the same token files (three sources, two of them over several files)."""
    directory = tmp_path_factory.mktemp("fast")
    n = 3 * BLOCK + 17
    fixed = fused_mixture(directory, n)
    sources = fixed.sources
    scheduled = Mixture(sources, None, n, seed=4, names=fixed.names, schedule=SCHEDULE)
    changed = Mixture(
        sources, None, n, seed=4, names=fixed.names, schedule=CHANGED, amends=scheduled.plan, change_at=1234
    )
    assert scheduled.plan.schedule and changed.plan.changes
    return {"fixed": fixed, "scheduled": scheduled, "changed": changed}


@st.composite
def batches(draw, n: int, block: int):
    """Runs in order (many inside one block, some crossing into the next), runs out of order, strided runs (a
    rank's share), scattered and repeated positions, empty batches; sometimes as the loader's SampleIndex."""
    start = draw(st.one_of(st.integers(0, n - 1), st.integers(1, n // block).map(lambda k: k * block - 40)))
    run = list(range(start, min(start + draw(st.integers(0, 80)), n)))
    batch = draw(
        st.one_of(
            st.just(run),
            st.permutations(run),
            st.integers(2, 4).map(lambda step: run[::step]),
            st.lists(st.integers(0, n - 1), max_size=40),
            st.lists(st.sampled_from(run), max_size=12) if run else st.just([]),
        )
    )
    if draw(st.booleans()):
        batch = [SampleIndex(p, 1000 + p) for p in batch]
    return batch


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_batch_reader_and_getitems_equal_the_samples_one_by_one(mixtures, data):
    mix = mixtures[data.draw(st.sampled_from(sorted(mixtures)), label="mixture")]
    positions = data.draw(batches(len(mix), mix._block), label="positions")
    want = expected(mix, positions)
    got = batch_reader(mix)(positions)
    assert got.dtype == torch.int64 and got.shape == (len(positions), mix._span)
    assert torch.equal(got, want)
    assert torch.equal(collate(mix.__getitems__(positions)), want)
    fresh = pickle.loads(pickle.dumps(mix))  # a worker's copy: nothing cached yet
    assert torch.equal(batch_reader(fresh)(positions), want)


def test_positions_out_of_range_are_refused_and_a_worker_copy_carries_no_cached_block(mixtures):
    mix = Mixture(mixtures["fixed"].sources, None, 3 * BLOCK + 17, seed=4, schedule=SCHEDULE)  # nothing read yet
    read = batch_reader(mix)
    for batch, bad in (([len(mix)], len(mix)), ([len(mix) - 2, len(mix)], len(mix)), ([-1, 0], -1), ([-1], -1)):
        with pytest.raises(IndexError, match=f"mixture position {bad} out of range for {len(mix)} positions"):
            read(batch)
    read(list(range(100)))  # a large batch: the plan's own caches filled, no block's lists
    before = len(pickle.dumps(mix))
    read(list(range(mix._block - 5, mix._block + 3)))  # small batches across and inside a block: its table is kept
    read(list(range(mix._block + 10, mix._block + 18)))
    assert len(pickle.dumps(mix)) == before  # a worker maps its own blocks; none travels with the dataset


def test_only_a_fused_mixture_of_its_own_getitems_has_a_batch_reader(mixtures):
    mix = mixtures["fixed"]
    assert batch_reader(mix) is not None
    assert batch_reader(general(mix)) is None  # samples fetched per source: there is no one array to read

    class Own(Mixture):
        def __getitems__(self, positions):
            return super().__getitems__(positions)[::-1]

    own = Own(mix.sources, [0.5, 0.3, 0.2], 100)
    assert own._span is not None and batch_reader(own) is None


def test_a_changed_token_file_is_refused_through_the_batch_reader(tmp_path):
    """b-1.bin rewritten in place, same size and mtime (only its ctime moves), after this process mapped it: a
    small batch inside one cached block that reads it is refused, by the reader and by the loader; batches that
    do not read it still load."""
    mix = fused_mixture(tmp_path, 60)
    read = batch_reader(mix)
    source, index = mix.plan.locate(np.arange(60))
    b = mix.sources[1]
    in_b1 = [p for p in range(60) if source[p] == 1 and b.sample_key(int(index[p]))[0].endswith("b-1.bin")]
    not_b = [p for p in range(60) if source[p] != 1]
    assert in_b1 and not_b
    before = read(not_b)
    read(in_b1)  # b-1.bin mapped in this process: only the check after the read can notice
    path = tmp_path / "b-1.bin"
    stat = os.stat(path)
    tokens = np.fromfile(path, np.uint16)
    (tokens + 1).tofile(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(TokenFileError, match="b-1.bin changed after the TokenSource was built"):
        read(not_b[:3] + in_b1[:1])
    assert torch.equal(read(not_b), before)
    with pytest.raises(TokenFileError, match="b-1.bin changed"):
        next(iter(ResumableDataLoader(mix, batch_size=in_b1[0] + 1)))  # its first batch reads b-1.bin


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loaders_batches_are_the_samples_of_their_positions_each_position_once(mixtures, workers):
    """A changed schedule over more than two cache blocks, batches of 7 (some crossing a block), at world size 1
    with 0 and 2 workers and at world size 2 in-process: each batch the samples of its positions, every position
    of the epoch delivered exactly once."""
    mix = mixtures["changed"]
    worlds = (1,) if workers else (1, 2)
    for world in worlds:
        seen = []
        for rank in range(world):
            loader = ResumableDataLoader(
                mix,
                batch_size=7,
                rank=rank,
                world_size=world,
                num_workers=workers,
                multiprocessing_context="fork" if workers else None,
            )
            for batch in loader:
                positions = loader.last_indices().tolist()
                assert torch.equal(batch, expected(mix, positions))
                seen += positions
        assert sorted(seen) == list(range(len(mix)))
