"""Indexing shards for a job: split across the ranks of a real gloo group, or prebuilt by `python -m loader index`."""

import os

import torch.distributed as dist

from loader.cli.main import main
from loader.sources import WebDatasetSource, tar_index
from tests.distributed import run_group
from tests.test_webdataset_source import SHARD_SIZES, assert_same, make_dataset, read_all


def _counting(built: list[str]):
    """tar_index.build_index, recording the shards it indexes in `built`."""
    original = tar_index.build_index

    def counting(shard):
        built.append(os.path.basename(shard))
        return original(shard)

    return counting


def _index_job(rank, world_size, directory, cache_dirs):
    built: list[str] = []
    tar_index.build_index = _counting(built)  # a forked rank's own copy of the module
    cache_dir = None if cache_dirs is None else cache_dirs[rank]
    source = WebDatasetSource(directory, group=dist.group.WORLD, cache_dir=cache_dir, progress=False)
    return sorted(built), source.shard_sizes, read_all(source)


def test_ranks_of_a_group_split_the_index_building(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    shards = make_dataset(tmp_path / "data", SHARD_SIZES)
    names = [os.path.basename(s) for s in shards]
    results = run_group(_index_job, 2, str(tmp_path / "data"), None)
    assert [r[0] for r in results] == [sorted(names[0::2]), sorted(names[1::2])]  # each its share, once
    assert results[0][1] == results[1][1] == SHARD_SIZES
    assert_same(results[0][2], results[1][2])


def test_ranks_that_do_not_share_a_cache_build_what_they_cannot_see(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    make_dataset(tmp_path / "data", SHARD_SIZES)
    node_local = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    results = run_group(_index_job, 2, str(tmp_path / "data"), node_local)
    assert all(len(r[0]) == len(SHARD_SIZES) for r in results)  # own share first, the rest after the barrier
    assert_same(results[0][2], results[1][2])


def test_index_command_prebuilds_so_the_job_builds_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    make_dataset(tmp_path / "data", SHARD_SIZES)
    data = str(tmp_path / "data")
    assert main(["index", data, "--jobs", "2"]) == 0
    assert f"{len(SHARD_SIZES)} shards, {sum(SHARD_SIZES)} samples: {len(SHARD_SIZES)} indexes built" in (
        capsys.readouterr().out
    )
    assert main(["index", data, "--jobs", "1"]) == 0
    assert f"0 indexes built, {len(SHARD_SIZES)} already current" in capsys.readouterr().out
    built: list[str] = []
    monkeypatch.setattr(tar_index, "build_index", _counting(built))
    assert WebDatasetSource(data, progress=False).shard_sizes == SHARD_SIZES and built == []
