"""Rows and collate: a batch made as one tensor is handed on as that tensor, and any other list as default_collate's."""

import copy
import pickle

import pytest
import torch
from torch.utils.data import default_collate, default_convert

from loader import ResumableDataLoader
from loader.core.rows import Rows, collate


def batches():
    return [
        torch.arange(6 * 5).reshape(6, 5),
        torch.rand(3, 2, 4, dtype=torch.float64),
        torch.arange(7, dtype=torch.int16).reshape(7, 1),
        torch.zeros(1, 3, dtype=torch.uint8),
    ]


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("batch", batches())
def test_intact_rows_collate_to_their_own_tensor_equal_to_default_collate(batch):
    rows = Rows(batch)
    assert isinstance(rows, list) and len(rows) == len(batch)
    assert all(same(r, b) for r, b in zip(rows, batch))
    collated = collate(rows)
    assert collated is batch  # no copy
    assert same(collated, default_collate(list(rows)))
    assert same(default_collate(rows), batch)  # torch's own collate still stacks them right


def edits():
    extra = torch.full((5,), -1)
    return {
        "replace": lambda rows: rows.__setitem__(2, extra),
        "replace by itself from another list": lambda rows: rows.__setitem__(2, Rows(rows.batch)[2]),
        "swap": lambda rows: rows.__setitem__(slice(0, 2), [rows[1], rows[0]]),
        "append": lambda rows: rows.append(extra),
        "pop": lambda rows: rows.pop(),
        "pop first": lambda rows: rows.pop(0),
        "insert": lambda rows: rows.insert(1, extra),
        "reverse": lambda rows: rows.reverse(),
    }


@pytest.mark.parametrize("edit", list(edits()))
def test_rows_changed_after_they_were_built_collate_what_they_hold(edit):
    rows = Rows(torch.arange(6 * 5).reshape(6, 5))
    edits()[edit](rows)
    collated = collate(rows)
    assert collated is not rows.batch
    assert same(collated, torch.stack(list(rows)))
    restored = pickle.loads(pickle.dumps(rows))  # travels as the plain list it now is
    assert type(restored) is list and all(same(a, b) for a, b in zip(restored, rows))


def test_plain_lists_are_default_collated():
    tensors = list(torch.arange(12).reshape(4, 3))
    assert same(collate(tensors), default_collate(tensors))
    pairs = [{"x": torch.tensor([i]), "y": i} for i in range(3)]
    got, expected = collate(pairs), default_collate(pairs)
    assert same(got["x"], expected["x"]) and same(got["y"], expected["y"])
    assert collate([(1, 2.0), (3, 4.0)])[1].dtype == torch.float64


def test_rows_pickle_and_copy_as_their_tensor():
    batch = torch.arange(8 * 100).reshape(8, 100)
    rows = Rows(batch)
    data = pickle.dumps(rows)
    assert len(data) < 2 * batch.numel() * batch.element_size()  # once, not a whole storage per row
    for twin in (pickle.loads(data), copy.copy(rows), copy.deepcopy(rows)):
        assert type(twin) is Rows and twin.intact() and same(collate(twin), batch)
    assert copy.deepcopy(rows).batch.data_ptr() != batch.data_ptr()


class Table(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([i, 2 * i])

    def __getitems__(self, indices):
        return Rows(torch.stack([self[i] for i in indices]))


def test_the_loader_collates_with_rows_unless_told_otherwise():
    mine = lambda batch: batch  # noqa: E731
    for given in (None, default_collate):
        assert ResumableDataLoader(Table(), batch_size=4, collate_fn=given).collate_fn is collate
    assert ResumableDataLoader(Table(), batch_size=4, collate_fn=mine).collate_fn is mine
    assert ResumableDataLoader(Table(), batch_size=None).collate_fn is default_convert  # no batching: no Rows
    assert type(next(iter(ResumableDataLoader(Table(), batch_size=4, collate_fn=mine)))) is Rows
    for batch_size in (4, 5):
        loader = ResumableDataLoader(Table(), batch_size=batch_size, shuffle=True, seed=2)
        for batch in loader:
            expected = torch.stack([Table()[i] for i in loader.last_indices().tolist()])
            assert same(batch, expected)
