import numpy as np
import pytest
from torch.utils.data import Dataset


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
