import os

import numpy as np
import pytest
from hypothesis import settings
from torch.utils.data import Dataset

# The same examples on every run: a property test that fails once fails every time, and CI never flakes.
settings.register_profile("deterministic", derandomize=True, database=None)
# For hunting (`HYPOTHESIS_PROFILE=explore pytest --hypothesis-seed=N tests/test_x.py`): new examples each seed, no
# deadline, and a failure prints the @reproduce_failure blob that replays it.
settings.register_profile("explore", derandomize=False, database=None, deadline=None, print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "deterministic")
settings.load_profile(PROFILE)
# How many times each test's own max_examples the explore profile runs.
EXPLORE_FACTOR = int(os.environ.get("HYPOTHESIS_EXPLORE_FACTOR", "20"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under `-n 2 --dist loadgroup` (CI): the tests that start processes of their own (`slow`) run one after the
    other on one worker, as they would alone, and every other module is a unit the other worker may take, so the
    in-process tests run beside them (module fixtures are made once).

    Under the explore profile only the property tests run, and a test's own @settings (max_examples sized for CI,
    some derandomize=True) would override the profile: re-parent each onto it, with EXPLORE_FACTOR times the
    examples. Hypothesis reads this attribute at call time and has no public hook for it."""
    for item in items:
        group = "slow" if item.get_closest_marker("slow") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
    if PROFILE != "explore":
        return
    kept, done = [], set()
    for item in items:
        test = getattr(item, "function", None)
        if not getattr(test, "is_hypothesis_test", False):
            continue
        kept.append(item)
        if test not in done:  # the items of a parametrized test share one function: multiply once
            done.add(test)
            own = test._hypothesis_internal_use_settings
            test._hypothesis_internal_use_settings = settings(
                own,
                max_examples=own.max_examples * EXPLORE_FACTOR,
                derandomize=False,
                database=None,
                deadline=None,
                print_blob=True,
            )
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


class IndexDataset(Dataset):
    """Each sample is its own index, so a batch shows exactly which samples were delivered."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        return int(index)


@pytest.fixture(autouse=True)
def _seeded():
    np.random.seed(0)


def assert_batches_match_torch(dataset, workers: int, **kwargs) -> list[list[int]]:
    """A pass of ResumableDataLoader (default collate) over `dataset`: each batch is torch.equal, as an int64
    tensor, to torch's DataLoader's batch for the same index list and to the stack of its samples one by one.
    Returns the index lists."""
    import torch
    from torch.utils.data import DataLoader

    from loader import ResumableDataLoader

    context = dict(num_workers=workers, multiprocessing_context="fork" if workers else None)
    loader = ResumableDataLoader(dataset, **kwargs, **context)
    batches, ids = [], []
    for batch in loader:
        batches.append(batch)
        ids.append(loader.last_indices().tolist())
    assert ids
    theirs = list(DataLoader(dataset, batch_sampler=ids, **context))
    assert len(theirs) == len(batches)
    for ours, torchs, indices in zip(batches, theirs, ids):
        expected = torch.stack([dataset[i] for i in indices])
        assert ours.dtype == torchs.dtype == expected.dtype == torch.int64
        assert torch.equal(ours, torchs) and torch.equal(ours, expected)
    return ids


def outcomes(dl, error: type[BaseException] = Exception):
    """A pass, batch by batch: (the indices the sampler dealt it, the batch or the `error` its loading raised). A batch
    that failed to load is consumed, and the pass goes on; a delivered batch is the one `last_indices()` names."""
    iterator = iter(dl)
    while True:
        upcoming = dl.resumable_sampler.next_indices().tolist()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except error as err:
            yield upcoming, err
        else:
            assert dl.last_indices().tolist() == upcoming
            yield upcoming, batch
