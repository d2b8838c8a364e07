"""The loader as a DCP Stateful in a real gloo group: saved by 2 ranks, loaded by 3, every sample once."""

import itertools
import warnings

import torch
import torch.distributed.checkpoint as dcp

from loader import ResumableDataLoader
from loader.integrations.dcp import LoaderState
from tests.conftest import IndexDataset
from tests.distributed import run_group


def _loader(rank, world_size):
    return ResumableDataLoader(IndexDataset(90), batch_size=4, shuffle=True, seed=2, rank=rank, world_size=world_size)


def _save(rank, world_size, path):
    dl = _loader(rank, world_size)
    delivered = [i for b in itertools.islice(dl, 3 + rank) for i in b.tolist()]  # uneven: 3 and 4 batches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"loader": LoaderState(dl)}, checkpoint_id=path)
    return delivered


def _load(rank, world_size, path):
    dl = _loader(rank, world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"loader": LoaderState(dl)}, checkpoint_id=path)
    return [i for b in dl for i in b.tolist()]


def test_saved_at_two_ranks_loaded_at_three(tmp_path):
    before = sum(run_group(_save, 2, str(tmp_path)), [])
    after = sum(run_group(_load, 3, str(tmp_path)), [])
    assert len(before) == 7 * 4
    assert sorted(before + after) == list(range(90))  # nothing twice, nothing skipped, nothing dropped


def _fsdp_job(rank, world_size, path, save):
    """FSDP2-sharded model and Adam: save at one world size, load at another, take one more identical step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from loader.checkpoint.save import load_checkpoint, save_checkpoint

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    dl = _loader(rank, world_size)

    def step(seed):
        torch.manual_seed(seed)
        model(torch.randn(2, 6)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    if save:
        for seed in range(3):
            step(seed)
        save_checkpoint(path, 3, model=model, optimizer=optimizer, loader=dl)
    else:
        load_checkpoint(f"{path}/step-000000003", model=model, optimizer=optimizer, loader=dl)
    step(99)  # uses Adam's moments: equal only if the sharded optimizer state was restored
    return {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}


def test_sharded_fsdp_state_saved_at_two_ranks_loads_at_three(tmp_path):
    saved = run_group(_fsdp_job, 2, str(tmp_path), True)
    loaded = run_group(_fsdp_job, 3, str(tmp_path), False)
    assert loaded[0] == loaded[1] == loaded[2]
    for key in saved[0]:  # averaging W equal gradients is exact for W=2, within rounding for W=3
        torch.testing.assert_close(torch.tensor(loaded[0][key]), torch.tensor(saved[0][key]), rtol=1e-6, atol=1e-7)
