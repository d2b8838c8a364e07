"""Remote shards against real loopback servers (moto's S3 server, an HTTP server with Range): equality with
webdataset, exact resume at another world size, the cache limit, plan-driven prefetch, changed shards, faults."""

from __future__ import annotations

import gc
import glob
import itertools
import json
import logging
import os
import pickle
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlparse

import numpy as np
import pytest

pytest.importorskip("s3fs", reason='the remote-shard tests need s3fs and moto\'s S3 server: pip install -e ".[test]"')
pytest.importorskip(
    "moto.server", reason='the remote-shard tests need s3fs and moto\'s S3 server: pip install -e ".[test]"'
)

import fsspec  # noqa: E402
import webdataset as wds  # noqa: E402

from loader import ResumableDataLoader  # noqa: E402
from loader.cli.main import main as cli  # noqa: E402
from loader.sources import DiskFullError, ShardUnavailableError, StaleIndexError, WebDatasetSource  # noqa: E402
from loader.sources import remote as remote_module  # noqa: E402
from tests.servers import cutting_proxy, http_server, moto_server, s3_options, upload  # noqa: E402
from tests.test_remote_cache import du  # noqa: E402
from tests.test_webdataset_loader import loaders, resume_at_another_world_size  # noqa: E402
from tests.test_webdataset_source import assert_same, reference  # noqa: E402

SAMPLES, PER_SHARD = 46, 8  # ShardWriter: 5 shards of 8, one of 6
SHARDS = -(-SAMPLES // PER_SHARD)
BLOCK = 4096  # the file system's allocation unit here
KEYS = ("__key__", "cls")


def write_shards(directory, samples: int, per_shard: int, npy_bytes: int, seed: int = 0) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    with wds.ShardWriter(os.path.join(directory, "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(samples):
            sink.write(
                {
                    "__key__": f"k{i:05d}",
                    "npy": rng.integers(0, 256, npy_bytes, dtype=np.uint8),
                    "cls": i % 10,
                    "txt": f"sample {i}",
                }
            )
    return sorted(glob.glob(os.path.join(directory, "train-*.tar")))


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("shards"))
    write_shards(directory, SAMPLES, PER_SHARD, 1024)
    return directory


@pytest.fixture(scope="module")
def s3(shard_dir):
    with moto_server() as endpoint:
        options = s3_options(endpoint)
        fs, _ = fsspec.url_to_fs("s3://train", **options)
        upload(fs, shard_dir, "train")
        yield SimpleNamespace(options=options, fs=fs, pattern=f"s3://train/train-{{000000..{SHARDS - 1:06d}}}.tar")


@pytest.fixture(scope="module")
def http(shard_dir):
    with http_server(shard_dir) as server:
        yield server


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(remote_module, "RETRY_DELAY_S", 0.01)


def remote_source(s3, tmp_path, pattern=None, **kw) -> WebDatasetSource:
    kw = {
        "keys": KEYS,
        "cache_dir": tmp_path / "cache",
        "cache_limit": "10MB",
        "progress": False,
        "storage_options": s3.options,
        **kw,
    }
    return WebDatasetSource(pattern or s3.pattern, **kw)


def new_bucket(s3, name: str, directory: str) -> str:
    upload(s3.fs, directory, name)
    count = len(glob.glob(os.path.join(directory, "*.tar")))
    return f"s3://{name}/train-{{000000..{count - 1:06d}}}.tar"


def shards_of_cache(directory, shards: float) -> int:
    """A cache_limit of ``shards`` of the largest shards (each in whole blocks, and a block for its checksum) and
    two blocks for the cache's own files (the counters, a plan)."""
    largest = max(os.path.getsize(p) for p in glob.glob(os.path.join(directory, "*.tar")))
    return int(shards * (-(-largest // BLOCK) + 1) * BLOCK) + 2 * BLOCK


def minimum(directory, prefetch: int) -> int:
    """The smallest cache_limit a source accepts: prefetch + 2 of the largest shards."""
    return shards_of_cache(directory, prefetch + 2)


def shard_names(directory) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.tar")))


def dataset_bytes(directory) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(directory, "*.tar")))


# --- equality -------------------------------------------------------------------------------------------------


def test_a_shuffle_false_pass_over_s3_equals_webdataset(s3, shard_dir, tmp_path):
    source = remote_source(s3, tmp_path, keys=None, decode=())
    ours = list(ResumableDataLoader(source, batch_size=None, shuffle=False, collate_fn=lambda sample: sample))
    names = shard_names(shard_dir)
    signed = [s3.fs.sign(f"train/{name}") for name in names]  # webdataset streams S3 over HTTP (curl)
    expected = reference(signed, ("decode", ()))
    assert len(ours) == len(expected) == SAMPLES
    assert [s.pop("__url__") for s in ours] == [f"s3://train/{names[i // PER_SHARD]}" for i in range(SAMPLES)]
    for sample in expected:
        del sample["__url__"]
    assert_same(ours, expected)


def test_a_shuffle_false_pass_over_http_equals_webdataset(http, shard_dir, tmp_path):
    urls = [f"{http.url}/{name}" for name in shard_names(shard_dir)]
    source = WebDatasetSource(urls, decode=(), cache_dir=tmp_path / "c", cache_limit="1MB", progress=False)
    ours = list(ResumableDataLoader(source, batch_size=None, shuffle=False, collate_fn=lambda sample: sample))
    assert_same(ours, reference(urls, ("decode", ())))


def test_remote_and_local_shards_give_the_same_batches(s3, shard_dir, tmp_path):
    local = WebDatasetSource(shard_dir, keys=KEYS, progress=False)
    (remote,) = loaders(remote_source(s3, tmp_path), 1, num_workers=2, multiprocessing_context="fork")
    assert list(remote) == list(loaders(local, 1)[0])


# --- exact resume --------------------------------------------------------------------------------------------


def test_exact_resume_at_another_world_size_with_two_workers(s3, tmp_path):
    source = remote_source(s3, tmp_path)
    seen, dropped = resume_at_another_world_size(source, remote_source(s3, tmp_path))  # a new job: same cache
    assert len(seen) == len(set(seen)) == SAMPLES - dropped and dropped < 2
    assert set(seen) <= {source.sample_key(i)[1] for i in range(SAMPLES)}


def test_a_restart_resumes_with_a_warm_cache(s3, tmp_path):
    (dl,) = loaders(remote_source(s3, tmp_path), 1)
    seen = [k for batch in itertools.islice(dl, 11) for k in batch]
    state = dl.state_dict()
    (resumed,) = loaders(source := remote_source(s3, tmp_path), 1)
    before = source.cache_stats()
    resumed.load_state_dict(state)
    seen += [k for batch in resumed for k in batch]
    assert sorted(seen) == sorted(source.sample_key(i)[1] for i in range(SAMPLES))
    after = source.cache_stats()
    assert before["downloads"] >= 3  # the first run's shards (and those it prefetched) are cached...
    assert after["downloads"] == SHARDS  # ...and the restart downloads only the others: each shard once in all
    assert after["indexes_built"] == before["indexes_built"] == SHARDS  # nor is anything indexed again


# --- the cache limit and prefetch by the plan ----------------------------------------------------------------


def test_the_cache_limit_holds_and_each_shard_is_downloaded_once_per_epoch(s3, shard_dir, tmp_path, monkeypatch):
    limit = minimum(shard_dir, prefetch=2)  # the shard read, the next and two ahead: 4 of the 6 shards
    source = remote_source(s3, tmp_path, cache_limit=limit)
    measured = str(tmp_path / "measured.txt")
    cache_dir = str(tmp_path / "cache")
    download = remote_module.RemoteShards.download

    def measuring(self, shard, index, dest):  # the whole cache, each time a copy is complete (before its rename)
        download(self, shard, index, dest)
        with open(measured, "a") as f:
            f.write(f"{du(cache_dir)}\n")

    monkeypatch.setattr(remote_module.RemoteShards, "download", measuring)  # forked workers inherit it
    peaks, stop = [], threading.Event()

    def sample() -> None:  # and every millisecond in between
        while not stop.wait(0.001):
            peaks.append(du(cache_dir))

    sampler = threading.Thread(target=sample)
    sampler.start()
    (dl,) = loaders(source, 1, num_workers=2, multiprocessing_context="fork")
    per_epoch = []
    try:
        for _ in range(2):
            before = source.cache_stats().get("downloaded_bytes", 0)
            keys = [k for batch in dl for k in batch]
            assert sorted(keys) == sorted(source.sample_key(i)[1] for i in range(SAMPLES))
            per_epoch.append(source.cache_stats()["downloaded_bytes"] - before)
    finally:
        stop.set()
        sampler.join(timeout=10)
    with open(measured) as f:
        at_downloads = [int(line) for line in f]
    assert max(at_downloads + peaks) <= limit
    total = dataset_bytes(shard_dir)
    assert per_epoch[0] == total and per_epoch[1] <= total  # each shard once an epoch (some stay cached across)


def test_with_lanes_each_node_downloads_its_share_of_the_shards(s3, shard_dir, tmp_path):
    """Two nodes of one rank, each with its own cache no larger than a few shards: with lanes=2 each downloads
    about half of the dataset per epoch (the shard a lane boundary cuts, both), without lanes each all of it."""
    total, largest = dataset_bytes(shard_dir), max(os.path.getsize(p) for p in glob.glob(f"{shard_dir}/*.tar"))
    limit = minimum(shard_dir, prefetch=2)
    for lanes in (2, None):
        nodes = [remote_source(s3, tmp_path / f"{lanes}-node{r}", cache_limit=limit) for r in range(2)]
        ranks = [
            loaders(source, 2, lanes=lanes, num_workers=2, multiprocessing_context="fork")[r]
            for r, source in enumerate(nodes)
        ]
        keys = [k for dl in ranks for batch in dl for k in batch]
        assert sorted(keys) == sorted(nodes[0].sample_key(i)[1] for i in range(SAMPLES))  # each exactly once
        downloaded = [source.cache_stats()["downloaded_bytes"] for source in nodes]
        if lanes:
            assert all(total / 2 - largest <= d <= total / 2 + largest for d in downloaded), (downloaded, total)
        else:
            assert downloaded == [total, total]


def test_a_cache_of_two_and_a_half_shards_never_stalls_a_reader_on_its_own_pins(s3, shard_dir, tmp_path):
    """One process keeps 2 copies open: needing a third, it waited for room its own pins held (300 s, then
    CacheFullError). It releases them first now."""
    source = remote_source(s3, tmp_path, cache_limit=shards_of_cache(shard_dir, 2.5), prefetch=0)
    source._remote.cache.wait_s = 3.0  # a stall fails in 3 s, not 300
    (dl,) = loaders(source, 1)
    keys = [k for batch in dl for k in batch]
    assert sorted(keys) == sorted(source.sample_key(i)[1] for i in range(SAMPLES))  # each exactly once
    assert source.cache_stats()["downloads"] >= SHARDS


@pytest.mark.parametrize("workers, local_ranks", [(2, 1), (0, 2)])
def test_a_cache_that_could_stall_the_node_s_readers_is_refused_at_iter(
    s3, shard_dir, tmp_path, monkeypatch, workers, local_ranks
):
    """Two readers on the node: one may keep 2 copies open while idle (its next batch waits on the other's), the
    other needs room for one: 2.5 shards stalled both for 300 s. Refused at iter() now, naming the 3 shards that
    never stall; those work."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    kw = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    source = remote_source(s3, tmp_path, cache_limit=shards_of_cache(shard_dir, 2.5), prefetch=0)
    source._remote.cache.wait_s = 3.0
    (dl,) = loaders(source, 1, **kw)
    least = shards_of_cache(shard_dir, 3)
    refused = rf"of the 2 processes reading remote shards .* at least .*\({least} bytes\)"
    with pytest.raises(ValueError, match=refused):
        iter(dl)
    source = remote_source(s3, tmp_path / "enough", cache_limit=least, prefetch=0)
    source._remote.cache.wait_s = 3.0
    (dl,) = loaders(source, 1, **kw)
    keys = [k for batch in dl for k in batch]
    assert sorted(keys) == sorted(source.sample_key(i)[1] for i in range(SAMPLES))  # each exactly once


def test_a_cache_too_small_for_the_shards_in_flight_is_refused(s3, shard_dir, tmp_path):
    least = minimum(shard_dir, prefetch=3)
    with pytest.raises(ValueError, match=rf"prefetch=3 more .* at least .*\({least} bytes\)"):
        remote_source(s3, tmp_path, cache_limit=least - 1, prefetch=3)
    assert remote_source(s3, tmp_path, cache_limit=least, prefetch=3).shard_sizes[0] == PER_SHARD


# --- identity: indexes from headers, changed shards, damaged copies ------------------------------------------


def test_the_index_reads_headers_only_and_can_be_stored_next_to_the_shards(s3, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(remote_module, "INDEX_READ_BYTES", 64 << 10)
    write_shards(tmp_path / "large", 8, 4, 1 << 20)  # members of 1 MiB: indexing skips most of their bytes
    pattern = new_bucket(s3, "large", str(tmp_path / "large"))
    source = remote_source(s3, tmp_path, pattern, cache_limit="20MB")
    stats, total = source.cache_stats(), dataset_bytes(tmp_path / "large")
    assert stats["indexes_built"] == 2 and stats["index_bytes"] < 0.1 * total and "downloads" not in stats
    options = json.dumps(s3.options)
    assert cli(["index", pattern, "--storage-options", options]) == 0
    assert "2 shards, 8 samples: 2 indexes built" in capsys.readouterr().out
    assert s3.fs.exists("large/train-000000.tar.idx.npz")
    later = remote_source(s3, tmp_path / "later", pattern, cache_limit="20MB")  # another node: an empty cache
    assert later.shard_sizes == [4, 4] and "indexes_built" not in later.cache_stats()
    assert later[5] == source[5]


def test_a_shard_changed_on_the_server_is_refused_even_with_an_old_copy_cached(s3, shard_dir, tmp_path):
    """A copy made in this run (its cache opened before it) was checked against the server when it was made: the
    run's workers read it as indexed. One made before a restart is checked again (a HEAD request), and a shard
    never downloaded is checked before its copy is made: a changed shard is refused there, naming its URL."""
    pattern = new_bucket(s3, "changing", shard_dir)
    source = remote_source(s3, tmp_path, pattern, keys=("cls", "txt"), decode=())
    source._remote.cache.opened_ns -= 10**9  # opened a second ago: a file's time is a clock tick coarse
    original = source[0]  # shard 0 is downloaded and cached
    for shard in ("train-000000.tar", "train-000001.tar"):  # same size and tar headers, one byte of a member
        data = bytearray(s3.fs.cat_file(f"changing/{shard}"))
        at = data.index(b"sample ")
        data[at] = ord("S")
        s3.fs.pipe_file(f"changing/{shard}", bytes(data))
    worker = pickle.loads(pickle.dumps(source))  # a worker opening shard 0 now; the run's copy is in the cache
    assert worker[0] == original and "damaged_copies" not in worker.cache_stats()  # the indexed version's bytes
    with pytest.raises(StaleIndexError, match="s3://changing/train-000001.tar changed on the server"):
        worker[PER_SHARD]  # never downloaded: refused before its copy is made
    restarted = pickle.loads(pickle.dumps(source))
    restarted._remote.cache.opened_ns = time.time_ns()  # as a restart's cache, opened after the copy was made
    with pytest.raises(StaleIndexError, match="s3://changing/train-000000.tar changed on the server"):
        restarted[0]
    fresh = remote_source(s3, tmp_path, pattern, keys=("cls", "txt"), decode=())  # indexes the new versions
    assert fresh[0] == (original[0], "Sample 0") and original[1] == "sample 0"


def _copy_of(tmp_path, shard: str) -> str:
    (path,) = glob.glob(str(tmp_path / "cache" / "shards" / f"{shard}.*"))
    return path


def test_damaged_or_truncated_copies_are_fetched_again(s3, tmp_path):
    source = remote_source(s3, tmp_path, keys=None)
    expected = [source[i] for i in range(SAMPLES)]
    downloads = source.cache_stats()["downloads"]
    truncated = _copy_of(tmp_path, "train-000000.tar")
    st = os.stat(truncated)
    os.truncate(truncated, st.st_size - 512)
    damaged = _copy_of(tmp_path, "train-000002.tar")
    with open(damaged, "r+b") as f:  # a flipped bit in the first member's header: same size and mtime
        f.seek(3)
        f.write(bytes([f.read(1)[0] ^ 1]))
    os.utime(damaged, ns=(st.st_mtime_ns, st.st_mtime_ns))
    worker = pickle.loads(pickle.dumps(source))  # opens every copy afresh
    assert_same([worker[i] for i in range(SAMPLES)], expected)
    assert source.cache_stats()["downloads"] == downloads + 2


def test_a_copy_damaged_while_open_is_fetched_again(s3, tmp_path, caplog):
    source = remote_source(s3, tmp_path, keys=None)
    expected = [source[PER_SHARD + i] for i in range(PER_SHARD)]  # shard 1's copy is open in this process now
    member = source._indexes[1].members(3)[0]
    with open(_copy_of(tmp_path, "train-000001.tar"), "r+b") as f:  # the header of sample 3's first member
        f.seek(member.header_offset)
        f.write(b"\xff" * 100)
    with caplog.at_level(logging.WARNING, logger="loader.sources.remote"):
        again = [source[PER_SHARD + i] for i in range(PER_SHARD)]
    assert_same(again, expected)
    assert "a read of the cached copy of s3://train/train-000001.tar failed its checks" in caplog.text
    assert source.cache_stats()["downloads"] == 2  # shard 1, then its copy again


def test_a_copy_whose_bytes_rot_on_disk_is_fetched_again(s3, tmp_path, caplog):
    """Same size, mtime and tar headers, one byte of a member's data changed: a process opening the copy afresh
    checks its checksum, discards it and downloads it again, never serving the rotten bytes."""
    source = remote_source(s3, tmp_path, keys=("cls", "txt"), decode=())
    expected = [source[i] for i in range(SAMPLES)]
    downloads = source.cache_stats()["downloads"]
    rotten = _copy_of(tmp_path, "train-000002.tar")
    st = os.stat(rotten)
    with open(rotten, "r+b") as f:
        data = f.read()
        f.seek(data.index(b"sample 17"))
        f.write(b"Sample 17")
    os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))
    worker = pickle.loads(pickle.dumps(source))  # another process: opens every copy afresh
    with caplog.at_level(logging.WARNING, logger="loader.sources.remote"):
        assert [worker[i] for i in range(SAMPLES)] == expected
    assert "damaged, rotten or truncated" in caplog.text
    stats = source.cache_stats()
    assert stats["downloads"] == downloads + 1 and stats["damaged_copies"] == 1


# --- faults ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_dir(tmp_path_factory) -> str:
    """2 shards of 2 samples with 300 KB members: a transfer long enough to cut in the middle."""
    directory = str(tmp_path_factory.mktemp("large"))
    write_shards(directory, 4, 2, 300_000, seed=1)
    return directory


@pytest.fixture(params=["s3", "http"])
def behind_proxy(request, s3, large_dir):
    """The large shards behind a proxy that cuts connections: on moto's S3 server (botocore: the next request
    fails with EndpointConnectionError) or on the HTTP server (aiohttp: ClientPayloadError)."""
    if request.param == "s3":
        upload(s3.fs, large_dir, "large-cut")
        port = urlparse(s3.options["endpoint_url"]).port
        with cutting_proxy(port) as proxy:
            options = s3_options(proxy.url, retries={"total_max_attempts": 1})  # botocore's own retries: none
            yield proxy, "s3://large-cut/train-{000000..000001}.tar", options
    else:
        with http_server(large_dir) as server, cutting_proxy(server.server_address[1]) as proxy:
            yield proxy, [f"{proxy.url}/{name}" for name in shard_names(large_dir)], {}


def test_a_connection_lost_in_the_middle_of_a_download_is_retried(
    behind_proxy, large_dir, tmp_path, caplog, monkeypatch
):
    """The server goes down 200 KB into a 600 KB shard and stays down for 1 s: the download starts again once it is
    back (retries of 0.25, 0.5, 1 s...), and the copy served is the whole shard."""
    monkeypatch.setattr(remote_module, "RETRY_DELAY_S", 0.25)
    proxy, urls, options = behind_proxy
    source = WebDatasetSource(
        urls,
        keys=None,
        decode=(),
        storage_options=options,
        cache_dir=tmp_path / "c",
        cache_limit="10MB",
        progress=False,
    )
    expected = [WebDatasetSource(large_dir, keys=None, decode=(), progress=False)[i] for i in range(4)]
    proxy.cut(200_000, 1.0)
    with caplog.at_level(logging.WARNING, logger="loader.sources.remote"):
        got = [source[i] for i in range(4)]
    assert proxy.cuts == 1
    for sample, want in zip(got, expected):
        assert sample.pop("__url__") in (
            urls if isinstance(urls, list) else [f"s3://large-cut/{n}" for n in shard_names(large_dir)]
        )
        del want["__url__"], want["__local_path__"]
        assert_same(sample, want)
    retried = [r.getMessage() for r in caplog.records if "downloading" in r.getMessage() and "retry" in r.getMessage()]
    assert retried
    assert source.cache_stats()["downloads"] == 2  # each shard once: the cut transfer left no copy
    assert os.listdir(tmp_path / "c" / "partial") == []


def test_a_full_cache_disk_is_reported_as_such_and_not_retried(s3, tmp_path, caplog, monkeypatch):
    """The download written to /dev/full (every write: ENOSPC): no retry as a network fault, but an error naming
    the cache's directory, the bytes needed and free, and what to do; the partial download is gone."""
    if not os.path.exists("/dev/full"):
        pytest.skip(
            "this system has no /dev/full (the Linux device whose every write fails with ENOSPC), the "
            "real full disk this test writes to; Linux CI has it"
        )
    source = remote_source(s3, tmp_path)
    full = tmp_path / "full"
    full.symlink_to("/dev/full")
    download = remote_module.RemoteShards._download

    def onto_a_full_disk(self, shard, index, dest, deadline):
        return download(self, shard, index, str(full), deadline)

    monkeypatch.setattr(remote_module.RemoteShards, "_download", onto_a_full_disk)
    with caplog.at_level(logging.WARNING, logger="loader.sources.remote"):
        with pytest.raises(DiskFullError, match=r"disk under the cache .*cache is full .* needs .* free.*cache_dir"):
            source[0]
    assert not [r for r in caplog.records if "retry" in r.getMessage()]
    assert os.listdir(tmp_path / "cache" / "partial") == []


def test_a_server_that_never_answers_is_given_up_at_the_deadline(s3, shard_dir, tmp_path, monkeypatch):
    """No answer reaches the client: botocore's read_timeout (60 s) times its attempts times s3fs's retries made it
    about 75 min; every attempt is cut at the deadline (2 s here, 300 s by default), and the error says so."""
    port = urlparse(s3.options["endpoint_url"]).port
    with cutting_proxy(port) as proxy:
        source = remote_source(s3, tmp_path, storage_options=s3_options(proxy.url))
        monkeypatch.setattr(remote_module, "RETRY_DEADLINE_S", 2.0)  # after the build: a loaded machine's build
        proxy.hold()  # took 2 s (its look-ups' first connections) and failed here
        outcome = []
        reader = threading.Thread(target=lambda: outcome.append(_raised(lambda: source[0])), daemon=True)
        reader.start()
        reader.join(timeout=60)  # bounded even where the deadline does not hold
        assert outcome, "the read was still waiting for the server after 60 s"
        assert proxy.withheld > 0  # the server answered; the client never heard
    (error,) = outcome
    assert isinstance(error, ShardUnavailableError), error
    assert "s3://train/train-000000.tar still failed after" in str(error) and "within 2 s" in str(error)


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as exn:  # noqa: BLE001 - handed to the test's thread
        return exn
    return None


def test_transient_errors_and_timeouts_are_retried(http, shard_dir, tmp_path, caplog):
    import aiohttp

    urls = [f"{http.url}/{name}" for name in shard_names(shard_dir)]
    options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=0.5)}}
    http.fail(2)
    http.stall(1, 1.5)
    with caplog.at_level(logging.WARNING, logger="loader.sources.remote"):
        source = WebDatasetSource(
            urls, keys=KEYS, storage_options=options, cache_dir=tmp_path / "c", cache_limit="1MB", progress=False
        )
        http.fail(3)
        keys = [source[i][0] for i in range(SAMPLES)]
    assert keys == [f"k{i:05d}" for i in range(SAMPLES)] and http.take_fault() is None  # every fault was met
    retried = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert retried and all(http.url in message for message in retried)


def test_workers_forked_from_a_reading_process_leave_its_connections_alone(http, shard_dir, tmp_path, caplog):
    """A forked worker drops the parent's fsspec instances; closing their sessions there took the parent's
    sockets out of the parent's event loop, and its next request on them hung until the timeout (aiohttp's 300 s
    by default; 5 s here, then a logged retry)."""
    import aiohttp

    urls = [f"{http.url}/{name}" for name in shard_names(shard_dir)]
    options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=5)}}
    source = WebDatasetSource(
        urls, keys=KEYS, storage_options=options, cache_dir=tmp_path / "c", cache_limit="1MB", progress=False
    )  # the parent reads: connections kept alive
    (dl,) = loaders(source, 1, num_workers=2, multiprocessing_context="fork", worker_init_fn=_collect_garbage)
    assert sorted(k for batch in dl for k in batch) == sorted(source.sample_key(i)[1] for i in range(SAMPLES))
    with caplog.at_level(logging.WARNING, logger="loader.sources.remote"):
        again = WebDatasetSource(
            urls, keys=KEYS, storage_options=options, cache_dir=tmp_path / "c2", cache_limit="1MB", progress=False
        )  # the parent's pooled connections again
    assert again.shard_sizes == source.shard_sizes
    assert not [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]


def _collect_garbage(worker_id: int) -> None:
    gc.collect()  # what a worker's allocations soon do: frees what it inherited and no longer references


def test_a_shard_that_stays_unavailable_fails_naming_its_url(http, shard_dir, tmp_path):
    urls = [f"{http.url}/{name}" for name in shard_names(shard_dir)]
    source = WebDatasetSource(urls, keys=KEYS, cache_dir=tmp_path / "c", cache_limit="1MB", progress=False, retries=2)
    http.fail(100)
    try:
        with pytest.raises(ShardUnavailableError, match=f"{urls[0]} still failed after 3 attempts"):
            source[0]
    finally:
        http.clear_faults()
    assert source[0][0] == "k00000"  # the server is back: the same source reads again


def test_a_missing_shard_fails_naming_its_url(s3, http, tmp_path):
    with pytest.raises(ShardUnavailableError, match="s3://train/train-999999.tar"):
        remote_source(s3, tmp_path, "s3://train/train-999999.tar")
    with pytest.raises(ShardUnavailableError, match=f"{http.url}/nope.tar"):
        WebDatasetSource(f"{http.url}/nope.tar", cache_dir=tmp_path / "c", cache_limit="1MB", progress=False)
