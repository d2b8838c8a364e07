"""Documents filtered before packing (`PackedSource(keep=)`): every kept document's every token trained exactly once
per epoch across a 4 -> 3 -> 2 resume, the dropped documents named by the audit, a changed mask refused naming it."""

from collections import Counter

import numpy as np
import pytest
import torch

from loader import ResumableDataLoader, merge_states
from loader.checkpoint import audit
from loader.checkpoint.ledger import Ledger
from loader.cli.main import main as cli
from tests.test_packing import (
    BIN_MODES,
    EOS,
    packed,
    trained_across_4_3_2,
    write_documents,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("keep"))


def documents_of(stream):
    starts = np.concatenate(([0], np.flatnonzero(stream == EOS) + 1))[:-1]  # the stream ends with an EOS
    return starts, np.diff(np.append(starts, len(stream)))


def mask_of(kind, lengths):
    if kind == "nothing":
        return np.ones(len(lengths), bool)
    if kind == "some":
        return (lengths % 3 != 0) & (np.arange(len(lengths)) % 7 != 1)
    return np.arange(len(lengths)) == int(np.argmax(lengths))  # all documents but the longest


def expected_kept(source, stream, mask):
    """Every (document start, offset) an epoch trains over the kept documents: all their tokens (bin modes), the
    first len * seq_len of their concatenation (concat)."""
    starts, lengths = documents_of(stream)
    pairs = [(int(s), k) for s, n in zip(starts[mask], lengths[mask]) for k in range(n)]
    return Counter(pairs[: len(source) * source.seq_len] if source.mode == "concat" else pairs)


@pytest.mark.parametrize("kind", ("nothing", "some", "all_but_one"))
@pytest.mark.parametrize("mode", ("concat",) + BIN_MODES)
def test_every_kept_token_once_per_epoch_across_a_4_3_2_resume_and_the_dropped_recorded(corpus, mode, kind):
    _, stream = corpus
    starts, lengths = documents_of(stream)
    mask = mask_of(kind, lengths)
    source = packed(corpus, mode, keep=mask)
    counts = trained_across_4_3_2(source, stream)
    assert max(counts.values()) == 1, "a token trained twice"
    assert counts == expected_kept(source, stream, mask)
    assert source.filtered_documents(0).tolist() == starts[~mask].tolist()
    assert not {document for document, _ in counts} & set(starts[~mask].tolist())


def test_the_mask_by_predicate_and_by_file_and_padding_stays_that_of_the_unfiltered(corpus, tmp_path):
    """A predicate of the lengths and the .npy of the same mask pack the same rows; windows over the kept
    documents' concatenation keep padding near 1 - fill however many documents are dropped (windows fixed over
    all documents would leave about the dropped share of every row padding)."""
    _, stream = corpus
    _, lengths = documents_of(stream)
    np.save(tmp_path / "keep.npy", lengths > 8)
    by_predicate = packed(corpus, "best_fit", keep=lambda n: n > 8)
    by_file = packed(corpus, "best_fit", keep=tmp_path / "keep.npy")
    assert by_predicate.fingerprint() == by_file.fingerprint() != packed(corpus, "best_fit").fingerprint()
    for row in range(len(by_file)):
        assert by_predicate.pieces(row) == by_file.pieces(row)
    kept = int(lengths[lengths > 8].sum())
    assert len(by_file) == -(-kept // by_file.window_tokens) * 4 - (4 - by_file._last_rows)
    assert by_file.stats()["padding"] < packed(corpus, "best_fit").stats()["padding"] + 0.05


def test_the_audit_names_the_documents_filtered_before_packing(corpus, tmp_path, capsys):
    _, stream = corpus
    starts, lengths = documents_of(stream)
    mask = mask_of("some", lengths)
    source = packed(corpus, "first_fit", keep=mask)
    dl = ResumableDataLoader(source, batch_size=4, shuffle=True)
    dl.ledger = Ledger.open(tmp_path, 0, len(source))
    for _ in dl:
        pass
    dl.ledger.record_finished(merge_states([dl.state_dict()]), dl)
    dl.ledger.close()
    assert audit.main(str(tmp_path), limit=3, describe=source.describe, documents=source) == audit.EXACTLY_ONCE
    out = capsys.readouterr().out
    dropped = int((~mask).sum())
    first = source.describe_document(int(starts[~mask][0]))
    assert first == f"part-0.bin:{starts[~mask][0]}+{lengths[~mask][0]}"
    assert f"documents filtered by policy before packing (keep=, never trained): {first}, " in out
    assert f"({dropped} in all)" in out and f"audit: {dropped} document(s) filtered by policy" in out
    np.save(tmp_path / "keep.npy", mask)  # the command line, given the mask: the documents by number
    assert cli(["audit", str(tmp_path), "--limit", "3", "--documents", str(tmp_path / "keep.npy")]) == 0
    out = capsys.readouterr().out
    numbers = np.flatnonzero(~mask)
    listed = ", ".join(f"document {n}" for n in numbers[:3])
    assert f"before packing (keep=, never trained): {listed}, ... ({dropped} in all)" in out
    assert f"audit: {dropped} document(s) filtered by policy before packing" in out


def test_a_resume_with_another_mask_is_refused_naming_it(corpus, tmp_path):
    """Masks that drop two documents of the same length pack the same number of rows of other documents: the
    checkpoint of one is refused with the other, naming the mask's file; one of a mask (dropping nothing) is
    refused without a mask."""
    from loader.checkpoint.publish import CheckpointError
    from loader.checkpoint.save import resume, save_checkpoint

    _, stream = corpus
    _, lengths = documents_of(stream)
    first, second = np.flatnonzero(lengths == np.bincount(lengths).argmax())[:2]
    path = tmp_path / "keep.npy"

    def objects(**keep):
        model = torch.nn.Linear(2, 1)
        return {
            "loader": ResumableDataLoader(packed(corpus, "best_fit", **keep), batch_size=3, shuffle=True),
            "model": model,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        }

    for dropped in (first, None):
        np.save(path, np.arange(len(lengths)) != (-1 if dropped is None else dropped))
        run = objects(keep=path)
        next(iter(run["loader"]))
        save_checkpoint(tmp_path / f"run-{dropped}", 1, **run)
        assert resume(tmp_path / f"run-{dropped}", **objects(keep=path)) == 1
    np.save(path, np.arange(len(lengths)) != second)
    with pytest.raises(CheckpointError, match=rf"the keep= mask {path} changed since the checkpoint was saved"):
        resume(tmp_path / f"run-{first}", **objects(keep=path))
    with pytest.raises(CheckpointError, match="saved with a keep= mask .* has none"):
        resume(tmp_path / "run-None", **objects())


@pytest.mark.parametrize("cached", (False, True))
def test_bad_masks_are_refused_clearly(corpus, tmp_path, cached):
    """With a cache too: refused as without one, and nothing cached of a refused mask."""
    _, stream = corpus
    count = len(documents_of(stream)[0])
    for keep, message in (
        (np.ones(count - 1, bool), rf"one entry per document \({count} documents\)"),
        (np.ones(count, np.int64), "must be a bool array"),
        (np.zeros(count, bool), f"keeps no document of {count}"),
        (tmp_path / "missing.npy", "not a readable .npy mask"),
    ):
        with pytest.raises(ValueError, match=message):
            packed(corpus, "best_fit", keep=keep, cache=tmp_path / "cache" if cached else None)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def every_row(source, epochs=(0, 1)):
    return [source.pieces(row, epoch) for epoch in epochs for row in range(len(source))]


@pytest.mark.parametrize("keep", ("file", "predicate"))
def test_the_cached_kept_documents_pack_the_same_rows_and_a_restart_maps_them(corpus, tmp_path, keep):
    """Without a cache, building it and loading it pack the same rows in every epoch with the same fingerprint and
    the same dropped documents; the load maps the tables, and a spawned worker maps them too (pickled as files)."""
    import pickle

    _, stream = corpus
    _, lengths = documents_of(stream)
    np.save(tmp_path / "keep.npy", mask_of("some", lengths))
    mask = tmp_path / "keep.npy" if keep == "file" else (lambda n: (n % 3 != 0) & (np.arange(len(n)) % 7 != 1))
    plain = packed(corpus, "best_fit", keep=mask)
    built = packed(corpus, "best_fit", keep=mask, cache=tmp_path / "cache")
    loaded = packed(corpus, "best_fit", keep=mask, cache=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("kept-documents-*.json"))) == 1
    assert isinstance(loaded._stream.bases, np.memmap) and isinstance(loaded.filtered_documents(), np.memmap)
    assert every_row(plain) == every_row(built) == every_row(loaded)
    assert plain.fingerprint() == loaded.fingerprint()
    assert plain.filtered_documents().tolist() == loaded.filtered_documents().tolist()
    first = int(plain.filtered_documents()[0])
    assert plain.describe_document(first) == loaded.describe_document(first)
    shipped = pickle.loads(pickle.dumps(loaded))
    assert isinstance(shipped._stream.starts, np.memmap) and every_row(shipped) == every_row(plain)


def test_a_cache_of_another_mask_is_never_reused_and_a_damaged_one_is_rebuilt(corpus, tmp_path):
    from loader.sources.array_cache import CacheWarning

    _, stream = corpus
    starts, lengths = documents_of(stream)
    first, second = np.flatnonzero(lengths == np.bincount(lengths).argmax())[:2]
    for dropped in (first, second):  # the same number of kept tokens: only the mask's digest tells
        keep = np.arange(len(lengths)) != dropped
        source = packed(corpus, "first_fit", keep=keep, cache=tmp_path)
        assert source.filtered_documents().tolist() == [starts[dropped]]
        assert every_row(source) == every_row(packed(corpus, "first_fit", keep=keep))
    assert len(list(tmp_path.glob("kept-documents-*.json"))) == 2
    for path in tmp_path.glob("kept-documents-*.bases.npy"):
        data = path.read_bytes()
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 4]) + data[-2:])
    with pytest.warns(CacheWarning, match=r"not usable, rebuilding it: .*kept-documents-.*\.bases\.npy: its content"):
        rebuilt = packed(corpus, "first_fit", keep=keep, cache=tmp_path)
    assert every_row(rebuilt) == every_row(packed(corpus, "first_fit", keep=keep))


@pytest.mark.parametrize("mode", BIN_MODES)
def test_every_kept_token_once_across_a_4_3_2_resume_through_the_cached_tables(corpus, tmp_path, mode):
    _, stream = corpus
    _, lengths = documents_of(stream)
    mask = mask_of("some", lengths)
    packed(corpus, mode, keep=mask, cache=tmp_path)
    source = packed(corpus, mode, keep=mask, cache=tmp_path)
    assert isinstance(source._stream.starts, np.memmap)
    counts = trained_across_4_3_2(source, stream)
    assert max(counts.values()) == 1, "a token trained twice"
    assert counts == expected_kept(source, stream, mask)


def test_the_masks_digest_read_in_chunks_is_that_of_the_whole_mask(tmp_path, monkeypatch):
    """The digest a checkpoint holds (`+keep:DIGEST`) is unchanged by reading the mask in chunks of any size."""
    import hashlib

    from loader.sources import array_cache, kept

    mask = np.random.default_rng(0).random(1001) < 0.5
    whole = hashlib.sha256(np.packbits(mask).tobytes() + b"1001").hexdigest()[:12]
    np.save(tmp_path / "mask.npy", mask)
    monkeypatch.setattr(kept, "CHUNK", 5)  # 40 entries a chunk
    assert kept.mask_digest(mask) == kept.mask_digest(np.load(tmp_path / "mask.npy", mmap_mode="r")) == whole
    assert len(list(array_cache.chunks(mask, 40))) == 26


def crafted(path, values):
    """The .npy at `path` replaced by `values`, its header's digest made to match: only a check of the content's
    sense can tell."""
    import hashlib
    import json

    np.save(path, values)
    header = path.with_name(path.name.split(".")[0] + ".json")
    content = json.loads(header.read_text())
    field = path.name.split(".")[1]
    content["digests"][field] = hashlib.sha256(np.load(path).tobytes()).hexdigest()
    header.write_text(json.dumps(content))


def test_a_cache_crafted_with_matching_digests_that_does_not_fit_is_refused(corpus, tmp_path):
    _, stream = corpus
    _, lengths = documents_of(stream)
    packed(corpus, "best_fit", keep=mask_of("some", lengths), cache=tmp_path)
    (path,) = tmp_path.glob("kept-documents-*.dropped_starts.npy")
    crafted(path, np.load(path)[1:])  # a dropped document forgotten
    with pytest.raises(ValueError, match=r"do not describe these \d+ documents .*delete its kept-documents-\* files"):
        packed(corpus, "best_fit", keep=mask_of("some", lengths), cache=tmp_path)
