"""A Hugging Face `datasets.Dataset` (Arrow, memory-mapped from disk) as a source and as a mixture component."""

import numpy as np
import pytest
import torch

from loader import ResumableDataLoader, merge_states
from loader.sources import Mixture, TokenSource

datasets = pytest.importorskip(
    "datasets", reason="Hugging Face datasets is an optional test dependency (pip install -e '.[hf]')"
)

SEQ = 8


@pytest.fixture(scope="module")
def arrow(tmp_path_factory):
    """Two packed-sequence datasets saved to disk and loaded back memory-mapped, as `load_from_disk` gives them."""
    root = tmp_path_factory.mktemp("hf")
    loaded = {}
    for name, size, base in (("web", 40, 0), ("code", 13, 10_000)):
        rows = {"input_ids": [list(range(base + i * SEQ, base + (i + 1) * SEQ + 1)) for i in range(size)]}
        datasets.Dataset.from_dict(rows).save_to_disk(str(root / name))
        loaded[name] = datasets.load_from_disk(str(root / name)).with_format("torch")
    return loaded


def test_an_arrow_dataset_is_memory_mapped_and_resumes_at_another_world_size(arrow):
    web = arrow["web"]
    assert web.cache_files  # backed by Arrow files on disk, not held in memory
    first = [ResumableDataLoader(web, batch_size=3, shuffle=True, seed=1, rank=r, world_size=2) for r in range(2)]
    seen = []
    for dl in first:
        it = iter(dl)
        for _ in range(2 + dl.rank):  # uneven stops
            batch = next(it)
            assert torch.equal(batch["input_ids"], web[dl.last_indices().tolist()]["input_ids"])
            seen += dl.last_indices().tolist()
    state = merge_states([dl.state_dict() for dl in first], uneven=True)
    for r in range(3):
        dl = ResumableDataLoader(web, batch_size=3, shuffle=True, seed=1, rank=r, world_size=3)
        dl.load_state_dict(state)
        for batch in dl:
            assert torch.equal(batch["input_ids"], web[dl.last_indices().tolist()]["input_ids"])
            seen += dl.last_indices().tolist()
    assert sorted(seen) == list(range(len(web)))


def test_arrow_datasets_mix_with_each_other_and_with_token_files(arrow, tmp_path):
    mix = Mixture([arrow["web"], arrow["code"]], [0.75, 0.25], num_samples=100, seed=2, names=["web", "code"])
    source, index = mix.locate(list(range(100)))
    batches = list(ResumableDataLoader(mix, batch_size=10))
    tokens = torch.cat([b["input_ids"] for b in batches])
    assert tokens[:, 0].tolist() == [(10_000 if s else 0) + i * SEQ for s, i in zip(source.tolist(), index.tolist())]
    assert mix.sample_key(7) == (mix.names[source[7]], int(index[7]))
    assert (
        mix.fingerprint()
        != Mixture([arrow["code"], arrow["web"]], [0.75, 0.25], 100, 2, names=["web", "code"]).fingerprint()
    )  # the sources' own fingerprints count

    np.arange(500, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    files = TokenSource(tmp_path / "tokens.bin", seq_len=SEQ, dtype="uint16")
    both = Mixture([files, arrow["code"]], [0.5, 0.5], num_samples=20, seed=0)
    as_tokens = [s["input_ids"] if isinstance(s, dict) else s for s in both.__getitems__(list(range(20)))]
    source, index = both.locate(list(range(20)))
    assert [t[0].item() for t in as_tokens] == [10_000 + i * SEQ if s else i * SEQ for s, i in zip(source, index)]


def test_a_mixture_batch_with_an_arrow_component_equals_its_positions_one_by_one(arrow, tmp_path):
    """The Arrow dataset's own __getitems__ serves its share of a batch: the same rows as one lookup per position,
    back in position order."""
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    files = TokenSource(tmp_path / "tokens.bin", seq_len=SEQ, dtype="uint16")
    mix = Mixture([files, arrow["web"], arrow["code"]], [0.4, 0.4, 0.2], num_samples=300, seed=6)

    def as_tokens(samples):
        return [(s["input_ids"] if isinstance(s, dict) else s).tolist() for s in samples]

    rng = np.random.default_rng(1)
    for batch in [list(range(300))] + [rng.integers(0, 300, size).tolist() for size in (1, 8, 32)]:
        assert as_tokens(mix.__getitems__(batch)) == as_tokens([mix[p] for p in batch])
