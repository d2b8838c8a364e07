"""Sharded streams: the loader deals the shards to (rank, worker), and a restart at another world size or number of
workers deals the unfinished ones again, each from the record it had reached. Every test counts every record of
every epoch: read exactly once.
"""

import itertools
import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, StateError, merge_states
from loader.sources.sharded import FileShards, HuggingFaceShards, WebDatasetShards
from loader.streams.shards import RankShards, ShardDeal, ShardProgress, merge
from tests.streams import FORK
from tests.test_streams import train_skipping_errors

# -- the deal and the merge, without processes -------------------------------------------------------------------------


def read_by(deal, epoch, rank, worker, position, lengths):
    """(shard, record) pairs a worker read in the epoch up to its position ("ended": all; None: nothing)."""
    tasks = deal.tasks(epoch, rank, worker)
    if position is None:
        return []
    task, offset = (len(tasks), 0) if position == "ended" else position
    done = [(s, r) for s, start in tasks[:task] for r in range(start, lengths[s])]
    return done + ([(tasks[task][0], r) for r in range(tasks[task][1], offset)] if task < len(tasks) else [])


@st.composite
def rank_positions(draw, deal, lengths):
    """Where every rank of the deal stands: an epoch from the deal's first unfinished one, and per worker nothing
    read, everything read, or (task, next record) somewhere in its tasks."""
    ranks = []
    for rank in range(deal.world_size):
        epoch = deal.progress.epoch + draw(st.integers(0, 1))
        positions = []
        for worker in range(deal.workers):
            tasks = deal.tasks(epoch, rank, worker)
            choices = [None, "ended"] + [
                (t, o) for t, (s, start) in enumerate(tasks) for o in range(start, lengths[s] + 1)
            ]
            positions.append(draw(st.sampled_from(choices)))
        ranks.append(RankShards(rank, epoch, positions))
    return ranks


def records_read(deal, ranks, lengths):
    """Per epoch, the (shard, record) pairs the ranks read since the deal was made."""
    read = {}
    for r in ranks:
        for worker, position in enumerate(r.positions):
            for epoch in range(deal.progress.epoch, r.epoch + 1):
                done = "ended" if epoch < r.epoch else position
                read.setdefault(epoch, []).extend(read_by(deal, epoch, r.rank, worker, done, lengths))
    return read


layouts = st.tuples(st.integers(1, 3), st.integers(1, 3))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=9), st.integers(0, 9), st.booleans(), layouts, layouts, layouts, st.data())
def test_resizes_one_after_another_read_every_record_of_every_epoch_once(
    lengths, seed, shuffle, first, second, last, data
):
    """Two restarts at other layouts: the second merges progress over a base the first one left."""
    deal, read = ShardDeal(ShardProgress(len(lengths)), *first, seed, shuffle), {}
    for layout in (second, last):
        ranks = data.draw(rank_positions(deal, lengths))
        for epoch, pairs in records_read(deal, ranks, lengths).items():
            read.setdefault(epoch, []).extend(pairs)
        deal = ShardDeal(merge(deal, ranks), *layout, seed, shuffle)
    every = sorted((s, r) for s, n in enumerate(lengths) for r in range(n))
    for epoch in range(3):
        rest = [
            pair
            for rank in range(deal.world_size)
            for worker in range(deal.workers)
            for pair in read_by(deal, epoch, rank, worker, "ended", lengths)
        ]
        assert sorted(read.get(epoch, []) + rest) == every, f"epoch {epoch}"


def test_each_epoch_deals_every_shard_once_in_its_own_order():
    deal = ShardDeal(ShardProgress(10), 2, 3, seed=4, shuffle=True)
    for epoch in range(3):
        dealt = [s for rank in range(2) for worker in range(3) for s, _ in deal.tasks(epoch, rank, worker)]
        assert sorted(dealt) == list(range(10))
    assert deal.order(0).tolist() != deal.order(1).tolist()
    assert ShardDeal(ShardProgress(10), 2, 3, seed=4, shuffle=False).order(1).tolist() == list(range(10))


# -- through the loader ------------------------------------------------------------------------------------------------

LENGTHS = [5, 0, 7, 3, 9, 1, 6]  # uneven shards, an empty one, a one-record one


def write_shards(directory, lengths=LENGTHS):
    paths = []
    for s, n in enumerate(lengths):
        path = directory / f"part-{s}.txt"
        path.write_text("".join(f"{s}:{r}\n" for r in range(n)))
        paths.append(str(path))
    return paths


def read_lines(path):
    with open(path) as lines:
        yield from (line.strip() for line in lines)


def with_draws(records):
    """A collate_fn that draws a random number per record: the same draws after a resume only if each worker gets
    its random state back. (Draws in `read` would be made again for the records a resume inside a shard skips.)"""
    return [(record, torch.randint(1000, ()).item()) for record in records]


def every_record(lengths=LENGTHS):
    return sorted(f"{s}:{r}" for s, n in enumerate(lengths) for r in range(n))


def names(batches):
    return [record for batch in batches for record, _ in batch]


def loaders(paths, world, num_workers, **kw):
    extra = FORK if num_workers else {}
    return [
        ResumableDataLoader(
            FileShards(paths, read_lines),
            batch_size=2,
            collate_fn=with_draws,
            rank=rank,
            world_size=world,
            num_workers=num_workers,
            seed=3,
            generator=torch.Generator().manual_seed(rank),
            **extra,
            **kw,
        )
        for rank in range(world)
    ]


def take(dl, count):
    return list(itertools.islice(dl, count))


@pytest.mark.parametrize("new_world, new_workers", [(3, 1), (1, 3), (1, 0), (2, 2)])
def test_a_resume_at_another_world_size_and_worker_count_reads_every_record_once(tmp_path, new_world, new_workers):
    paths = write_shards(tmp_path)
    first = loaders(paths, 2, 2, shuffle=True)
    seen = take(first[0], 5) + take(first[1], 2)  # ranks progress unequally
    state = json.loads(json.dumps(merge_states([dl.state_dict() for dl in first])))
    second = loaders(paths, new_world, new_workers, shuffle=True)
    for dl in second:
        dl.load_state_dict(state)
        seen += list(dl)
    assert sorted(names(seen)) == every_record()
    assert all(dl.epoch == 0 and dl.exhausted for dl in second)


def test_two_restarts_in_a_row_at_other_layouts_read_every_record_once(tmp_path):
    paths = write_shards(tmp_path)
    first = loaders(paths, 2, 2, shuffle=True)
    seen = take(first[0], 3) + take(first[1], 1)
    state = merge_states([dl.state_dict() for dl in first])
    second = loaders(paths, 3, 1, shuffle=True)
    for dl, count in zip(second, (1, 0, 2)):
        dl.load_state_dict(state)
        seen += take(dl, count)
    state = merge_states([dl.state_dict() for dl in second])
    (last,) = loaders(paths, 1, 0, shuffle=True)
    last.load_state_dict(state)
    assert sorted(names(seen + list(last))) == every_record()


def test_a_resume_at_the_same_layout_is_bit_identical(tmp_path):
    paths = write_shards(tmp_path)
    reference = [list(dl) for dl in loaders(paths, 2, 2)]
    first = loaders(paths, 2, 2)
    seen = [take(first[0], 3), take(first[1], 1)]
    state = merge_states([dl.state_dict() for dl in first])
    for rank, dl in enumerate(loaders(paths, 2, 2)):
        dl.load_state_dict(state)
        assert seen[rank] + list(dl) == reference[rank]


def test_a_resize_with_ranks_in_different_epochs_reads_each_epoch_once(tmp_path):
    paths = write_shards(tmp_path)
    first = loaders(paths, 2, 0, shuffle=True)
    epochs = {0: list(first[0]) + take(first[1], 1)}  # rank 0 finished epoch 0 ...
    epochs[1] = take(first[0], 2)  # ... and went on into epoch 1
    state = merge_states([dl.state_dict() for dl in first])
    for dl in loaders(paths, 3, 1, shuffle=True):
        dl.load_state_dict(state)
        epochs[0] += list(dl)
        assert dl.epoch == 0
        epochs[1] += list(dl)
        assert dl.epoch == 1
    assert sorted(names(epochs[0])) == sorted(names(epochs[1])) == every_record()


def test_a_resize_at_the_end_of_an_epoch_goes_on_with_the_next(tmp_path):
    paths = write_shards(tmp_path)
    first = loaders(paths, 2, 1)
    for dl in first:
        list(dl)
    state = merge_states([dl.state_dict() for dl in first])
    (dl,) = loaders(paths, 1, 2)
    dl.load_state_dict(state)
    assert dl.epoch == 0 and dl.exhausted
    assert sorted(names(list(dl))) == every_record() and dl.epoch == 1


def read_breaking_at_4_3(path):
    for record in read_lines(path):
        if record == "4:3":
            raise ValueError("corrupt record 4:3")
        yield record


@pytest.mark.parametrize("stop", [None, 2, 5])
def test_a_shard_that_fails_to_read_fails_a_batch_and_the_rest_of_the_shard(tmp_path, stop):
    paths = write_shards(tmp_path)

    def loader():
        return ResumableDataLoader(
            FileShards(paths, read_breaking_at_4_3), batch_size=2, collate_fn=list, num_workers=2, **FORK
        )

    batches, errors = train_skipping_errors(loader())
    delivered = [record for batch in batches for record in batch]
    lost = set(every_record()) - set(delivered)
    rest_of_shard_4 = {f"4:{r}" for r in range(3, 9)}
    assert errors == 1 and len(delivered) == len(set(delivered)) and rest_of_shard_4 <= lost
    assert len(lost - rest_of_shard_4) <= 1  # what the failed batch had read before the error
    if stop is not None:
        first = loader()
        before, _ = train_skipping_errors(first, limit=stop)
        resumed = loader()
        resumed.load_state_dict(first.state_dict())
        after, _ = train_skipping_errors(resumed)
        assert before + after == batches


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(paths_slice=slice(1, None)), "count is 7 in the saved state but 6"),
        (dict(seed=4), "seed is 3 in the saved state but 4"),
        (dict(shuffle=True), "shuffle is False in the saved state but True"),
    ],
)
def test_a_state_of_other_shards_or_another_order_is_refused(tmp_path, change, message):
    paths = write_shards(tmp_path)
    (dl,) = loaders(paths, 1, 0)
    take(dl, 2)
    kw = dict(seed=change.get("seed", 3), shuffle=change.get("shuffle", False))
    other = ResumableDataLoader(
        FileShards(paths[change.get("paths_slice", slice(None))], read_lines), batch_size=2, **kw
    )
    with pytest.raises(StateError, match=message):
        other.load_state_dict(dl.state_dict())


def test_one_ranks_state_cannot_stand_for_the_others(tmp_path):
    first = loaders(write_shards(tmp_path), 2, 0)
    take(first[0], 1)
    with pytest.raises(StateError, match="missing ranks \\[1\\]"):
        loaders(write_shards(tmp_path), 3, 0)[0].load_state_dict(first[0].state_dict())


# -- the adapters: webdataset, Hugging Face ----------------------------------------------------------------------------


def test_a_webdataset_pipeline_resumes_at_another_world_size(tmp_path):
    import webdataset as wds

    from tests.test_webdataset_source import make_dataset

    urls = make_dataset(tmp_path / "data", [5, 0, 3, 8, 1], seed=2)
    keys = sorted(
        key
        for url in urls
        for key, _ in wds.DataPipeline(
            wds.SimpleShardList([url]), wds.tarfile_to_samples(), wds.to_tuple("__key__", "cls")
        )
    )

    def pipeline_loaders(world, num_workers):
        stream = WebDatasetShards(urls, wds.to_tuple("__key__", "cls"))
        return [
            ResumableDataLoader(
                stream,
                batch_size=2,
                collate_fn=list,
                rank=r,
                world_size=world,
                shuffle=True,
                num_workers=num_workers,
                **(FORK if num_workers else {}),
            )
            for r in range(world)
        ]

    first = pipeline_loaders(2, 2)
    seen = take(first[0], 2) + take(first[1], 3)
    state = merge_states([dl.state_dict() for dl in first])
    for dl in pipeline_loaders(3, 0):
        dl.load_state_dict(state)
        seen += list(dl)
    assert sorted(key for batch in seen for key, _ in batch) == keys


def test_a_hugging_face_streaming_dataset_resumes_at_another_world_size(tmp_path):
    datasets = pytest.importorskip(
        "datasets", reason="Hugging Face datasets is an optional test dependency (pip install -e '.[hf]')"
    )
    datasets.disable_progress_bars()
    files = []
    for f, n in enumerate([4, 7, 0, 5]):
        path = tmp_path / f"part-{f}.jsonl"
        path.write_text("".join(json.dumps({"id": f * 100 + i}) + "\n" for i in range(n)))
        files.append(str(path))

    def hf_loaders(world, num_workers):
        stream = HuggingFaceShards(datasets.load_dataset("json", data_files=files, split="train", streaming=True))
        return [
            ResumableDataLoader(
                stream,
                batch_size=2,
                collate_fn=list,
                rank=r,
                world_size=world,
                num_workers=num_workers,
                **(FORK if num_workers else {}),
            )
            for r in range(world)
        ]

    first = hf_loaders(2, 2)
    seen = take(first[0], 3) + take(first[1], 1)  # inside shards: the resume skips records within them
    state = merge_states([dl.state_dict() for dl in first])
    for dl in hf_loaders(1, 3):
        dl.load_state_dict(state)
        seen += list(dl)
    ids = Counter(row["id"] for batch in seen for row in batch)
    assert sorted(ids) == sorted(f * 100 + i for f, n in enumerate([4, 7, 0, 5]) for i in range(n))
    assert set(ids.values()) == {1}
