"""WebDatasetSource: random access over tar shards must agree with webdataset's own streaming reader."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import random
import shutil
import tarfile
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.sources import tar_index
from loader.sources import webdataset as source_module
from loader.sources.webdataset import MissingKeyError, ShardFormatError, StaleIndexError, WebDatasetSource

SHARD_SIZES = [5, 0, 1, 3, 7]  # uneven, an empty shard, a single-sample shard


def write_shard(path, samples) -> str:
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return str(path)


def make_samples(shard: int, count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "__key__": f"s{shard:02d}_{i:03d}",
            "npy": rng.integers(0, 256, (4, 3, 3), dtype=np.uint8),
            "cls": int(rng.integers(0, 10)),
            "txt": f"sample {i} of shard {shard}",
        }
        for i in range(count)
    ]


def make_dataset(directory, sizes, seed=0) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    return [
        write_shard(directory / f"train-{n:06d}.tar", make_samples(n, size, seed + n)) for n, size in enumerate(sizes)
    ]


@pytest.fixture
def shards(tmp_path) -> list[str]:
    return make_dataset(tmp_path / "data", SHARD_SIZES)


@pytest.fixture(autouse=True)
def private_cache_home(tmp_path, monkeypatch):
    """Keep the fallback index cache out of the real home directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture
def count_builds(monkeypatch) -> list[str]:
    built: list[str] = []
    original = tar_index.build_index

    def counting(shard):
        built.append(os.path.basename(shard))
        return original(shard)

    monkeypatch.setattr(tar_index, "build_index", counting)
    return built


def reference(urls, *stages) -> list:
    """What webdataset itself yields for ``urls`` with the given (method, args) stages applied."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    for method, args in stages:
        pipeline = getattr(pipeline, method)(*args)
    return list(pipeline)


def assert_same(a, b) -> None:
    """Deep equality that understands numpy arrays and tensors."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def read_all(source) -> list:
    return [source[i] for i in range(len(source))]


def upper_txt(key, data):
    """A user handler callable, as WebDataset.decode accepts."""
    return data.decode().upper() if key.endswith("txt") else None


# --- equality with webdataset ---------------------------------------------------------------


@pytest.mark.parametrize(
    "decode, stages",
    [
        (None, []),
        ((), [("decode", ())]),
        (upper_txt, [("decode", (upper_txt,))]),
        ([upper_txt, wds.handle_extension("cls", lambda b: -int(b))], None),
    ],
)
@pytest.mark.parametrize("keys", [None, ("npy", "cls"), "txt __key__ cls"])
def test_matches_webdataset(shards, decode, stages, keys):
    if stages is None:
        stages = [("decode", tuple(decode))]
    if keys is not None:
        stages = stages + [("to_tuple", tuple(keys.split()) if isinstance(keys, str) else keys)]
    expected = reference(shards, *stages)
    source = WebDatasetSource(shards, decode=decode, keys=keys)
    assert len(source) == len(expected) == sum(SHARD_SIZES)
    assert_same(read_all(source), expected)


def test_shard_list_forms_agree(shards, tmp_path):
    pattern = str(tmp_path / "data" / "train-{000000..000004}.tar")
    by_pattern = WebDatasetSource(pattern)
    by_dir = WebDatasetSource(tmp_path / "data")
    by_list = WebDatasetSource([tmp_path / "data" / os.path.basename(s) for s in shards])
    for source in (by_pattern, by_dir, by_list):
        assert source.shards == shards
        assert source.shard_sizes == SHARD_SIZES
    assert_same(read_all(by_pattern), reference(pattern))


def test_sample_keys_and_order(shards):
    source = WebDatasetSource(shards)
    expected = [(s, f"s{n:02d}_{i:03d}") for n, (s, size) in enumerate(zip(shards, SHARD_SIZES)) for i in range(size)]
    assert [source.sample_key(i) for i in range(len(source))] == expected
    assert [(d["__url__"], d["__key__"]) for d in read_all(source)] == expected
    assert source.sample_key(np.int64(5)) == (shards[2], "s02_000")  # samplers may hand out numpy ints
    for bad in (-1, len(source)):
        with pytest.raises(IndexError, match="out of range"):
            source[bad]


def test_image_spec_decoding(tmp_path):
    rng = np.random.default_rng(1)
    images = [{"__key__": f"k{i}", "png": rng.integers(0, 256, (5, 4, 3), dtype=np.uint8), "cls": i} for i in range(4)]
    shard = write_shard(tmp_path / "img.tar", images)
    source = WebDatasetSource(shard, decode="torchrgb", keys="png;jpg cls")
    assert_same(read_all(source), reference(shard, ("decode", ("torchrgb",)), ("to_tuple", ("png;jpg", "cls"))))


def _raw_tar(path, entries, fmt=tarfile.PAX_FORMAT) -> str:
    """A tar with exactly the given (name, payload or tar type) entries, bypassing TarWriter's naming."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, payload in entries:
            info = tarfile.TarInfo(name)
            if isinstance(payload, bytes):
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.type = payload
                info.linkname = "target" if payload in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
                tar.addfile(info)
    return str(path)


NAMING_CASES = [
    ("dir/sub/a.jpg", b"1"),
    ("dir/sub/a.JSON", b"2"),  # suffixes are lower-cased
    ("dir/sub/a.seg.png", b"3"),  # split at the first dot of the basename
    ("dir/sub", tarfile.DIRTYPE),
    ("dir/sub/link.txt", tarfile.SYMTYPE),
    ("dir/sub/hard.txt", tarfile.LNKTYPE),
    ("README", b"no dot: skipped"),
    ("__meta__", b"metadata: skipped"),
    ("x/__cache__/b.txt", b"kept: skip_meta only matches at the start"),
    ("__meta__.json", b"a sample keyed __meta__"),
    ("v1.2/b.txt", b"dots in directories"),
    ("é/ünï.cödé.TXT", "ünïcode".encode()),
    ("d" * 120 + "/long.txt", b"long name"),
    ("e/" + "f" * 130 + ".txt", b"long basename"),
    ("a.jpg", b""),  # empty member
]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_tar_naming_rules_match_webdataset(tmp_path, fmt):
    shard = _raw_tar(tmp_path / "names.tar", NAMING_CASES, fmt)
    assert_same(read_all(WebDatasetSource(shard)), reference(shard))


def test_ustar_prefix_names_match_webdataset(tmp_path):
    entries = [("p" * 60 + "/" + "q" * 60 + f"/k{i}.txt", b"x" * i) for i in range(3)]
    shard = _raw_tar(tmp_path / "ustar.tar", entries, tarfile.USTAR_FORMAT)
    assert_same(read_all(WebDatasetSource(shard)), reference(shard))


def tarfile_members(shard) -> list[tuple[str, int, int, int]]:
    """What tarfile reads of each regular member: name, data offset, size and bytes of header blocks."""
    with tarfile.open(shard) as tar:
        return [(m.name, m.offset_data, m.size, m.offset_data - m.offset) for m in tar if m.isreg()]


def _header(name, size=0, kind=tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def _pax(**records) -> bytes:
    return tarfile.TarInfo._create_pax_generic_header(records, tarfile.XHDTYPE, "utf-8")


def _gnu_long_name(name) -> bytes:
    return tarfile.TarInfo._create_gnu_long_header(name, tarfile.GNUTYPE_LONGNAME, "utf-8", "surrogateescape")


def test_extension_headers_and_v7_directories_match_tarfile(tmp_path):
    """Header combinations tarfile never writes itself but other tar tools do."""
    long_name = "b/long_" + "l" * 110 + ".txt"
    raw = (
        _pax(path="a/pax_wins.txt") + _gnu_long_name("l" * 120 + ".txt") + _header("x.txt", 1) + _padded(b"1")
        + _gnu_long_name(long_name) + _pax(path="pax_loses.txt") + _header("y.txt", 2) + _padded(b"22")
        + _pax(size="5") + _header("sized.txt", 0) + _padded(b"55555")  # pax size beats the header's
        + _header("olddir/", 512, tarfile.AREGTYPE)  # V7 directory: its size field is ignored
        + _header("after.txt", 3) + _padded(b"333")
        + bytes(1024)
    )  # fmt: skip
    shard = tmp_path / "odd.tar"
    shard.write_bytes(raw)
    with open(shard, "rb") as f:
        scanned = list(tar_index.scan_tar(f, str(shard)))
    assert [s[:4] for s in scanned] == tarfile_members(shard)
    assert [m.name for m in scanned] == ["a/pax_wins.txt", long_name, "sized.txt", "after.txt"]
    assert_same(read_all(WebDatasetSource(str(shard))), reference(str(shard)))


def test_global_pax_headers(tmp_path):
    """Harmless global headers (git archive writes a comment) are fine; renaming every member is refused."""
    comment = tarfile.TarInfo._create_pax_generic_header({"comment": "abc"}, tarfile.XGLTYPE, "utf-8")
    rename = tarfile.TarInfo._create_pax_generic_header({"path": "x.txt"}, tarfile.XGLTYPE, "utf-8")
    member = _header("k.txt", 2) + _padded(b"hi") + bytes(1024)
    ok, refused = tmp_path / "ok.tar", tmp_path / "refused.tar"
    ok.write_bytes(comment + member)
    refused.write_bytes(rename + member)
    assert_same(read_all(WebDatasetSource(str(ok))), reference(str(ok)))
    with pytest.raises(ShardFormatError, match="global pax header sets 'path'"):
        WebDatasetSource(str(refused))


def test_zero_length_pax_record_rejected(tmp_path):
    data = b"0 path=x.txt\n"
    shard = tmp_path / "zero-record.tar"
    shard.write_bytes(_header("pax", len(data), tarfile.XHDTYPE) + _padded(data) + _header("k.txt") + bytes(1024))
    with pytest.raises(ShardFormatError, match="zero-length record"):
        WebDatasetSource(str(shard))


MEMBER_NAMES = st.builds(
    lambda dirs, base, exts: "/".join(dirs + [base]) + "".join("." + e for e in exts),
    st.lists(st.sampled_from(["d", "e.f", "Ä" * 70, "__x__"]), max_size=2),
    st.sampled_from(["a", "b", "c", "__k__", "ö" * 90, ""]),
    st.lists(st.sampled_from(["txt", "JPG", "seg", "ünï", ""]), max_size=2),
)


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    members=st.lists(
        st.tuples(MEMBER_NAMES, st.one_of(st.integers(0, 1100), st.sampled_from([tarfile.DIRTYPE, tarfile.SYMTYPE]))),
        max_size=8,
    ),
    fmt=st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]),
)
def test_random_tars_match_tarfile_and_webdataset(members, fmt):
    with tempfile.TemporaryDirectory() as tmp:
        entries = [(name, b"z" * kind if isinstance(kind, int) else kind) for name, kind in members]
        shard = _raw_tar(os.path.join(tmp, "r.tar"), entries, fmt)
        with open(shard, "rb") as f:
            scanned = list(tar_index.scan_tar(f, shard))
        assert [s[:4] for s in scanned] == tarfile_members(shard)
        try:
            expected = reference(shard)
        except ValueError as exn:  # webdataset rejects duplicate suffixes within a sample; so must we
            assert "duplicate" in str(exn)
            with pytest.raises(ShardFormatError, match="two members with suffix|occurs twice"):
                WebDatasetSource(shard, cache_dir=tmp)
            return
        keys = [sample["__key__"] for sample in expected]
        if len(set(keys)) < len(keys):  # webdataset yields a key twice; (shard, key) must name one sample
            with pytest.raises(ShardFormatError, match="occurs twice"):
                WebDatasetSource(shard, cache_dir=tmp)
            return
        assert_same(read_all(WebDatasetSource(shard, cache_dir=tmp)), expected)


# --- keys ---------------------------------------------------------------------------------


def test_key_alternatives_pick_first_present(tmp_path):
    samples = [{"__key__": "a", "png": b"p", "cls": 1}, {"__key__": "b", "jpg": b"j", "png": b"q", "cls": 2}]
    shard = write_shard(tmp_path / "alt.tar", samples)
    source = WebDatasetSource(shard, keys=("jpg;png", "cls"))
    assert read_all(source) == [(b"p", b"1"), (b"j", b"2")]
    assert read_all(source) == reference(shard, ("to_tuple", ("jpg;png", "cls")))


def test_missing_key_names_shard_sample_and_present_keys(shards):
    source = WebDatasetSource(shards, keys=("npy", "jpg;png"))
    with pytest.raises(MissingKeyError) as info:
        source[0]
    message = str(info.value)
    for part in (shards[0], "'s00_000'", "'jpg;png'", "'cls'", "'npy'", "'txt'"):
        assert part in message
    assert isinstance(info.value, KeyError)


def test_keys_read_only_requested_members(shards, monkeypatch):
    source = WebDatasetSource(shards, keys="cls")
    sizes = []
    pread = os.pread

    def recording_pread(fd, size, offset):
        sizes.append(size)
        return pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", recording_pread)
    assert source[0] == (reference(shards[:1])[0]["cls"],)
    assert sizes == [1, 3 * 512]  # the one-digit class label and its pax + ustar headers, not the image or text


def test_empty_keys_rejected(shards):
    with pytest.raises(ValueError, match="keys="):
        WebDatasetSource(shards, keys=())


# --- index cache --------------------------------------------------------------------------


def test_index_cached_next_to_shard_and_reused(shards, count_builds, capsys):
    first = WebDatasetSource(shards)
    assert sorted(count_builds) == sorted(map(os.path.basename, shards))
    assert "indexing WebDataset shards 5/5 (5 built)" in capsys.readouterr().err
    stamps = {s: os.stat(s + ".idx.npz").st_mtime_ns for s in shards}

    count_builds.clear()
    second = WebDatasetSource(shards)
    assert count_builds == []
    assert capsys.readouterr().err == ""
    assert {s: os.stat(s + ".idx.npz").st_mtime_ns for s in shards} == stamps
    assert second.shard_sizes == first.shard_sizes
    assert_same(read_all(second), read_all(first))

    WebDatasetSource(shards, rebuild_index=True)
    assert len(count_builds) == len(shards)


def test_changed_shard_rebuilt_at_construction(shards, count_builds):
    WebDatasetSource(shards)
    count_builds.clear()
    write_shard(shards[3], make_samples(3, 4, seed=99))
    source = WebDatasetSource(shards)
    assert count_builds == [os.path.basename(shards[3])]
    assert source.shard_sizes == [5, 0, 1, 4, 7]
    assert_same(read_all(source), reference(shards))


def test_mtime_only_change_rebuilds(shards, count_builds):
    WebDatasetSource(shards)
    count_builds.clear()
    st_ = os.stat(shards[0])
    os.utime(shards[0], ns=(st_.st_atime_ns, st_.st_mtime_ns + 1))
    WebDatasetSource(shards)
    assert count_builds == [os.path.basename(shards[0])]


def test_cache_dir_keeps_shard_directory_clean(shards, tmp_path, count_builds):
    cache = tmp_path / "index-cache"
    WebDatasetSource(shards, cache_dir=cache)
    assert not any(name.endswith(".npz") for name in os.listdir(os.path.dirname(shards[0])))
    assert len([n for n in os.listdir(cache) if n.endswith(".idx.npz")]) == len(shards)
    count_builds.clear()
    WebDatasetSource(shards, cache_dir=cache)
    assert count_builds == []


def test_same_basename_in_two_directories_gets_two_cache_entries(tmp_path, count_builds):
    a = make_dataset(tmp_path / "a", [2])
    b = make_dataset(tmp_path / "b", [3])
    assert os.path.basename(a[0]) == os.path.basename(b[0])
    cache = tmp_path / "cache"
    WebDatasetSource(a, cache_dir=cache), WebDatasetSource(b, cache_dir=cache)
    count_builds.clear()
    assert WebDatasetSource(a, cache_dir=cache).shard_sizes == [2]
    assert WebDatasetSource(b, cache_dir=cache).shard_sizes == [3]
    assert count_builds == []


def test_unwritable_shard_directory_falls_back_to_user_cache(shards, tmp_path, monkeypatch, count_builds):
    original = tar_index.save_index

    def read_only_dataset_dir(path, index):
        if path.endswith(".tar.idx.npz"):
            raise PermissionError(13, "Permission denied", path)
        original(path, index)

    monkeypatch.setattr(tar_index, "save_index", read_only_dataset_dir)
    WebDatasetSource(shards)
    fallback = tmp_path / "xdg-cache" / "loader" / "webdataset-index"
    assert len(os.listdir(fallback)) == len(shards)
    assert not os.path.exists(shards[0] + ".idx.npz")
    count_builds.clear()
    assert_same(read_all(WebDatasetSource(shards)), reference(shards))
    assert count_builds == []


def test_failed_cache_write_leaves_no_partial_file(shards, tmp_path, monkeypatch):
    def disk_full(file, **arrays):
        file.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.warns(UserWarning, match="could not cache the index"):
        source = WebDatasetSource(shards[:1])
    assert sorted(os.listdir(tmp_path / "data")) == sorted(map(os.path.basename, shards))
    assert os.listdir(tmp_path / "xdg-cache" / "loader" / "webdataset-index") == []
    assert_same(read_all(source), reference(shards[:1]))


def test_corrupt_cache_file_is_rebuilt(shards, count_builds):
    with open(shards[2] + ".idx.npz", "wb") as f:
        f.write(b"not an index")
    source = WebDatasetSource(shards)
    assert os.path.basename(shards[2]) in count_builds
    assert source.shard_sizes == SHARD_SIZES
    count_builds.clear()
    WebDatasetSource(shards)
    assert count_builds == []


# --- stale index at read time ---------------------------------------------------------------


def test_shard_rewritten_before_first_read_is_refused(shards):
    source = WebDatasetSource(shards)
    write_shard(shards[0], make_samples(0, 2, seed=1234))  # shorter: old offsets point past its end
    with pytest.raises(StaleIndexError) as info:
        source[4]
    assert shards[0] in str(info.value) and "rebuild_index=True" in str(info.value)
    rebuilt = WebDatasetSource(shards)  # a new source rebuilds
    assert rebuilt.shard_sizes[0] == 2
    assert_same(read_all(rebuilt), reference(shards))


def test_shard_modified_while_open_is_refused(shards):
    source = WebDatasetSource(shards)
    source[0]  # handle now open
    with open(shards[0], "r+b") as f:
        f.seek(2048)
        f.write(b"garbage")
    st_ = os.stat(shards[0])
    os.utime(shards[0], ns=(st_.st_atime_ns, st_.st_mtime_ns + 1))
    with pytest.raises(StaleIndexError, match="changed after its index was built"):
        source[1]


def test_shard_truncated_while_open_short_read(shards):
    source = WebDatasetSource(shards)
    source[0]
    os.truncate(shards[0], 4096)
    with pytest.raises(ShardFormatError, match="truncated") as info:
        source[4]
    assert shards[0] in str(info.value) and "s00_004" in str(info.value)


# --- replaced with the same size and mtime: mv, cp -p, tar extraction -------------------------


def _mv(shard, other) -> None:
    os.replace(other, shard)


def _cp_p(shard, other) -> None:
    shutil.copy2(other, shard)  # into the existing file: same inode, new bytes, the source's mtime


def _rewrite(shard, other) -> None:
    st_ = os.stat(shard)
    with open(shard, "r+b") as f:
        f.write(Path(other).read_bytes())
    os.utime(shard, ns=(st_.st_atime_ns, st_.st_mtime_ns))


REPLACEMENTS = {"mv": _mv, "cp -p": _cp_p, "rewritten in place": _rewrite}


def replace_keeping_size_and_mtime(shard, how, samples) -> None:
    """Put another shard's bytes (other keys, `samples` of them) at `shard` the way `how` does, size and mtime kept."""
    st_ = os.stat(shard)
    other = write_shard(shard + ".other", make_samples(9, samples, seed=9))
    assert os.path.getsize(other) == st_.st_size
    os.utime(other, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    REPLACEMENTS[how](shard, other)
    assert tar_index.file_state(os.stat(shard)) == tar_index.file_state(st_)


def touch_ctime(path) -> None:
    """Change the ctime alone (chmod to the same mode), as often as the clock's granularity needs for it to move."""
    before = os.stat(path).st_ctime_ns
    while os.stat(path).st_ctime_ns == before:
        os.chmod(path, os.stat(path).st_mode)


@pytest.mark.parametrize("how", REPLACEMENTS)
@pytest.mark.parametrize("shard_no, samples", [(0, 5), (1, 1)], ids=["shard", "empty shard"])
def test_replaced_shard_rebuilt_at_load(shards, count_builds, how, shard_no, samples):
    WebDatasetSource(shards)
    count_builds.clear()
    replace_keeping_size_and_mtime(shards[shard_no], how, samples)
    source = WebDatasetSource(shards)
    assert count_builds == [os.path.basename(shards[shard_no])]
    assert source.shard_sizes[shard_no] == samples
    assert_same(read_all(source), reference(shards))


@pytest.mark.parametrize("how", REPLACEMENTS)
def test_replaced_shard_refused_at_read(shards, how):
    source = WebDatasetSource(shards)
    replace_keeping_size_and_mtime(shards[0], how, 5)
    with pytest.raises(StaleIndexError, match="tar header of member s00_001.cls at byte .* is not the one indexed"):
        source[1]
    with pytest.raises(StaleIndexError) as info:
        source[0]
    assert shards[0] in str(info.value) and "rebuild_index=True" in str(info.value)


@pytest.mark.parametrize("how", ["cp -p", "rewritten in place"])
def test_shard_rewritten_while_open_refused(shards, how):
    source = WebDatasetSource(shards)
    source[0]  # the shard is open
    replace_keeping_size_and_mtime(shards[0], how, 5)
    with pytest.raises(StaleIndexError, match="is not the one indexed"):
        source[1]


def test_mv_over_an_open_shard(shards):
    """An open descriptor still reads the file indexed (mv unlinks only its name); a new opening is refused."""
    source = WebDatasetSource(shards)
    expected = read_all(source)
    replace_keeping_size_and_mtime(shards[0], "mv", 5)
    assert_same(read_all(source), expected)
    worker_copy = pickle.loads(pickle.dumps(source))  # opens its own descriptors, as a DataLoader worker does
    with pytest.raises(StaleIndexError, match="is not the one indexed"):
        worker_copy[0]


def test_member_changed_between_the_spot_checks_is_refused_when_read(tmp_path, count_builds):
    """A member resized inside its block padding moves nothing: loading may miss it, reading it may not."""
    entries = [(f"k{i:02d}.txt", b"x" * 10) for i in range(20)]
    shard = _raw_tar(tmp_path / "s.tar", entries)  # tarfile's defaults: every header fixed but name and size
    index, _ = tar_index.load_or_build_index(shard)
    spot_checked = {offset for offset, _, _ in index.spot_checks()}
    changed = next(i for i in range(20) if index.members(i)[0].header_offset not in spot_checked)
    st_ = os.stat(shard)
    entries[changed] = (entries[changed][0], b"y" * 11)
    _raw_tar(shard, entries)
    os.utime(shard, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    count_builds.clear()
    source = WebDatasetSource(shard)
    assert count_builds == []  # the spot checks pass: same size, mtime and sampled headers
    expected = reference(shard)
    for i in range(20):
        if i == changed:
            with pytest.raises(StaleIndexError, match=f"member k{i:02d}.txt"):
                source[i]
        else:
            assert source[i] == expected[i]


def test_staged_copy_keeps_its_indexes_after_spot_checks(shards, tmp_path, count_builds, monkeypatch):
    """Copying a dataset with its indexes (to node-local disk) gives new inodes and ctimes, not a rebuild."""
    WebDatasetSource(shards)
    staged = tmp_path / "node-local"
    shutil.copytree(tmp_path / "data", staged)  # copy2: sizes and mtimes kept
    checked = []
    matches = tar_index.header_matches
    monkeypatch.setattr(tar_index, "header_matches", lambda *args: checked.append(args[1:3]) or matches(*args))
    count_builds.clear()
    assert_same(read_all(WebDatasetSource(str(staged))), reference(sorted(map(str, staged.glob("*.tar")))))
    assert count_builds == [] and len(checked) == sum(1 + min(n * 3, tar_index.SPOT_CHECKS) for n in SHARD_SIZES)
    checked.clear()
    WebDatasetSource(shards)  # the files indexed, untouched: nothing read back
    assert checked == []


def test_metadata_change_while_open_is_not_refused(shards):
    """chmod or a new hard link moves only the ctime: the sample is read again, its headers match, it is served."""
    source = WebDatasetSource(shards)
    expected = reference(shards[:1])
    source[0]
    touch_ctime(shards[0])
    assert_same(source[1], expected[1])


def test_shard_changing_during_every_read_is_refused(shards, monkeypatch):
    source = WebDatasetSource(shards)
    checked = source_module.header_matches

    def changing_meanwhile(*args):
        touch_ctime(shards[0])
        return checked(*args)

    monkeypatch.setattr(source_module, "header_matches", changing_meanwhile)
    with pytest.raises(StaleIndexError, match="kept changing while it was read"):
        source[0]


# --- bad shards -----------------------------------------------------------------------------


def test_missing_shard(shards):
    missing = shards[0].replace("000000", "000099")
    with pytest.raises(FileNotFoundError, match="shard not found.*000099"):
        WebDatasetSource(shards + [missing])


def test_shard_deleted_after_indexing(shards):
    source = WebDatasetSource(shards)
    os.unlink(shards[0])
    with pytest.raises(FileNotFoundError, match="train-000000.tar disappeared after it was indexed"):
        source[0]


def test_single_path_forms(shards, tmp_path):
    assert WebDatasetSource(Path(shards[3])).shards == [shards[3]]
    assert WebDatasetSource(shards[3]).shard_sizes == [3]


def test_no_shards(tmp_path):
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ValueError, match="no shards"):
        WebDatasetSource(tmp_path / "empty-dir")


def test_pipe_commands_rejected():
    with pytest.raises(ValueError, match="pipe: commands can only be streamed"):
        WebDatasetSource("pipe:curl -s http://x/a.tar")


@pytest.mark.parametrize("url", ["https://example.com/a.tar", "s3://b/a.tar"])
def test_remote_urls_need_a_cache_limit(url):
    with pytest.raises(ValueError, match="pass cache_limit="):
        WebDatasetSource(url)


def _header_offsets(shard) -> list[int]:
    with tarfile.open(shard) as tar:
        return [m.offset for m in tar]


@pytest.mark.parametrize(
    "cut, problem",
    [
        ("inside_pax_header", "file ends inside an extended header"),
        ("at_header", "file ends before the end-of-archive marker"),
        ("inside_header", "file ends before the end-of-archive marker"),
        ("inside_data", "file ends inside the data of 's04_001.npy'"),
        ("no_end_marker", "file ends before the end-of-archive marker"),
        ("empty_file", "empty file"),
    ],
)
def test_truncated_shard_detected_when_indexing(shards, cut, problem):
    shard = shards[4]
    offsets = _header_offsets(shard)
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    cut_at = {  # around the 5th member: pax header, its data block, member header, member data
        "inside_pax_header": offsets[4] + 512 + 10,
        "at_header": offsets[4],
        "inside_header": offsets[4] + 1024 + 100,
        "inside_data": offsets[4] + 1536 + 50,
        "no_end_marker": last.offset_data + 512,
        "empty_file": 0,
    }[cut]
    os.truncate(shard, cut_at)
    with pytest.raises(ShardFormatError) as info:
        WebDatasetSource(shards)
    assert shard in str(info.value) and problem in str(info.value) and "re-create" in str(info.value)


def test_corrupted_header_detected(shards):
    shard = shards[4]
    offset = _header_offsets(shard)[3]
    with open(shard, "r+b") as f:
        f.seek(offset + 10)
        f.write(b"\xff")
    with pytest.raises(ShardFormatError, match=f"invalid tar header.*byte {offset}"):
        WebDatasetSource(shards)


def test_zeroed_header_detected(shards):
    """tarfile (and so webdataset) would silently end the shard at a zeroed header; the index must not."""
    shard = shards[4]
    offset = _header_offsets(shard)[4]
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(bytes(512))
    with pytest.raises(ShardFormatError, match="after the end-of-archive marker"):
        WebDatasetSource(shards)


def test_compressed_shard_rejected(tmp_path):
    plain = write_shard(tmp_path / "p.tar", make_samples(0, 2, seed=0))
    packed = tmp_path / "c.tar"
    packed.write_bytes(gzip.compress(open(plain, "rb").read()))
    with pytest.raises(ShardFormatError, match=r"compressed shards \(\.tar\.gz etc\.\) cannot be read randomly"):
        WebDatasetSource(str(packed))


def test_duplicate_member_rejected(tmp_path):
    shard = _raw_tar(tmp_path / "dup.tar", [("k.txt", b"a"), ("k.TXT", b"b")])
    with pytest.raises(ShardFormatError, match=r"sample 'k' has two members with suffix 'txt'"):
        WebDatasetSource(shard)


def test_repeated_key_rejected_with_both_offsets(tmp_path):
    shard = _raw_tar(tmp_path / "again.tar", [("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"3")])
    assert [s["__key__"] for s in reference(shard)] == ["a", "b", "a"]  # webdataset: two samples, one key
    with tarfile.open(shard) as tar:
        first, _, again = (m.offset_data for m in tar)
    with pytest.raises(ShardFormatError) as info:
        WebDatasetSource(shard)
    message = str(info.value)
    for part in (shard, "key 'a' occurs twice", f"'a.jpg' at byte {first}", f"'a.cls' at byte {again}"):
        assert part in message


@pytest.mark.parametrize("name", ["k.__url__", "k.__key__", "k.__local_path__"])
def test_member_shadowing_sample_metadata_rejected(tmp_path, name):
    shard = _raw_tar(tmp_path / "meta.tar", [("k.txt", b"a"), (name, b"b")])
    with pytest.raises(ShardFormatError, match=f"{name!r} would overwrite"):
        WebDatasetSource(shard)


def test_sparse_member_rejected(tmp_path):
    shard = _raw_tar(tmp_path / "sparse.tar", [("k.txt", b"a")])
    raw = bytearray(open(shard, "rb").read())
    start = _header_offsets(shard)[0]
    raw[start + 156 : start + 157] = b"S"
    raw[start + 148 : start + 156] = b" " * 8
    raw[start + 148 : start + 156] = b"%06o\0 " % sum(raw[start : start + 512])
    open(shard, "wb").write(bytes(raw))
    with pytest.raises(ShardFormatError, match="sparse"):
        WebDatasetSource(shard)


def test_empty_and_single_sample_shards_alone(tmp_path):
    empty = write_shard(tmp_path / "e.tar", [])
    single = write_shard(tmp_path / "s.tar", make_samples(0, 1, seed=3))
    assert WebDatasetSource([empty]).shard_sizes == [0]
    assert len(WebDatasetSource([empty])) == 0
    source = WebDatasetSource([single, empty])
    assert source.shard_sizes == [1, 0]
    assert_same(read_all(source), reference([single, empty]))


@pytest.mark.parametrize("size", [1024, 10240])
def test_zeros_of_an_empty_tar_size_are_an_empty_shard(tmp_path, size):
    """An empty tar is its end-of-archive marker (two zero blocks), padded to a record by most writers."""
    shard = tmp_path / "empty.tar"
    shard.write_bytes(bytes(size))
    assert WebDatasetSource(str(shard)).shard_sizes == [0]


@pytest.mark.parametrize("size", [512, 1000, 10752, "zeroed shard"])
def test_a_file_of_zeros_is_not_an_empty_shard(shards, size):
    shard = shards[4]
    size = os.path.getsize(shard) if size == "zeroed shard" else size
    with open(shard, "wb") as f:
        f.write(bytes(size))
    with pytest.raises(ShardFormatError) as info:
        WebDatasetSource(shards)
    assert f"{shard}: the file is {size} bytes of zeros, not a tar archive" in str(info.value)


# --- processes, threads, file handles ------------------------------------------------------


def shard_fds(directory) -> list[str]:
    """Paths of this process's open descriptors that point into ``directory``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return sorted(found)


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")


@needs_proc
def test_open_files_stay_bounded(tmp_path):
    shards_ = make_dataset(tmp_path / "many", [3] * 12)
    source = WebDatasetSource(shards_, max_open_files=2)
    expected = read_all(WebDatasetSource(shards_))
    order = list(range(len(source)))
    random.Random(0).shuffle(order)
    for i in order:
        assert_same(source[i], expected[i])
        assert len(source._files) <= 2
        assert len(shard_fds(tmp_path / "many")) <= 2


def test_concurrent_threads_read_right_bytes(tmp_path):
    shards_ = make_dataset(tmp_path / "many", [4] * 6)
    expected = read_all(WebDatasetSource(shards_))
    source = WebDatasetSource(shards_, max_open_files=1)
    failures = []

    def reader(seed):
        rng = random.Random(seed)
        for _ in range(200):
            i = rng.randrange(len(source))
            if source[i] != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_pickles_without_open_files(shards):
    source = WebDatasetSource(shards, keys="cls txt")
    source[0]
    assert len(source._files) == 1
    state = pickle.dumps(source)
    assert b"_ShardFile" not in state
    clone = pickle.loads(state)
    assert len(clone._files) == 0
    assert read_all(clone) == read_all(source)


def run_in_fork(fn):
    """Run ``fn`` in a forked child (inheriting this process's memory and descriptors); return its JSON result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                result = fn()
            except BaseException as exn:
                result = f"child raised {exn!r}"
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        result = f.read()
    os.waitpid(pid, 0)
    return json.loads(result)


@needs_proc
def test_fork_after_open_uses_own_handles(shards):
    source = WebDatasetSource(shards, max_open_files=2)
    source[0], source[5]  # shards 0 and 2 open in the parent
    directory = os.path.dirname(shards[0])

    def child():
        sample = source[6]
        return [sample["__key__"], shard_fds(directory)]

    key, child_fds = run_in_fork(child)
    assert key == "s03_000"
    assert child_fds == [shards[3]]  # inherited descriptors closed, not counted against the bound
    assert shard_fds(directory) == sorted([shards[0], shards[2]])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(shards, context):
    source = WebDatasetSource(shards, decode=(), keys=("npy", "cls"))
    if context == "fork":
        source[0]  # workers fork with open handles
    loader = torch.utils.data.DataLoader(source, batch_size=3, num_workers=2, multiprocessing_context=context)
    batches = list(loader)
    images = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    expected = reference(shards, ("decode", ()), ("to_tuple", ("npy", "cls")))
    assert torch.equal(images, torch.from_numpy(np.stack([e[0] for e in expected])))
    assert labels.tolist() == [e[1] for e in expected]


# --- fingerprint ----------------------------------------------------------------------------


def test_fingerprint_identifies_layout(shards, tmp_path):
    fingerprint = WebDatasetSource(shards).fingerprint()
    assert fingerprint == WebDatasetSource(shards).fingerprint()
    assert len(fingerprint) == 16
    moved = make_dataset(tmp_path / "elsewhere", SHARD_SIZES, seed=7)  # same names and sizes, other bytes
    assert WebDatasetSource(moved).fingerprint() == fingerprint
    assert WebDatasetSource(shards[:-1]).fingerprint() != fingerprint
    assert WebDatasetSource(make_dataset(tmp_path / "resized", [5, 0, 1, 3, 6])).fingerprint() != fingerprint
    assert WebDatasetSource(list(reversed(shards))).fingerprint() != fingerprint
    rekeyed = tmp_path / "rekeyed"  # the same names and counts, one shard's samples under other keys
    rekeyed.mkdir()
    for n, size in enumerate(SHARD_SIZES):
        samples = make_samples(n, size, n)
        if n == len(SHARD_SIZES) - 1:
            samples = [{**sample, "__key__": sample["__key__"] + "x"} for sample in samples]
        write_shard(rekeyed / f"train-{n:06d}.tar", samples)
    assert WebDatasetSource(sorted(str(p) for p in rekeyed.iterdir())).fingerprint() != fingerprint
