"""WebDataset shards through ResumableDataLoader: exact resume at another world size, shard-local reads."""

import itertools

import numpy as np
import pytest
import torch

from loader import ResumableDataLoader, merge_states
from loader.sources import WebDatasetSource
from tests.test_webdataset_source import make_dataset

SIZES = [9, 0, 1, 14, 6, 11, 3]  # uneven shards, an empty one, a single-sample one


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    make_dataset(tmp_path / "data", SIZES, seed=1)
    return WebDatasetSource(str(tmp_path / "data"), keys=("__key__", "cls"), progress=False)


def keys_of(batch):
    return [key for key, _ in batch]


def loaders(source, world, **kw):
    return [
        ResumableDataLoader(
            source,
            batch_size=2,
            shuffle=True,
            seed=5,
            shuffle_blocks=source.shard_sizes,
            rank=r,
            world_size=world,
            collate_fn=keys_of,
            **kw,
        )
        for r in range(world)
    ]


def resume_at_another_world_size(source, restarted) -> tuple[list[str], int]:
    """3 ranks deliver unequal amounts of ``source``; 2 ranks of 2 workers each resume ``restarted`` from the merged
    state. Returns the keys delivered in all and the samples the tail rule dropped."""
    seen = []
    first = loaders(source, 3)
    for dl, count in zip(first, (4, 1, 3)):  # unequal progress per rank
        seen += [k for batch in itertools.islice(dl, count) for k in batch]
    state = merge_states([dl.state_dict() for dl in first], uneven=True)
    second = loaders(restarted, 2, num_workers=2, multiprocessing_context="fork")
    for dl in second:
        dl.load_state_dict(state)
        seen += [k for batch in dl for k in batch]
    final = merge_states([dl.state_dict() for dl in second])
    return seen, sum(b - a for a, b in zip(*[iter(final["finished"][0]["dropped"])] * 2))


def test_resume_over_shards_at_another_world_size_delivers_every_key_once(source):
    seen, dropped = resume_at_another_world_size(source, source)
    keys = {source.sample_key(i)[1] for i in range(len(source))}
    assert len(seen) == len(set(seen)) == len(source) - dropped and set(seen) <= keys
    assert dropped < 2


def test_block_order_reads_one_shard_at_a_time(source):
    (dl,) = loaders(source, 1)
    order = [int(i) for batch in dl.resumable_sampler for i in batch]  # the indices, in delivery order
    starts = np.cumsum([0] + SIZES)
    shard_of = np.searchsorted(starts, order, side="right") - 1
    switches = int((shard_of[1:] != shard_of[:-1]).sum())
    assert switches == sum(1 for s in SIZES if s) - 1  # each non-empty shard is read in one run


def test_same_seed_same_batches_with_and_without_workers(source):
    (a,) = loaders(source, 1)
    (b,) = loaders(source, 1, num_workers=2, multiprocessing_context="spawn")
    assert list(a) == list(b)


def test_a_changed_dataset_is_refused_by_the_state(source, tmp_path):
    (dl,) = loaders(source, 1)
    next(iter(dl))
    state = dl.state_dict()
    make_dataset(tmp_path / "other", [9, 0, 1, 14, 6, 11, 4])
    other = WebDatasetSource(str(tmp_path / "other"), keys=("__key__", "cls"), progress=False)
    (fresh,) = loaders(other, 1)
    with pytest.raises(ValueError, match="num_samples is 44 in the saved state but 45"):
        fresh.load_state_dict(state)


def test_the_audit_names_offending_samples_by_shard_and_key(source, tmp_path, capsys):
    from loader.checkpoint.ledger import Ledger
    from loader.cli.main import main as cli

    ledger = Ledger.open(tmp_path / "run", 0, len(source))
    ledger.record(0, np.array([3, 3]), True)
    ledger.close()
    assert cli(["audit", str(tmp_path / "run"), "--shards", str(tmp_path / "data")]) == 1
    shard, key = source.sample_key(3)
    assert f"duplicated indices: 3 (train-000000.tar:{key})" in capsys.readouterr().out and shard.endswith("000000.tar")


def test_a_checkpoint_of_other_shards_is_refused(source, tmp_path):
    import shutil

    from loader.checkpoint.publish import CheckpointError
    from loader.checkpoint.save import load_checkpoint, save_checkpoint

    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (dl,) = loaders(source, 1)
    path = save_checkpoint(tmp_path / "run", 1, model=model, optimizer=optimizer, loader=dl)
    renamed = tmp_path / "renamed"
    shutil.copytree(tmp_path / "data", renamed)
    (renamed / "train-000003.tar").rename(renamed / "train-000003b.tar")  # same sizes, another shard name
    (other,) = loaders(WebDatasetSource(str(renamed), keys=("__key__", "cls"), progress=False), 1)
    with pytest.raises(CheckpointError, match="dataset fingerprint .* shards .* changed"):
        load_checkpoint(path, model=model, optimizer=optimizer, loader=other)
