"""TokenSource: packed sequences over token files, checked against slicing the concatenated stream by hand."""

import hashlib
import json
import multiprocessing
import os
import pickle
import signal
import struct
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from loader import ResumableDataLoader
from loader.checkpoint.publish import CheckpointWarning
from loader.checkpoint.save import check_change, check_dataset, dataset_fingerprint
from loader.core.rows import Rows, collate
from loader.core.state import StateError
from loader.sources import TokenFileError, TokenSource
from loader.sources.tokens import GATHER_ROWS
from tests.conftest import assert_batches_match_torch, outcomes


def write_bin(path, tokens, dtype="uint16"):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return str(path)


def stream_files(tmp_path, sizes, dtype="uint16", seed=0):
    """Token files named so that creation order is not name order; returns them and their sorted concatenation."""
    rng = np.random.default_rng(seed)
    parts = {}
    for number, size in reversed(list(enumerate(sizes))):
        tokens = rng.integers(0, 60000, size)
        parts[write_bin(tmp_path / f"part-{number:03d}.bin", tokens, dtype)] = tokens
    return parts, np.concatenate([parts[p] for p in sorted(parts)])


def reference(stream, seq_len, index):
    return stream[index * seq_len : index * seq_len + seq_len + 1]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_every_sample_is_the_concatenated_stream_sliced_across_file_boundaries(tmp_path, dtype, seq_len):
    _, stream = stream_files(tmp_path, [50, 0, 3, 130, 1, 77], dtype)
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=seq_len, dtype=dtype)
    assert len(src) == (len(stream) - 1) // seq_len and src.tokens == len(stream)
    for i in range(len(src)):
        sample = src[i]
        assert sample.dtype == torch.int64 and sample.shape == (seq_len + 1,)
        assert sample.tolist() == reference(stream, seq_len, i).tolist()
    everything = list(range(len(src)))
    runs = [everything[i : i + size] for size in (3, GATHER_ROWS + 1) for i in range(len(src))]
    for batch in [everything[::-1]] + runs:  # across files, inside one file (copied, or gathered at once)
        assert [s.tolist() for s in src.__getitems__(batch)] == [reference(stream, seq_len, i).tolist() for i in batch]
    with pytest.raises(IndexError, match=f"out of range for {len(src)} samples"):
        src[len(src)]


def crossing(src):
    """The samples whose seq_len + 1 tokens span more than one file."""
    starts = np.arange(len(src)) * src.seq_len
    bounds = np.cumsum([0] + [len(np.fromfile(f, np.uint16)) for f in src.files])
    first, last = (np.searchsorted(bounds, x, side="right") for x in (starts, starts + src.seq_len))
    return np.nonzero(first != last)[0].tolist()


@pytest.mark.parametrize("documents", [None, "eos", "offsets"])
def test_a_batch_equals_its_samples_one_by_one_for_random_batches(tmp_path, documents):
    """__getitems__ (the loader's and Mixture's call) against __getitem__, for batches copied per sample, gathered
    at once inside one file, crossing file boundaries, with repeats, and through a pickled copy (a worker's)."""
    sizes = [90, 0, 5, 300, 41, 170]
    _, stream = stream_files(tmp_path, sizes)
    extra = {}
    if documents == "eos":
        extra = {"eos_id": int(stream[7])}  # a token id that occurs: some samples hold several documents
    elif documents == "offsets":
        for number, size in enumerate(sizes):
            np.save(tmp_path / f"part-{number:03d}.npy", np.arange(0, size, 13))
        extra = {"doc_offsets": str(tmp_path / "part-*.npy")}
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=16, dtype="uint16", **extra)
    boundary = crossing(src)
    assert boundary  # the layout puts samples across files
    rng = np.random.default_rng(5)
    inside = list(range(6, 6 + 2 * GATHER_ROWS))  # inside part-003.bin (tokens 95-394): gathered at once
    assert not set(inside) & set(boundary)
    batches = [boundary, list(range(len(src))), inside, inside[::-1]]
    batches += [rng.integers(0, len(src), size).tolist() for size in (1, 2, GATHER_ROWS - 1, GATHER_ROWS, 33)]
    batches += [rng.permutation(boundary + rng.integers(0, len(src), 10).tolist()).tolist() for _ in range(5)]

    def as_lists(samples):
        return [s.tolist() if torch.is_tensor(s) else {k: v.tolist() for k, v in s.items()} for s in samples]

    worker = pickle.loads(pickle.dumps(src))
    for batch in batches:
        expected = as_lists([src[i] for i in batch])
        assert as_lists(src.__getitems__(batch)) == expected == as_lists(worker.__getitems__(batch))
        tokens = [e["tokens"] if documents else e for e in expected]
        assert tokens == [reference(stream, 16, i).tolist() for i in batch]
    assert src.__getitems__([]) == []
    with pytest.raises(IndexError, match=f"sample index {len(src)} out of range"):
        src.__getitems__([0, len(src)])


def test_a_list_keeps_its_order_and_sample_keys_name_file_and_offset(tmp_path):
    a = write_bin(tmp_path / "b.bin", np.arange(10))
    b = write_bin(tmp_path / "a.bin", np.arange(100, 120))
    src = TokenSource([a, b], seq_len=4, dtype="uint16")
    assert src.files == [a, b]
    assert src[2].tolist() == [8, 9, 100, 101, 102]  # tokens 8..12 cross from b.bin into a.bin
    assert [src.sample_key(i) for i in (0, 2, 3, 6)] == [(a, 0), (a, 8), (b, 2), (b, 14)]


def test_npy_files_carry_their_dtype(tmp_path):
    np.save(tmp_path / "x-0.npy", np.arange(30, dtype=np.uint32))
    np.save(tmp_path / "x-1.npy", np.arange(30, 60, dtype=np.uint32))
    src = TokenSource(str(tmp_path / "x-*.npy"), seq_len=8)
    assert src[3].tolist() == list(range(24, 33))
    with pytest.raises(TokenFileError, match=r"x-0.npy declares uint32 tokens but dtype='uint16'"):
        TokenSource(str(tmp_path / "x-*.npy"), seq_len=8, dtype="uint16")
    np.save(tmp_path / "float.npy", np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="float.npy: token dtype must be one of"):
        TokenSource(tmp_path / "float.npy", seq_len=4)


def write_litdata(directory, chunks, data_format="no_header_tensor:16"):
    """A LitData TokensLoader output as litdata's BinaryWriter lays it out: per chunk a uint32 item count, count + 1
    uint32 byte offsets, then the items' raw tokens; index.json lists the chunks in order."""
    directory.mkdir()
    infos = []
    for number, items in enumerate(chunks):
        sizes = [len(item) * 4 for item in items]
        offsets = np.cumsum([0] + sizes).astype(np.uint32) + 4 * (2 + len(items))
        name = f"chunk-0-{number}.bin"
        with open(directory / name, "wb") as f:
            f.write(np.uint32(len(items)).tobytes() + offsets.tobytes())
            f.write(b"".join(np.asarray(item, np.int32).tobytes() for item in items))
        infos.append(
            {"chunk_bytes": sum(sizes), "chunk_size": len(items), "dim": sum(map(len, items)), "filename": name}
        )
    config = {
        "compression": None,
        "chunk_size": None,
        "chunk_bytes": 1 << 20,
        "data_format": [data_format],
        "data_spec": None,
    }
    (directory / "index.json").write_text(json.dumps({"chunks": infos, "config": config}))


def test_a_litdata_directory_reads_its_chunks_in_index_order(tmp_path):
    write_litdata(tmp_path / "lit", [[np.arange(0, 10), np.arange(10, 25)], [np.arange(25, 40)]])
    src = TokenSource(tmp_path / "lit", seq_len=6)
    assert len(src) == 6 and src.tokens == 40
    assert [src[i].tolist() for i in range(len(src))] == [list(range(6 * i, 6 * i + 7)) for i in range(6)]
    assert src.sample_key(5) == (str(tmp_path / "lit" / "chunk-0-1.bin"), 5)
    write_litdata(tmp_path / "pickled", [[np.arange(5)]], data_format="pickle")
    with pytest.raises(TokenFileError, match="uncompressed LitData chunks of 1-D token tensors"):
        TokenSource(tmp_path / "pickled", seq_len=2)


def test_bad_files_and_arguments_are_clear_errors(tmp_path):
    good = write_bin(tmp_path / "good.bin", np.arange(20))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 41)
    with pytest.raises(TokenFileError, match=r"odd.bin: 41 bytes is not a whole number of uint16 tokens"):
        TokenSource([good, odd], seq_len=4, dtype="uint16")
    with pytest.raises(ValueError, match="has no header saying its dtype: pass dtype='uint16'"):
        TokenSource(good, seq_len=4)
    with pytest.raises(ValueError, match="no token files match"):
        TokenSource(str(tmp_path / "missing-*.bin"), seq_len=4, dtype="uint16")
    with pytest.raises(FileNotFoundError, match="token file .*nope.bin does not exist"):
        TokenSource([good, tmp_path / "nope.bin"], seq_len=4, dtype="uint16")
    with pytest.raises(ValueError, match="directory without a LitData index.json"):
        TokenSource(tmp_path, seq_len=4, dtype="uint16")
    with pytest.raises(ValueError, match="too few for one sample"):
        TokenSource(good, seq_len=20, dtype="uint16")
    with pytest.raises(ValueError, match="seq_len"):
        TokenSource(good, seq_len=0, dtype="uint16")
    with pytest.raises(ValueError, match="token dtype must be one of"):
        TokenSource(good, seq_len=4, dtype="float32")


def rewrite_in_place(path, tokens):
    """Write `tokens` over the file (same inode) and restore its atime and mtime, as `cp -p` or a careless tool
    does: only the ctime tells. Written again until the ctime moved, as a filesystem's clock may be coarser than
    the time since the file was written."""
    before = os.stat(path)
    for _ in range(200):
        write_bin(path, tokens)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        if after.st_ctime_ns != before.st_ctime_ns:
            assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
                before.st_size,
                before.st_mtime_ns,
                before.st_ino,
            )
            return
        time.sleep(0.01)
    pytest.fail(f"the ctime of {path} did not move in 2 s of rewrites")


def test_a_wrong_dtype_is_refused_where_the_ids_contradict_it(tmp_path):
    """A raw file says nothing of its dtype: nanoGPT's uint16 file read as uint32 is a whole number of tokens all the
    same. With vocab_size= every token served must be an id below it (read as uint32, the file's tokens pair into
    ids of 65536 and more); an eos_id or vocab_size that the dtype cannot hold is refused when the source is built."""
    from loader.sources import Mixture

    tokens = np.random.default_rng(2).integers(0, 50257, 4000)  # GPT-2 ids
    path = write_bin(tmp_path / "gpt2.bin", tokens)
    right = TokenSource(path, seq_len=64, dtype="uint16", vocab_size=50257)
    everything = list(range(len(right)))
    expected = [reference(tokens, 64, i).tolist() for i in everything]
    assert [s.tolist() for s in right.__getitems__(everything)] == expected
    wrong = TokenSource(path, seq_len=64, dtype="uint32", vocab_size=50257)  # 2000 tokens: nothing to see when built
    unchecked = TokenSource(path, seq_len=64, dtype="uint32")
    assert max(unchecked[0].tolist()) >= 65536  # what a run without vocab_size= trains on
    mixture = Mixture([right, wrong], weights=[0.5, 0.5], num_samples=40, seed=0)
    for read in (
        lambda: wrong[len(wrong) - 1],
        lambda: wrong.__getitems__(list(range(GATHER_ROWS + 1))),
        lambda: mixture.__getitems__(list(range(10))),
    ):  # copied per sample, gathered, a mixture's rows
        with pytest.raises(TokenFileError, match=r"gpt2.bin: token \d+ is \d+, not an id below vocab_size=50257"):
            read()
    with pytest.raises(
        TokenFileError,
        match=r"gpt2.bin holds uint16 tokens \(ids up to 65535\), which "
        r"eos_id=128001 does not fit",
    ):
        TokenSource(path, seq_len=64, dtype="uint16", eos_id=128001)  # Llama 3's end of text
    with pytest.raises(TokenFileError, match="which vocab_size=128256 does not fit"):
        TokenSource(path, seq_len=64, dtype="uint16", vocab_size=128256)
    with pytest.raises(ValueError, match="eos_id=50257 is not an id below vocab_size=50257"):
        TokenSource(path, seq_len=64, dtype="uint16", eos_id=50257, vocab_size=50257)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenSource(path, seq_len=64, dtype="uint16", vocab_size=0)
    negative = np.arange(100, dtype=np.int32)
    negative[70] = -1
    np.save(tmp_path / "signed.npy", negative)
    signed = TokenSource(tmp_path / "signed.npy", seq_len=8, vocab_size=100)
    assert signed[7].tolist() == list(range(56, 65))
    with pytest.raises(TokenFileError, match=r"signed.npy: token 70 is -1, not an id below vocab_size=100"):
        signed[8]


@pytest.mark.parametrize("change", ["rewrite", "rewrite_keeping_mtime", "append", "replace", "delete"])
def test_a_file_that_changed_after_the_source_was_built_is_refused(tmp_path, change):
    path = write_bin(tmp_path / "t.bin", np.arange(40))
    src = TokenSource(path, seq_len=4, dtype="uint16")
    assert src[0].tolist() == [0, 1, 2, 3, 4]
    if change == "rewrite":  # same size, new content
        write_bin(path, np.arange(40)[::-1])
        os.utime(path, ns=(1, 1))
    elif change == "rewrite_keeping_mtime":  # same size, mtime and inode: only the ctime moved
        rewrite_in_place(path, np.arange(40)[::-1])
    elif change == "append":
        with open(path, "ab") as f:
            f.write(b"\x00\x00")
    elif change == "replace":
        write_bin(tmp_path / "new.bin", np.arange(40))
        os.replace(tmp_path / "new.bin", path)
    else:
        os.remove(path)
    with pytest.raises(TokenFileError, match="t.bin (changed after|disappeared after) the TokenSource was built"):
        src[1]


@pytest.mark.parametrize("change", ["rewrite_keeping_mtime", "replace"])
@pytest.mark.parametrize("batch_size", [3, GATHER_ROWS])
def test_through_the_loader_a_file_changed_between_batches_fails_the_next_batch_that_reads_it(
    tmp_path, change, batch_size
):
    """With num_workers=0 the loader reads a TokenSource's batches without its Rows (batch_reader): a file changed
    after a batch fails the next batch that reads it with TokenFileError, as through __getitems__, whether gathered
    from one file or copied per sample; that batch is consumed and the pass goes on, so every index of the epoch
    is delivered or failed exactly once, and nothing delivered holds the changed tokens."""
    parts, stream = stream_files(tmp_path, [200, 200])
    changed = sorted(parts)[1]
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=8, dtype="uint16")
    assert src.batch_reader() is not None
    delivered, failed = [], []
    for indices, batch in outcomes(ResumableDataLoader(src, batch_size=batch_size, shuffle=False), TokenFileError):
        if isinstance(batch, TokenFileError):
            assert f"{changed} changed after the TokenSource was built" in str(batch)
            failed.append(indices)
            continue
        delivered.append(indices)
        assert batch.tolist() == [reference(stream, 8, i).tolist() for i in indices]
        if len(delivered) == 1:
            new = stream[200:][::-1]
            if change == "replace":
                write_bin(tmp_path / "new.bin", new)
                os.replace(tmp_path / "new.bin", changed)
            else:
                rewrite_in_place(changed, new)
    reading_it = [ids for ids in delivered + failed if max(ids) * 8 + 8 >= 200]  # a token of the second file
    assert failed and sorted(failed) == sorted(reading_it)
    assert sorted(i for ids in delivered + failed for i in ids) == list(range(len(src)))


def test_the_batch_reader_is_left_to_tokensources_of_plain_samples_and_their_own_getitems(tmp_path):
    """The loader reads a batch through `batch_reader()` only where it is `collate(__getitems__)`: not for dict
    samples, nor for a subclass with a __getitems__ of its own, whose batches the loader still delivers, nor under
    a collate_fn of yours, which still sees the Rows."""
    _, stream = stream_files(tmp_path, [300])
    yours = ResumableDataLoader(
        TokenSource(str(tmp_path / "part-*.bin"), seq_len=8, dtype="uint16"), batch_size=4, collate_fn=lambda rows: rows
    )
    assert type(next(iter(yours))) is Rows

    class Shifted(TokenSource):
        def __getitems__(self, indices):
            return Rows(super().__getitems__(indices).batch + 1)

    files = str(tmp_path / "part-*.bin")
    assert TokenSource(files, seq_len=8, dtype="uint16", eos_id=0).batch_reader() is None
    shifted = Shifted(files, seq_len=8, dtype="uint16")
    assert shifted.batch_reader() is None
    dl = ResumableDataLoader(shifted, batch_size=4, shuffle=True, seed=1)
    for batch in dl:
        assert batch.tolist() == [(reference(stream, 8, i) + 1).tolist() for i in dl.last_indices().tolist()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs a CUDA device (runs on a GPU machine)")
def test_a_batch_read_without_its_rows_is_pinned_when_asked(tmp_path):
    _, stream = stream_files(tmp_path, [300])
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=8, dtype="uint16")
    dl = ResumableDataLoader(src, batch_size=4, shuffle=True, seed=1, pin_memory=True)
    for batch in dl:
        assert batch.is_pinned()
        assert batch.tolist() == [reference(stream, 8, i).tolist() for i in dl.last_indices().tolist()]


TRUNCATED_SIZES = (3200, 5000, 300)  # part-001.bin: 10000 bytes, three pages of which truncation keeps the first


def read_while_truncating(directory: str, workers: int, truncated: str) -> None:
    """In a process of its own (a SIGBUS is then its exit status, not pytest's death): a loader pass over the three
    token files of TRUNCATED_SIZES with document offsets, every file mapped before the pass (forked workers inherit
    the maps), and `truncated` cut to its first page after the first batch, under the maps. Writes each batch's
    indices and its tokens or error to result.json."""
    token_files = os.path.join(directory, "part-*.bin")
    src = TokenSource(token_files, seq_len=16, dtype="uint16", doc_offsets=os.path.join(directory, "part-*.npy"))
    starts = np.cumsum((0,) + TRUNCATED_SIZES[:-1]) // 16
    src.__getitems__(starts.tolist())  # maps every token and offsets file in this process
    dl = ResumableDataLoader(
        src,
        batch_size=GATHER_ROWS + 1,
        shuffle=False,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )  # in order: part-000.bin first
    batches = []
    for indices, batch in outcomes(dl, TokenFileError):
        if isinstance(batch, TokenFileError):
            batches.append({"indices": indices, "error": str(batch)})
        else:
            batches.append({"indices": indices, "tokens": batch["tokens"].tolist()})
        if len(batches) == 1:
            os.truncate(os.path.join(directory, truncated), 4096)
    Path(directory, "result.json").write_text(json.dumps(batches))


def _logged(log: str, fn, args) -> None:
    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    torch.set_num_threads(1)  # the intra-op pool of the parent is not the child's
    warnings.resetwarnings()  # warnings as a script has them, not the suite's errors the fork inherited
    fn(*args)


def in_a_fork(log: Path, fn, *args, timeout: float = 300) -> int | None:
    """fn(*args) in a forked process (no new interpreter to import torch), its output in `log`; its exit status
    (negative: the signal that ended it), SIGKILLed after `timeout` seconds."""
    process = multiprocessing.get_context("fork").Process(target=_logged, args=(str(log), fn, args))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
    return process.exitcode


@pytest.mark.slow
@pytest.mark.parametrize("truncated, workers", [("part-001.bin", 0), ("part-001.bin", 2), ("part-001.npy", 0)])
def test_a_file_truncated_while_mapped_fails_its_batches_never_the_process(tmp_path, truncated, workers):
    """Reading a mapped page past a file's end is a SIGBUS, which kills the process (the trainer at num_workers=0,
    a worker otherwise). Every batch that reads the truncated file after the cut fails with TokenFileError naming
    it; every other batch is delivered with its tokens; each sample of the epoch is delivered or failed once."""
    _, stream = stream_files(tmp_path, TRUNCATED_SIZES)
    for number, size in enumerate(TRUNCATED_SIZES):  # part-001.npy: 1000 int64 offsets, two pages
        np.save(tmp_path / f"part-{number:03d}.npy", np.arange(0, size, 5, dtype=np.int64))
    log = tmp_path / "run.log"
    rc = in_a_fork(log, read_while_truncating, str(tmp_path), workers, truncated)
    assert rc == 0, f"exit status {rc} (-7: SIGBUS):\n{log.read_text()[-3000:]}"
    batches = json.loads((tmp_path / "result.json").read_text())
    samples = (len(stream) - 1) // 16
    assert sorted(i for b in batches for i in b["indices"]) == list(range(samples))
    part_001 = range(TRUNCATED_SIZES[0], TRUNCATED_SIZES[0] + TRUNCATED_SIZES[1])
    reading_it = [
        b for b in batches if any(16 * i + 16 >= part_001.start and 16 * i < part_001.stop for i in b["indices"])
    ]  # read after the cut: 2 workers prefetch 4
    assert reading_it and [b for b in batches if "error" in b] == reading_it
    for batch in batches:
        if "error" in batch:
            assert truncated in batch["error"] and "changed after the TokenSource was built" in batch["error"]
        else:
            assert batch["tokens"] == [reference(stream, 16, i).tolist() for i in batch["indices"]]


def test_eos_boundaries_number_the_documents_inside_each_sample(tmp_path):
    eos = 0
    tokens = np.array([5, 6, eos, 7, 8, 9, eos, eos, 3, 4, 5, 6, 7, eos, 1, 2, 3])
    src = TokenSource(write_bin(tmp_path / "t.bin", tokens), seq_len=5, dtype="uint16", eos_id=eos)
    samples = [src[i] for i in range(len(src))]
    assert [s["tokens"].tolist() for s in samples] == [tokens[5 * i : 5 * i + 6].tolist() for i in range(len(src))]
    assert [s["doc_ids"].tolist() for s in samples] == [
        [0, 0, 0, 1, 1, 1],  # 5 6 EOS | 7 8 9
        [0, 0, 1, 2, 2, 2],  # 9 EOS | EOS | 3 4 5
        [0, 0, 0, 0, 1, 1],  # 5 6 7 EOS | 1 2
    ]
    collated = next(iter(ResumableDataLoader(src, batch_size=3)))
    assert collated["tokens"].shape == collated["doc_ids"].shape == (3, 6)


def write_megatron(prefix, documents, dtype=np.uint16, code=8):
    """A Megatron IndexedDataset (.bin + .idx, version 1) with one sequence per document, as its builder writes."""
    write_bin(f"{prefix}.bin", np.concatenate(documents), dtype)
    lengths = np.array([len(d) for d in documents], np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64) * np.dtype(dtype).itemsize
    doc_idx = np.arange(len(documents) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(documents), len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def doc_ids_by_hand(document_of_token, seq_len, index):
    window = document_of_token[index * seq_len : index * seq_len + seq_len + 1]
    return (np.cumsum(np.diff(window, prepend=window[0]) != 0)).tolist()


@pytest.mark.parametrize("kind", ["npy", "megatron"])
def test_offsets_files_give_document_boundaries_and_files_start_documents(tmp_path, kind):
    rng = np.random.default_rng(1)
    files = [[rng.integers(1, 100, n) for n in sizes] for sizes in ([3, 9, 1, 6], [4, 4], [11, 2, 2])]
    document_of_token, number = [], 0
    for f, documents in enumerate(files):
        prefix = tmp_path / f"shard-{f}"
        if kind == "megatron":
            write_megatron(prefix, documents)
        else:
            write_bin(f"{prefix}.bin", np.concatenate(documents))
            np.save(f"{prefix}.npy", np.cumsum([0] + [len(d) for d in documents[:-1]]))
        for d in documents:
            document_of_token += [number] * len(d)
            number += 1
    offsets = str(tmp_path / ("shard-*.idx" if kind == "megatron" else "shard-*.npy"))
    src = TokenSource(str(tmp_path / "shard-*.bin"), seq_len=4, dtype="uint16", doc_offsets=offsets)
    for i in range(len(src)):
        assert src[i]["doc_ids"].tolist() == doc_ids_by_hand(np.array(document_of_token), 4, i), i


def test_offsets_files_must_match_the_token_files(tmp_path):
    write_megatron(tmp_path / "a", [np.arange(1, 9), np.arange(1, 5)])
    write_bin(tmp_path / "b.bin", np.arange(30))
    with pytest.raises(ValueError, match="2 offsets files for 1 token files"):
        TokenSource(tmp_path / "b.bin", seq_len=4, dtype="uint16", doc_offsets=[tmp_path / "a.idx"] * 2)
    with pytest.raises(TokenFileError, match="a.idx: version 1, dtype code 8; expected version 1 and the dtype"):
        TokenSource(tmp_path / "a.bin", seq_len=4, dtype="uint32", doc_offsets=tmp_path / "a.idx")
    np.save(tmp_path / "far.npy", np.array([0, 40]))
    with pytest.raises(TokenFileError, match=r"far.npy: document offsets must lie in \[0, 30\)"):
        TokenSource(tmp_path / "b.bin", seq_len=4, dtype="uint16", doc_offsets=tmp_path / "far.npy")
    with pytest.raises(ValueError, match="not both"):
        TokenSource(tmp_path / "b.bin", seq_len=4, dtype="uint16", eos_id=0, doc_offsets=tmp_path / "far.npy")


def test_fingerprint_names_the_stream_and_pickles_without_the_maps(tmp_path):
    path = write_bin(tmp_path / "t.bin", np.arange(100))
    src = TokenSource(path, seq_len=8, dtype="uint16")
    src[0]  # maps the file in this process
    restored = pickle.loads(pickle.dumps(src))
    assert len(pickle.dumps(src)) < 2000  # the 200 bytes of tokens do not travel; at 100 GB neither would they
    assert restored[5].tolist() == src[5].tolist() and restored.fingerprint() == src.fingerprint()
    assert TokenSource(path, seq_len=9, dtype="uint16").fingerprint() != src.fingerprint()
    assert TokenSource(path, seq_len=8, dtype="uint16", eos_id=0).fingerprint() != src.fingerprint()


@pytest.mark.parametrize("files", [3, 20])
def test_token_files_rewritten_in_the_same_size_between_save_and_resume_are_refused_naming_them(tmp_path, files):
    """Between save and resume nothing checks a stat: a file rewritten in the same size (other tokens) is refused
    by the fingerprint's content, naming the file (with 20 files, tags cover groups of two: it and its neighbour).
    Over the files unchanged, a rebuilt source resumes and the epoch trains every sample once."""
    parts, _ = stream_files(tmp_path, [100] * files)
    loader = ResumableDataLoader(
        TokenSource(str(tmp_path / "*.bin"), seq_len=8, dtype="uint16"), batch_size=4, shuffle=True, seed=0
    )
    it, trained = iter(loader), []
    for _ in range(5):
        next(it)
        trained += loader.last_indices().tolist()
    saved, state = dataset_fingerprint(loader), loader.state_dict()
    fresh = ResumableDataLoader(
        TokenSource(str(tmp_path / "*.bin"), seq_len=8, dtype="uint16"), batch_size=4, shuffle=True, seed=0
    )
    check_dataset(saved, fresh, "the checkpoint")
    fresh.load_state_dict(state)
    for _ in fresh:
        trained += fresh.last_indices().tolist()
    assert sorted(trained) == list(range(len(fresh.dataset)))
    changed = sorted(parts)[files // 2]
    write_bin(changed, parts[changed][::-1])
    rebuilt = ResumableDataLoader(TokenSource(str(tmp_path / "*.bin"), seq_len=8, dtype="uint16"), batch_size=4)
    with pytest.raises(StateError, match=rf"the checkpoint: .*{changed}.* changed since the checkpoint was saved"):
        check_dataset(saved, rebuilt, "the checkpoint")


def test_the_fingerprint_reads_a_bounded_sample_of_large_files(tmp_path, monkeypatch):
    """A 4 GiB offsets or token file costs 64 reads of 4 KiB, its first and last block among them; a small file is
    read whole."""
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, size, at: reads.append((size, at)) or real(fd, size, at))
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(1 << 32)  # sparse: costs no disk
    TokenSource(tmp_path / "big.bin", seq_len=8, dtype="uint16").fingerprint()
    assert len(reads) == 64 and reads[0] == (4096, 0) and reads[-1] == (4096, (1 << 32) - 4096)
    reads.clear()
    TokenSource(write_bin(tmp_path / "small.bin", np.arange(5000)), seq_len=8, dtype="uint16").fingerprint()
    assert [at for _, at in reads] == [0, 4096, 8192]


def legacy_token_fingerprint(source):
    """The fingerprint releases before content digests recorded for a TokenSource."""
    layout = {
        "files": [[os.path.basename(p), n] for p, n in zip(source.files, np.diff(source._starts).tolist())],
        "dtype": source._files[0].dtype.name,
        "seq_len": source.seq_len,
        "eos_id": source.eos_id,
        "doc_offsets": None,
    }
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


def test_a_checkpoint_of_the_previous_release_resumes_with_a_warning(tmp_path):
    """Its fingerprint held no content: a TokenSource, a PackedSource or a Mixture over it resumes from it as that
    release would have, warning that the files were not checked; any other fingerprint is refused."""
    from loader.sources import Mixture
    from loader.sources.packing import PackedSource

    tokens = TokenSource(write_bin(tmp_path / "t.bin", np.arange(1, 200) % 7), seq_len=8, dtype="uint16")
    assert tokens.fingerprint_of_earlier_release() == legacy_token_fingerprint(tokens)
    eos = TokenSource(tmp_path / "t.bin", seq_len=8, dtype="uint16", eos_id=0)
    for dataset in (
        tokens,
        PackedSource(eos, mode="best_fit", rows_per_window=2),
        Mixture([tokens, tokens], [0.5, 0.5], 40),
    ):
        loader = ResumableDataLoader(dataset, batch_size=2)
        earlier = dataset.fingerprint_of_earlier_release()
        assert earlier != dataset.fingerprint()
        check_dataset(earlier, loader, "the checkpoint")
        with pytest.warns(CheckpointWarning, match="fingerprint of an earlier release .* not their content"):
            check_change(earlier, loader, loader.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_change(dataset.fingerprint(), loader, loader.state_dict())
        with pytest.raises(StateError, match="dataset fingerprint"):
            check_dataset(earlier[::-1], loader, "the checkpoint")


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_batches_equal_torchs_and_the_stacked_samples(tmp_path, workers):
    """The loader collates the source's Rows as the tensor they are rows of, torch's default_collate stacks them:
    the same int64 batches, across file boundaries, gathered inside one file or copied per sample."""
    stream_files(tmp_path, [300, 211, 90])
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=16, dtype="uint16")
    for batch_size in (3, GATHER_ROWS + 1):
        ids = assert_batches_match_torch(src, workers, batch_size=batch_size, shuffle=batch_size == 3, seed=3)
        assert sorted(i for batch in ids for i in batch) == list(range(len(src)))
    rows = src.__getitems__([4, 1, 30])
    assert type(rows) is Rows and collate(rows) is rows.batch and rows.batch.shape == (3, 17)


@pytest.mark.parametrize("workers", [0, 2])
def test_through_the_loader_batches_are_the_stacked_samples(tmp_path, workers):
    _, stream = stream_files(tmp_path, [300, 211, 90])
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=16, dtype="uint16")
    dl = ResumableDataLoader(
        src,
        batch_size=5,
        shuffle=True,
        seed=3,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    seen = []
    for batch in dl:
        ids = dl.last_indices().tolist()
        assert batch.tolist() == [reference(stream, 16, i).tolist() for i in ids]
        seen += ids
    assert sorted(seen) == list(range(len(src)))


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="Linux only: counts this process's open descriptors in /proc/self/fd"
)
def test_maps_are_bounded_so_that_many_files_never_exhaust_the_descriptors(tmp_path, monkeypatch):
    """A map holds a file descriptor: over more files than the bound, the least recently used map goes, so the
    process's open files stay within the bound however many files are read, and every sample is still the right
    one, gathered or copied, also from a file read again after its map went."""
    from loader.sources import tokens

    monkeypatch.setattr(tokens, "_MAPS", tokens._Maps(limit=4))
    _, stream = stream_files(tmp_path, [40 + 3 * n for n in range(12)])
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=4, dtype="uint16")
    descriptors = len(os.listdir("/proc/self/fd"))
    order = np.random.default_rng(0).permutation(len(src)).tolist()
    batches = [order[i : i + 5] for i in range(0, len(order), 5)] + [list(range(i, i + GATHER_ROWS)) for i in (0, 90)]
    for batch in batches * 2:
        assert [s.tolist() for s in src.__getitems__(batch)] == [reference(stream, 4, i).tolist() for i in batch]
        assert len(tokens._MAPS) <= 4 and len(os.listdir("/proc/self/fd")) <= descriptors + 4
    assert len(tokens._MAPS) == 4


def test_a_child_forked_while_a_thread_holds_the_maps_lock_still_maps(tmp_path):
    """A DataLoader worker forked while another thread of the parent was adding a map inherits the lock held; its
    own first map must not wait for a thread that does not exist in it."""
    from loader.sources import tokens

    _, stream = stream_files(tmp_path, [200])
    src = TokenSource(str(tmp_path / "part-*.bin"), seq_len=4, dtype="uint16")
    with tokens._MAPS._lock:  # held, as by another thread, across the fork
        pid = os.fork()
        if pid == 0:  # the child: map and read, then report by exit status
            ok = src[3].tolist() == reference(stream, 4, 3).tolist()
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the maps lock")
