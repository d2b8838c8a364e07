"""The loader as a DCP Stateful in a real gloo group: saved by 2 ranks, loaded by 3, every sample once."""

import itertools
import json
import os
import pickle
import re
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loader import ResumableDataLoader
from loader.integrations.dcp import LoaderState, ModelAndOptimizer, dcp_load
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


def _dcp_call(call, loader, path):
    with warnings.catch_warnings():  # one process, no group: DCP warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        call({"loader": LoaderState(loader)}, checkpoint_id=path)


def test_a_dcp_checkpoint_resumes_under_an_amended_schedule_and_a_silent_edit_is_refused(tmp_path):
    """Saved through DCP under mixture plan A after 3 steps (12 positions), loaded under plan B that amends A from
    position 12: every position of the epoch exactly once, the first 12 as A had them, the rest as B has them. B
    changing inside what A committed, and B without amends= (the weights edited silently), are refused as resume
    refuses them, and leave the loader as it was."""
    from loader.core.state import StateError
    from tests.test_mixture_schedule import scheduled

    lengths, n, window, path = [13, 7], 64, 4, str(tmp_path / "ckpt")
    old = scheduled(lengths, [{"weights": [3, 1]}], n, window=window)
    dl = ResumableDataLoader(old, batch_size=4, shuffle=False, collate_fn=list)
    it, positions, trained = iter(dl), [], []
    for _ in range(3):
        trained += next(it)
        positions += dl.last_indices().tolist()
    _dcp_call(dcp.save, dl, path)

    new_schedule = [{"from": [3, 1], "to": [0, 1], "windows": 6}, {"weights": [1, 1]}]
    refused = [
        (
            scheduled(lengths, new_schedule, n, window=window, amends=old.plan, change_at=8),
            r"the schedule change begins at position 8 .* up to 11 under the old plan: pass change_at >= 12",
        ),
        (
            scheduled(lengths, new_schedule, n, window=window),
            r"dataset fingerprint is '\w+' in the checkpoint but '\w+' here: .* a Mixture's sources, weights or "
            r"schedule changed",
        ),
    ]
    for mix, message in refused:
        fresh = ResumableDataLoader(mix, batch_size=4, shuffle=False, collate_fn=list)
        before = fresh.state_dict()
        with pytest.raises(StateError, match=message):
            _dcp_call(dcp.load, fresh, path)
        assert fresh.state_dict() == before

    new = scheduled(lengths, new_schedule, n, window=window, amends=old.plan, change_at=12)
    resumed = ResumableDataLoader(new, batch_size=4, shuffle=False, collate_fn=list)
    _dcp_call(dcp.load, resumed, path)
    after = []
    for batch in resumed:
        after += batch
        positions += resumed.last_indices().tolist()
    assert sorted(positions) == list(range(n))  # every position of the epoch once: trained before + after
    assert trained == [old[p] for p in range(12)] and after == [new[p] for p in range(12, n)]
    assert [old[p] for p in range(12)] == [new[p] for p in range(12)]


class Typed(torch.nn.Module):
    """A model whose state holds tensors of several dtypes, layouts and memory formats, as DCP's metadata names them."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(3, 2)
        self.register_buffer("halves", torch.randn(4, dtype=torch.float16))
        self.register_buffer("brain", torch.randn(2, 3, dtype=torch.bfloat16))
        self.register_buffer("count", torch.randint(0, 2**40, (5,)))
        self.register_buffer("mask", torch.rand(6) > 0.5)
        self.register_buffer("octets", torch.randint(0, 255, (3,), dtype=torch.uint8))
        self.register_buffer("phase", torch.randn(2, dtype=torch.complex64))
        self.register_buffer("image", torch.randn(1, 2, 2, 2).to(memory_format=torch.channels_last))


def _dcp_objects(seed):
    model = Typed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    dl = ResumableDataLoader(IndexDataset(30), batch_size=4, shuffle=True, seed=3)
    return model, optimizer, dl, {"train": ModelAndOptimizer(model, optimizer), "loader": LoaderState(dl)}


def test_dcp_load_resumes_a_real_dcp_checkpoint_and_refuses_a_crafted_metadata_without_running_it(tmp_path):
    """What the project's own DCP flow saves (a model of several dtypes, its optimizer, LoaderState) loads through
    dcp_load, every index of the epoch once; the same checkpoint with a `.metadata` that would run code is refused
    naming the file and the function, and nothing runs."""
    from loader.checkpoint.publish import CheckpointError
    from tests.test_checkpoint import RunsCommand

    model, optimizer, dl, state = _dcp_objects(0)
    model.linear(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    it = iter(dl)
    delivered = [i for _ in range(3) for i in next(it).tolist()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save(state, checkpoint_id=tmp_path / "good")
        shutil.copytree(tmp_path / "good", tmp_path / "crafted")
        marker = tmp_path / "code-ran"
        metadata = pickle.loads((tmp_path / "good" / ".metadata").read_bytes())  # written just now: trusted
        metadata.planner_data = RunsCommand(marker)
        (tmp_path / "crafted" / ".metadata").write_bytes(pickle.dumps(metadata))

        fresh, fresh_optimizer, resumed, loaded = _dcp_objects(1)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        refusal = f"checkpoint file {tmp_path / 'crafted' / '.metadata'} names {os.system.__module__}.system, which"
        with pytest.raises(CheckpointError, match=re.escape(refusal)):
            dcp_load(loaded, tmp_path / "crafted")
        assert not marker.exists() and resumed.state_dict()["epoch"] == 0
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())

        dcp_load(loaded, tmp_path / "good")
    for key, value in model.state_dict().items():
        restored = fresh.state_dict()[key]
        assert restored.dtype == value.dtype and torch.equal(restored, value), key
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())
    assert sorted(delivered + [i for b in resumed for i in b.tolist()]) == list(range(30))


def test_dcp_load_resumes_a_loader_state_saved_before_0_1_0_with_a_warning(tmp_path):
    """A real DCP checkpoint in the layout LoaderState wrote before 0.1.0 (the merged progress only, under
    `dataloader.progress`; torch's dcp.load fails on it with "Missing key ... dataloader.dataset"): dcp_load loads it
    with a warning that names the release and what was not checked, and every index of the epoch is trained once;
    a loader of another order is still refused by the progress's own fingerprint."""
    from loader.checkpoint.publish import CheckpointWarning
    from loader.checkpoint.save import global_progress
    from loader.core.state import StateError

    dl = ResumableDataLoader(IndexDataset(30), batch_size=4, shuffle=True, seed=0)
    it = iter(dl)
    delivered = [i for _ in range(3) for i in next(it).tolist()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save({"dataloader": {"progress": json.dumps(global_progress(dl))}}, checkpoint_id=tmp_path)
        other = ResumableDataLoader(IndexDataset(30), batch_size=4, shuffle=True, seed=1)
        with pytest.raises(StateError, match="seed"):  # refused before it warns
            dcp_load({"dataloader": LoaderState(other)}, tmp_path)
        resumed = ResumableDataLoader(IndexDataset(30), batch_size=4, shuffle=True, seed=0)
        with pytest.warns(
            CheckpointWarning,
            match=r"'dataloader' holds the loader progress only, as LoaderState "
            r"wrote it before release 0\.1\.0: .* without checking",
        ):
            dcp_load({"dataloader": LoaderState(resumed)}, tmp_path)
    assert sorted(delivered + [i for b in resumed for i in b.tolist()]) == list(range(30))
