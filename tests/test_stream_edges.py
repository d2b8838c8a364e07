"""Edges of streams that the other stream tests do not reach: shards that fail as they are opened or at the end of
a pass, and ranks dealt no shard. Every test counts every record: delivered exactly once, or lost loudly with the
batch that failed, the same whether or not the run was resumed.
"""

import pytest

from loader import ResumableDataLoader, merge_states
from loader.sources.sharded import FileShards
from tests.streams import FORK
from tests.test_sharded_streams import every_record, read_lines, take, write_shards
from tests.test_streams import train_skipping_errors


def opened_at_once(path):
    """A reader that checks its file when called, before any record is drawn: shard 1 fails there."""
    if path.endswith("part-1.txt"):
        raise ValueError(f"{path} has a corrupt header")
    return read_lines(path)


def test_a_shard_that_cannot_be_opened_fails_one_batch_and_the_worker_goes_on(tmp_path):
    paths = write_shards(tmp_path, [4, 3, 6])
    iterator = iter(ResumableDataLoader(FileShards(paths, opened_at_once), batch_size=2, collate_fn=list))
    delivered, errors = [], 0
    for _ in range(20):  # bounded: a worker stuck on the shard fails every batch
        try:
            delivered += next(iterator)
        except StopIteration:
            break
        except ValueError:
            errors += 1
    assert errors == 1 and delivered == every_record([4, 0, 6])  # shard 0 ends on a batch: nothing else is lost


def breaking_in_the_last_shard(path):
    for record in read_lines(path):
        if record == "2:3":
            raise ValueError("corrupt record 2:3")
        yield record


@pytest.mark.parametrize("new_world", [1, 2])
def test_a_resume_after_the_last_shard_failed_does_not_read_the_rest_of_it_again(tmp_path, new_world):
    paths = write_shards(tmp_path, [4, 2, 6])

    def loader(rank=0, world_size=1):
        return ResumableDataLoader(FileShards(paths, breaking_in_the_last_shard), batch_size=2, collate_fn=list,
                                   rank=rank, world_size=world_size)

    reference, errors = train_skipping_errors(loader())
    assert errors == 1  # the batch [2:2, 2:3] fails, and the rest of shard 2 with it
    expected = [r for r in every_record([4, 2, 6]) if r not in {"2:2", "2:3", "2:4", "2:5"}]
    assert sorted(r for batch in reference for r in batch) == expected
    first = loader()
    iterator = iter(first)
    before = [next(iterator) for _ in reference]
    with pytest.raises(ValueError, match="corrupt record 2:3"):
        next(iterator)  # the failed batch is the pass's last: the state after it is the end of the pass
    after, errors = [], 0
    for rank in range(new_world):
        resumed = loader(rank, new_world)
        resumed.load_state_dict(first.state_dict())
        batches, failed = train_skipping_errors(resumed)
        after, errors = after + batches, errors + failed
    assert errors == 0 and after == [] and before == reference


def test_a_rank_dealt_no_shard_saved_before_its_first_batch_resumes_at_another_world_size(tmp_path):
    paths = write_shards(tmp_path, [5, 4])
    first = [ResumableDataLoader(FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank,
                                 world_size=3) for rank in range(3)]
    iterators = [iter(dl) for dl in first]  # rank 2 is dealt no shard: its state names no task
    seen = [next(iterators[0]), next(iterators[1])]
    state = merge_states([dl.state_dict() for dl in first])
    for rank in range(2):
        resumed = ResumableDataLoader(FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank,
                                      world_size=2)
        resumed.load_state_dict(state)
        seen += take(resumed, 10)
    assert sorted(r for batch in seen for r in batch) == every_record([5, 4])


@pytest.mark.parametrize("new_world, new_workers", [(1, 0), (2, 0), (1, 2)])
def test_a_state_after_the_last_record_before_the_end_of_the_pass_ends_that_epoch_at_any_layout(
        tmp_path, new_world, new_workers):
    paths = write_shards(tmp_path, [5, 4])  # 9 records: the last batch is short, its snapshot says the reader ended

    def loader(rank=0, world_size=1, num_workers=0):
        return ResumableDataLoader(FileShards(paths, read_lines), batch_size=2, collate_fn=list, rank=rank,
                                   world_size=world_size, num_workers=num_workers, **(FORK if num_workers else {}))

    first = loader()
    assert len(take(first, 5)) == 5  # every record, and no StopIteration yet: the pass of epoch 0 has not ended
    for rank in range(new_world):
        resumed = loader(rank, new_world, new_workers)
        resumed.load_state_dict(first.state_dict())
        assert list(resumed) == [] and resumed.epoch == 0  # the rest of epoch 0: nothing, as if never stopped
        epoch_1 = [record for batch in resumed for record in batch]
        assert resumed.epoch == 1
        seen = seen + epoch_1 if rank else epoch_1
    assert sorted(seen) == every_record([5, 4])
