"""The epoch channel: a PackedSource handed to the loader packs each epoch of the loader its own way, every document
token exactly once per epoch, with 0 or persistent workers, across a resume mid-epoch at another world size, inside
a Mixture; its fingerprint is the same in every epoch. (The audit's names of epoch 1's rows: tests/test_packing.py.)"""

import hashlib
import json
from collections import Counter

import pytest
import torch

from loader import ResumableDataLoader, merge_states
from loader.checkpoint.save import check_change, check_dataset
from loader.core.state import StateError
from tests.test_packing import expected_tokens, mixture_of_two, owned_tokens, packed, write_documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("epochs"), documents=80)


def note(loader, batch, source, stream, trained, rows_of):
    """The batch just delivered: each row checked against its epoch's packing, its (document, offset) tokens counted
    per epoch, and its tokens noted per (epoch, row)."""
    epoch, rows = loader.epoch, loader.last_indices().tolist()
    samples = {row: {k: v[i] for k, v in batch.items()} for i, row in enumerate(rows)}
    trained[epoch].update(owned_tokens(source, stream, rows, samples, epoch))
    rows_of.update({(epoch, row): samples[row]["tokens"].tolist() for row in rows})


def train(loader, source, stream, trained, rows_of, stop=None, batches=None):
    """One pass of `loader` (or `stop` batches of it, or of its iterator `batches`), each batch noted."""
    for step, batch in enumerate(loader if batches is None else batches):
        note(loader, batch, source, stream, trained, rows_of)
        if stop is not None and step + 1 == stop:
            return


def assert_each_epoch_packed_anew(source, stream, trained, rows_of):
    """Every token exactly once in each of epochs 0 and 1, and epoch 1's rows other than epoch 0's."""
    assert sorted(trained) == [0, 1]
    for epoch in (0, 1):
        assert trained[epoch] == expected_tokens(source, stream), f"epoch {epoch}: a token skipped or trained twice"
    changed = [row for row in range(len(source)) if rows_of[0, row] != rows_of[1, row]]
    assert len(changed) > len(source) // 2, "epoch 1 trained epoch 0's rows"


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_each_epoch_packs_anew_across_a_mid_epoch_resume_into_a_fresh_loader(corpus, workers):
    """Epoch 0 whole, 3 batches of epoch 1 (the workers prefetch further), then a fresh loader resumes the saved
    state mid-epoch 1 and finishes it after a set_epoch(1) and a superseded iterator. peek() shows the next batch
    as its epoch packs it, also past the end of an epoch."""
    source, (_, stream) = packed(corpus, "best_fit"), corpus
    options = dict(
        batch_size=3,
        shuffle=True,
        seed=5,
        rank=0,
        world_size=1,
        num_workers=workers,
        persistent_workers=bool(workers),
        multiprocessing_context="fork" if workers else None,
    )
    trained, rows_of = {0: Counter(), 1: Counter()}, {}
    first = ResumableDataLoader(source, **options)
    train(first, source, stream, trained, rows_of)
    peeked, batches = first.peek(), iter(first)  # epoch 0 is exhausted: the next batch is epoch 1's first
    batch = next(batches)
    assert torch.equal(batch["tokens"], peeked["tokens"])
    note(first, batch, source, stream, trained, rows_of)
    train(first, source, stream, trained, rows_of, stop=2, batches=batches)
    state = first.state_dict()
    del first
    again = ResumableDataLoader(source, **options)
    again.load_state_dict(state)
    peeked, batch = again.peek(), next(iter(again))  # delivered, then its iterator superseded
    assert torch.equal(batch["tokens"], peeked["tokens"])
    note(again, batch, source, stream, trained, rows_of)
    again.set_epoch(1)
    with pytest.warns(UserWarning, match="continues epoch 1"):
        train(again, source, stream, trained, rows_of)
    assert again.exhausted and again.epoch == 1
    assert_each_epoch_packed_anew(source, stream, trained, rows_of)


def test_a_resume_mid_epoch_1_at_another_world_size_packs_epoch_1(corpus):
    """4 ranks finish epoch 0 and stop unevenly in epoch 1; 3 ranks resume the merged state and finish it."""
    source, (_, stream) = packed(corpus, "first_fit"), corpus
    trained, rows_of, state = {0: Counter(), 1: Counter()}, {}, None
    for world, stops in ((4, (1, 3, 2, 4)), (3, (None,) * 3)):
        loaders = [
            ResumableDataLoader(source, batch_size=2, shuffle=True, seed=2, rank=r, world_size=world)
            for r in range(world)
        ]
        for loader, stop in zip(loaders, stops):
            if state is None:
                train(loader, source, stream, trained, rows_of)
            else:
                loader.load_state_dict(state)
            train(loader, source, stream, trained, rows_of, stop)
        state = merge_states([loader.state_dict() for loader in loaders], uneven=True)
    assert_each_epoch_packed_anew(source, stream, trained, rows_of)


def test_a_mixture_passes_the_epoch_to_its_packed_sources(tmp_path):
    """Two packed sources mixed for one epoch of each, over two epochs of the loader: each source packs each loader
    epoch anew, every one of its tokens exactly once per epoch."""
    mix, sources, streams = mixture_of_two(tmp_path, "best_fit", seed=20)
    assert mix.epoch_aware
    trained = {(s, e): Counter() for s in range(2) for e in range(2)}
    rows_of = {}
    loader = ResumableDataLoader(mix, batch_size=4, shuffle=False)
    for _ in range(2):
        for batch in loader:
            located = mix.locate(loader.last_indices().tolist())
            for i, (s, row) in enumerate(zip(*(part.tolist() for part in located))):
                sample = {k: v[i] for k, v in batch.items()}
                trained[s, loader.epoch].update(
                    owned_tokens(sources[s], streams[s], [row], {row: sample}, loader.epoch)
                )
                rows_of[s, loader.epoch, row] = sample["tokens"].tolist()
    for s, source in enumerate(sources):
        per_source = {e: trained[s, e] for e in range(2)}
        assert_each_epoch_packed_anew(
            source, streams[s], per_source, {(e, r): rows_of[s, e, r] for e in range(2) for r in range(len(source))}
        )


def legacy_fingerprint(source, epoch):
    """The fingerprint a release that packed every epoch with PackedSource(epoch=) wrote: its layout held the epoch
    (and the TokenSource's fingerprint of then, without the files' content)."""
    layout = {
        "documents": source.documents.fingerprint_of_earlier_release(),
        "seq_len": source.seq_len,
        "mode": source.mode,
        "rows_per_window": source.rows_per_window,
        "fill": source.fill,
        "seed": source.seed,
        "epoch": epoch,
        "pad_id": source.pad_id,
    }
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


def test_the_fingerprint_is_the_same_in_every_epoch_and_older_checkpoints_resume_where_they_fit(corpus):
    """A checkpoint of epoch 0 resumes in epoch 1 and back (one fingerprint); one of a release that packed every
    epoch alike resumes where its part-trained epoch is the one it packed, and is refused clearly elsewhere."""
    source = packed(corpus, "best_fit")
    assert source.fingerprint() == packed(corpus, "best_fit", epoch=1).fingerprint()
    assert source.fingerprint() != packed(corpus, "best_fit", seed=4).fingerprint()
    loader = ResumableDataLoader(source, batch_size=2, shuffle=True, rank=0, world_size=1)
    for _ in loader:
        pass
    iterator = iter(loader)
    next(iterator)
    in_epoch_1 = loader.state_dict()
    fresh = ResumableDataLoader(source, batch_size=2, shuffle=True, rank=0, world_size=1)
    check_dataset(source.fingerprint(), fresh, "the checkpoint")
    old = legacy_fingerprint(source, 0)
    assert old != source.fingerprint()
    check_dataset(old, fresh, "the checkpoint")
    check_change(old, fresh, fresh.state_dict())  # nothing committed: fits
    with pytest.raises(StateError, match=r"PackedSource\(epoch=0\), and its epoch 1 is part trained"):
        check_change(old, fresh, in_epoch_1)
    with pytest.raises(StateError, match="dataset fingerprint"):
        check_dataset(legacy_fingerprint(source, 1), fresh, "the checkpoint")
    by_epoch_1 = ResumableDataLoader(
        packed(corpus, "best_fit", epoch=1), batch_size=2, shuffle=True, rank=0, world_size=1
    )
    check_dataset(legacy_fingerprint(source, 1), by_epoch_1, "the checkpoint")
    check_change(legacy_fingerprint(source, 1), by_epoch_1, in_epoch_1)
