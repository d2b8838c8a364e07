"""Document packing: every document token exactly once per epoch across resizes, rows as pure functions, the
document-mask metadata against a naive packer, Hugging Face columns, mixtures of packed sources, bad input."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ResumableDataLoader, merge_states
from loader.checkpoint import audit
from loader.checkpoint.ledger import Ledger
from loader.sources import Mixture, TokenSource
from loader.sources.packing import ArrowDocuments, PackedSource, label_mask, pack
from tests.test_tokens import write_megatron

EOS = 0
BIN_MODES = ("first_fit", "best_fit")


def write_documents(directory, seed=0, documents=150, files=2):
    """Token files of EOS-terminated documents (some longer than a row), documents crossing file boundaries;
    returns the glob and the concatenated stream."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(documents) < 0.1, rng.integers(40, 90, documents), rng.integers(1, 20, documents))
    stream = np.concatenate([np.append(rng.integers(1, 500, n), EOS) for n in lengths]).astype(np.uint16)
    for number, part in enumerate(np.array_split(stream, files)):
        part.tofile(directory / f"part-{number}.bin")
    return str(directory / "part-*.bin"), stream


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("packing"))


def packed(corpus, mode, **kw):
    files, _ = corpus
    return PackedSource(
        TokenSource(files, seq_len=16, dtype="uint16", eos_id=EOS),
        mode=mode,
        **{"rows_per_window": 4, "fill": 0.9, "seed": 3, **kw},
    )


def owned_tokens(source, stream, rows, tokens=None, epoch=None):
    """(document start, offset) of each token the rows own in `epoch` (default: the source's), checked against the
    stream and the rows' tokens."""
    found = []
    for row in rows:
        sample = source[row] if tokens is None else tokens[row]
        for document, offset, length, column in source.pieces(row, epoch):
            start = document + offset
            assert sample["tokens"][column : column + length].tolist() == stream[start : start + length].tolist()
            assert document == 0 or stream[document - 1] == EOS  # named by where its document starts
            found += [(document, offset + k) for k in range(length)]
    return found


def expected_tokens(source, stream):
    """Every (document start, offset) an epoch trains: all tokens (bin modes), the first len * seq_len (concat)."""
    end = len(source) * source.seq_len if source.mode == "concat" else len(stream)
    starts = np.concatenate(([0], np.flatnonzero(stream == EOS) + 1))
    document = starts[np.searchsorted(starts, np.arange(end), side="right") - 1]
    return Counter(zip(document.tolist(), (np.arange(end) - document).tolist()))


@pytest.mark.parametrize("mode", ("concat",) + BIN_MODES)
def test_every_document_token_once_per_epoch_across_a_4_3_2_resume(corpus, mode):
    """4 ranks stop unevenly, 3 resume from the merged state and stop unevenly, 2 finish: counted by (document,
    offset), every token of the epoch is trained exactly once, and each batch row holds its pieces' tokens."""
    source, (_, stream) = packed(corpus, mode), corpus
    counts = trained_across_4_3_2(source, stream)
    assert max(counts.values()) == 1, "a token trained twice"
    assert counts == expected_tokens(source, stream)


def trained_across_4_3_2(source, stream):
    """4 ranks stop unevenly, 3 resume from the merged state and stop unevenly, 2 finish: the (document, offset)
    of every token trained in epoch 0, each batch row checked to hold its pieces' tokens."""
    trained, state = [], None
    for world, stops in ((4, (5, 3, 4, 6)), (3, (2, 4, 3)), (2, None)):
        loaders = [
            ResumableDataLoader(source, batch_size=3, shuffle=True, seed=7, rank=r, world_size=world)
            for r in range(world)
        ]
        for rank, loader in enumerate(loaders):
            if state is not None:
                loader.load_state_dict(state)
            for step, batch in enumerate(loader):
                if loader.epoch:  # a small source's epoch 0 ended before this stage: the next is not counted
                    break
                rows = loader.last_indices().tolist()
                samples = {row: {k: v[i] for k, v in batch.items()} for i, row in enumerate(rows)}
                trained += owned_tokens(source, stream, rows, samples)
                if stops is not None and step + 1 == stops[rank]:
                    break
        state = merge_states([loader.state_dict() for loader in loaders], uneven=True)
    return Counter(trained)


def test_a_row_is_a_pure_function_of_seed_epoch_and_position(corpus):
    """Two constructions, random access against sequential, through a pickled copy and through loader workers:
    the same rows; another epoch or seed gives other rows of the same tokens."""
    first, second = packed(corpus, "best_fit"), packed(corpus, "best_fit")
    rng = np.random.default_rng(1)
    shuffled = rng.permutation(len(first)).tolist()
    by_row = {row: first[row] for row in shuffled}
    for row in range(len(second)):
        assert all(torch.equal(by_row[row][k], v) for k, v in second[row].items())
    assert_loader_rows(second, by_row, workers=0)
    _, stream = corpus
    for other in (packed(corpus, "best_fit", epoch=1), packed(corpus, "best_fit", seed=4)):
        assert len(other) == len(first)
        assert any(not torch.equal(other[r]["tokens"], by_row[r]["tokens"]) for r in range(len(first)))
        assert Counter(owned_tokens(other, stream, range(len(other)))) == expected_tokens(other, stream)


def assert_loader_rows(source, by_row, workers):
    loader = ResumableDataLoader(
        source, batch_size=4, shuffle=True, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    for batch in loader:
        for i, row in enumerate(loader.last_indices().tolist()):
            assert all(torch.equal(batch[k][i], v) for k, v in by_row[row].items())


@pytest.mark.slow
def test_loader_workers_deliver_the_rows_random_access_gives(corpus):
    source = packed(corpus, "first_fit")
    assert_loader_rows(source, {row: source[row] for row in range(len(source))}, workers=2)


@pytest.mark.parametrize("kind", ["npy", "idx"])
def test_offsets_files_give_the_documents_and_each_file_starts_one(tmp_path, kind):
    """Documents from offsets files (a .npy of starts, or Megatron's .idx) over two token files: the packed rows hold
    every token once, each piece inside one document (a file's first token starts one)."""
    rng = np.random.default_rng(4)
    documents = [[rng.integers(0, 500, n) for n in rng.integers(1, 40, 30)] for _ in range(2)]
    for number, docs in enumerate(documents):
        write_megatron(tmp_path / f"t-{number}", docs)  # the .bin and its .idx
        np.save(tmp_path / f"t-{number}.npy", np.cumsum([0] + [len(d) for d in docs])[:-1])
    tokens = TokenSource(
        str(tmp_path / "t-*.bin"), seq_len=16, dtype="uint16", doc_offsets=str(tmp_path / f"t-*.{kind}")
    )
    source = PackedSource(tokens, mode="best_fit", rows_per_window=4)
    flat = [d for docs in documents for d in docs]
    stream = np.concatenate(flat)
    starts = np.cumsum([0] + [len(d) for d in flat])[:-1].tolist()
    length_of = dict(zip(starts, map(len, flat)))
    found = Counter()
    for row in range(len(source)):
        sample = source[row]
        for document, offset, length, column in source.pieces(row):
            assert offset + length <= length_of[document]
            assert sample["tokens"][column : column + length].tolist() == stream[document + offset :][:length].tolist()
            found.update((document, offset + k) for k in range(length))
    assert found == Counter((s, k) for s, n in length_of.items() for k in range(n))


class ListDocuments:
    """Documents in memory, for the property test: document d is tokens 1000 * d + offset (+1: never EOS)."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1]))
        documents = [1000 * d + np.arange(n) + 1 for d, n in enumerate(lengths)]
        self.stream = np.concatenate(documents + [np.zeros(0, np.int64)])
        self.tokens = len(self.stream)

    def read_tokens(self, low, high):
        return self.stream[low:high].astype(np.int64)

    def document_starts(self, low, high):
        return np.unique(self.starts[(self.starts >= low) & (self.starts < high)])

    def document_start(self, token):
        return int(self.starts[np.searchsorted(self.starts, token, side="right") - 1])

    def describe_token(self, token):
        return str(token)

    def fingerprint(self):
        return "list"


def naive_metadata(lengths, seq_len):
    segment_ids, positions, cu = [], [], [0]
    for number, length in enumerate(lengths):
        segment_ids += [number] * length
        positions += list(range(length))
        cu.append(min(cu[-1] + length, seq_len))
    pad = seq_len + 1 - len(segment_ids)
    segment_ids, positions = segment_ids + [-1] * pad, positions + [0] * pad
    cu = sorted(set(cu + [seq_len]))
    return segment_ids, positions, cu + [seq_len] * (seq_len + 1 - len(cu))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    seq_len=st.integers(4, 24),
    rows=st.integers(1, 6),
    fill=st.sampled_from([0.5, 0.9, 1.0]),
    best=st.booleans(),
    seed=st.integers(0, 9),
)
def test_rows_and_metadata_match_a_naive_packer(lengths, seq_len, rows, fill, best, seed):
    docs = ListDocuments(lengths)
    if docs.tokens < seq_len + 1:
        return
    source = PackedSource(
        docs, seq_len, "best_fit" if best else "first_fit", rows_per_window=rows, fill=fill, seed=seed
    )
    seen = Counter()
    for row in range(len(source)):
        sample, pieces = source[row], source.pieces(row)
        tokens = [t for d, o, n, _ in pieces for t in docs.stream[d + o : d + o + n]]
        assert [c for *_, c in pieces] == np.cumsum([0] + [n for _, _, n, _ in pieces])[:-1].tolist()
        assert sample["tokens"].tolist() == tokens + [0] * (seq_len + 1 - len(tokens))
        segment_ids, positions, cu = naive_metadata([n for _, _, n, _ in pieces], seq_len)
        assert sample["segment_ids"].tolist() == segment_ids and sample["positions"].tolist() == positions
        assert sample["cu_seqlens"].tolist() == cu and sample["cu_seqlens"].dtype == torch.int32
        mask = [segment_ids[t] == segment_ids[t + 1] >= 0 for t in range(seq_len)]
        assert label_mask(sample["segment_ids"]).tolist() == mask
        seen.update((d, o + k) for d, o, n, _ in pieces for k in range(n))
    assert seen == Counter((int(d), k) for d, n in zip(docs.starts, docs.lengths) for k in range(n))


def naive_pack(lengths, capacity, rows, best):
    free, placed = [capacity] * rows, []
    for piece, length in enumerate(lengths):
        room = [r for r in range(rows) if free[r] >= length]
        if room:
            row = sorted(room, key=lambda r: (free[r], r))[0] if best else room[0]
            placed.append((piece, 0, length, row, capacity - free[row]))
            free[row] -= length
            continue
        done = 0
        while done < length:
            row = sorted(range(rows), key=lambda r: (-free[r], r))[0]
            take = min(free[row], length - done)
            placed.append((piece, done, take, row, capacity - free[row]))
            free[row], done = free[row] - take, done + take
    return placed


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), max_size=30),
    capacity=st.integers(30, 40),
    rows=st.integers(1, 8),
    best=st.booleans(),
)
def test_pack_places_pieces_as_first_and_best_fit_do(lengths, capacity, rows, best):
    if sum(lengths) > capacity * rows:
        with pytest.raises(ValueError, match="do not fit"):
            pack(lengths, capacity, rows, best)
        return
    assert pack(lengths, capacity, rows, best).tolist() == [list(p) for p in naive_pack(lengths, capacity, rows, best)]


def test_a_hugging_face_column_packs_every_token_once_read_in_place(tmp_path):
    datasets = pytest.importorskip(
        "datasets",
        reason="packing a Hugging Face column needs datasets: "
        "pip install -e '.[hf]' (the test extra, which CI installs, has it)",
    )
    rng = np.random.default_rng(2)
    rows = [rng.integers(1, 500, n).tolist() for n in rng.integers(0, 30, 60)]
    parts = [datasets.Dataset.from_dict({"input_ids": rows[:25]}), datasets.Dataset.from_dict({"input_ids": rows[25:]})]
    datasets.concatenate_datasets(parts).save_to_disk(str(tmp_path / "d"))
    dataset = datasets.load_from_disk(str(tmp_path / "d"))
    documents = ArrowDocuments(dataset, "input_ids")
    stream = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    assert documents.tokens == len(stream) and documents.read_tokens(0, len(stream)).tolist() == stream.tolist()
    source = PackedSource(documents, seq_len=16, mode="best_fit", rows_per_window=3)
    found = Counter()
    for row in range(len(source)):
        sample = source[row]
        for document, offset, length, column in source.pieces(row):
            assert sample["tokens"][column : column + length].tolist() == stream[document + offset :][:length].tolist()
            found.update((document, offset + k) for k in range(length))
    starts = np.cumsum([0] + [len(r) for r in rows])[:-1]
    assert found == Counter((int(s), k) for s, r in zip(starts, rows) for k in range(len(r)))
    row = next(r for r in range(len(rows)) if rows[r])
    assert documents.describe_token(int(starts[row]) + len(rows[row]) - 1) == f"row {row}:{len(rows[row]) - 1}"
    with pytest.raises(ValueError, match="flatten_indices"):
        ArrowDocuments(dataset.shuffle(seed=0), "input_ids")
    with pytest.raises(ValueError, match="no column 'text'"):
        ArrowDocuments(dataset, "text")
    with pytest.raises(ValueError, match="lists of integer token ids"):
        ArrowDocuments(datasets.Dataset.from_dict({"input_ids": [1, 2]}), "input_ids")


def mixture_of_two(tmp_path, mode, seed):
    """Two packed sources of 40 documents each (data seeds `seed`, `seed` + 1), mixed by their lengths for one epoch
    of each: the mixture, the sources and their token streams."""
    sources, streams = [], []
    for number in range(2):
        (tmp_path / f"s{number}").mkdir()
        files, stream = write_documents(tmp_path / f"s{number}", seed=seed + number, documents=40, files=1)
        sources.append(packed((files, stream), mode, seed=number))
        streams.append(stream)
    lengths = [len(s) for s in sources]
    mix = Mixture(sources, lengths, sum(lengths), seed=1, window=sum(lengths), names=["a", "b"])
    assert mix.counts == tuple(lengths)
    return mix, sources, streams


def test_a_mixture_of_packed_sources_trains_every_token_of_each_once_across_a_resume(tmp_path):
    """Two packed sources mixed by their lengths for one epoch of each: 2 ranks stop unevenly, 3 finish; every
    (source, document, offset) exactly once."""
    mix, sources, streams = mixture_of_two(tmp_path, "first_fit", seed=10)
    trained, state = Counter(), None
    for world, stops in ((2, (3, 5)), (3, None)):
        loaders = [ResumableDataLoader(mix, batch_size=2, rank=r, world_size=world) for r in range(world)]
        for rank, loader in enumerate(loaders):
            if state is not None:
                loader.load_state_dict(state)
            for step, batch in enumerate(loader):
                positions = loader.last_indices().tolist()
                source, index = mix.locate(positions)
                for i, (s, row) in enumerate(zip(source.tolist(), index.tolist())):
                    sample = {k: v[i] for k, v in batch.items()}
                    trained.update((s, *t) for t in owned_tokens(sources[s], streams[s], [row], {row: sample}))
                if stops is not None and step + 1 == stops[rank]:
                    break
        state = merge_states([loader.state_dict() for loader in loaders], uneven=True)
    assert max(trained.values()) == 1
    assert trained == sum(
        (Counter({(s, *t): 1 for t in expected_tokens(src, streams[s])}) for s, src in enumerate(sources)), Counter()
    )


def test_sample_key_names_the_documents_and_token_ranges_of_a_row(corpus):
    source = packed(corpus, "best_fit")
    names = [f"{source.documents.describe_token(d + o)}+{n}" for d, o, n, _ in source.pieces(0)]
    assert source.sample_key(0) == tuple(names) and source.describe(0) == f"0 ({', '.join(names)})"


def test_bad_input_is_refused_clearly(corpus, tmp_path):
    files, _ = corpus
    tokens = TokenSource(files, seq_len=16, dtype="uint16", eos_id=EOS)
    for kw, message in (
        ({"mode": "greedy"}, "mode must be one of"),
        ({"fill": 0}, r"fill must be in \(0, 1\]"),
        ({"fill": 1.5}, "fill must be in"),
        ({"rows_per_window": 0}, "rows_per_window"),
        ({"seed": -1}, "seed must be a non-negative int"),
        ({"seq_len": 0}, "seq_len"),
    ):
        with pytest.raises(ValueError, match=message):
            PackedSource(tokens, **kw)
    with pytest.raises(ValueError, match="no document boundaries: pass eos_id= or doc_offsets="):
        PackedSource(TokenSource(files, seq_len=16, dtype="uint16"))
    with pytest.raises(ValueError, match="pass seq_len="):
        PackedSource(ListDocuments([5, 5]))
    with pytest.raises(TypeError, match="no document_starts"):
        PackedSource(torch.arange(10), seq_len=4)
    with pytest.raises(ValueError, match="too few for one row"):
        PackedSource(ListDocuments([3]), seq_len=4, mode="concat")
    with pytest.raises(ValueError, match="0 tokens are too few"):
        PackedSource(ListDocuments([]), seq_len=4)
    source = PackedSource(tokens)
    with pytest.raises(IndexError, match=f"row {len(source)} out of range for {len(source)} packed rows"):
        source[len(source)]


@pytest.mark.parametrize("epoch", [0, 1])
def test_the_audit_names_the_documents_and_token_ranges_of_duplicated_rows(corpus, tmp_path, capsys, epoch):
    """A run resumed from a stale state (checkpoint of the start of `epoch` declared two steps later) trains two
    batches again: the audit fails and names each duplicated row by the documents and token ranges that epoch
    packed into it (epoch 1's rows hold other documents than epoch 0's)."""
    source = packed(corpus, "best_fit")
    first = ResumableDataLoader(source, batch_size=2, rank=0, world_size=1, shuffle=True)
    first.ledger = Ledger.open(tmp_path, 0, len(source))
    step = 0
    for _ in range(epoch):
        step += sum(1 for _ in first)  # one step per batch
        first.ledger.record_finished(merge_states([first.state_dict()]), first)
    stale = first.state_dict()
    iterator, again_rows = iter(first), []
    for _ in range(2):
        next(iterator)
        again_rows += first.last_indices().tolist()
    first.ledger.close()
    again = ResumableDataLoader(source, batch_size=2, rank=0, world_size=1, shuffle=True)
    again.load_state_dict(stale)
    again.ledger = Ledger.open(tmp_path, step + 2, len(source))
    for _ in again:
        pass
    assert again.epoch == epoch
    again.ledger.record_finished(merge_states([again.state_dict()]), again)
    again.ledger.close()
    assert audit.main(str(tmp_path), describe=source.describe) == audit.FAILED
    duplicated = capsys.readouterr().out.split("duplicated indices: ")[1].splitlines()[0]
    for row in again_rows:
        assert source.describe(row, epoch) in duplicated and "part-" in source.describe(row, epoch)
    if epoch:
        assert any(source.describe(row, 0) not in duplicated for row in again_rows)


def write_offsets_corpus(directory, seed=5, documents=60):
    """One token file of documents and its .npy of document starts; returns both paths and the token count."""
    directory.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, documents)
    rng.integers(1, 500, int(lengths.sum())).astype(np.uint16).tofile(directory / "t.bin")
    np.save(directory / "t.npy", np.cumsum(np.concatenate(([0], lengths[:-1]))))
    return directory / "t.bin", directory / "t.npy", int(lengths.sum())


def packed_run(directory):
    """A PackedSource over the corpus in `directory`, the loader over it, and a model to checkpoint with."""
    tokens = TokenSource(directory / "t.bin", seq_len=16, dtype="uint16", doc_offsets=directory / "t.npy")
    source = PackedSource(tokens, mode="best_fit", rows_per_window=4)
    model = torch.nn.Linear(2, 1)
    return source, dict(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=ResumableDataLoader(source, batch_size=3, shuffle=True, seed=0),
    )


def trained_tokens(source, loader, batches=None):
    """The stream positions of the tokens of each row the loader delivers (all, or the first `batches`)."""
    found = Counter()
    for step, _ in enumerate(loader):
        for row in loader.last_indices().tolist():
            found.update(d + o + k for d, o, n, _ in source.pieces(row, loader.epoch) for k in range(n))
        if batches is not None and step + 1 == batches:
            break
    return found


def test_a_resume_after_the_offsets_were_rewritten_is_refused_naming_the_file(tmp_path):
    """The document offsets decide every packed row: a checkpoint saved before they were rewritten (the same
    tokens and document count, other starts) is refused naming the offsets file (it resumed, the rows holding
    other tokens). The same files copied to another disk (other inodes and mtimes) resume, every token of the
    epoch trained once."""
    from loader.checkpoint.publish import CheckpointError
    from loader.checkpoint.save import resume, save_checkpoint

    _, offsets, count = write_offsets_corpus(tmp_path / "data")
    source, objects = packed_run(tmp_path / "data")
    trained = trained_tokens(source, objects["loader"], batches=4)
    save_checkpoint(tmp_path / "run", 1, **objects)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("t.bin", "t.npy"):
        (copy / name).write_bytes((tmp_path / "data" / name).read_bytes())
    lengths = np.diff(np.append(np.load(offsets), count))
    np.save(offsets, np.cumsum(np.concatenate(([0], lengths[::-1][:-1]))))  # the documents' lengths reversed
    with pytest.raises(CheckpointError, match=rf"{offsets} changed since the checkpoint was saved"):
        resume(tmp_path / "run", **packed_run(tmp_path / "data")[1])
    source, objects = packed_run(copy)
    assert resume(tmp_path / "run", **objects) == 1
    trained.update(trained_tokens(source, objects["loader"]))
    assert trained == Counter(range(count))
