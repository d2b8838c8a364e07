import numpy as np
import pytest
from hypothesis import settings
from torch.utils.data import Dataset

# The same examples on every run: a property test that fails once fails every time, and CI never flakes.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


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
