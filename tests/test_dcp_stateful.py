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


def _online(rank, world_size, path, resumed_step):
    """A Mixture whose weights the loop changes at steps 2 and 3 (the second right before the save), saved through
    DCP after unequal consumption (rank r takes r more updates), or loaded at another world size and trained to the
    end of epoch 1, its replayed request at the saved step asked with other weights. Returns what it trained as
    (epoch, position, sample) and the plan's JSON."""
    from loader.sources import Mixture
    from tests.test_mixture_online import WINDOW, N, sources

    warnings.simplefilter("ignore")  # DCP's and the lockstep warnings of unequal consumption

    mix = Mixture(sources(), [0.5, 0.2, 0.3], N, seed=5, window=WINDOW)
    dl = ResumableDataLoader(
        mix, batch_size=2, grad_accum=2, shuffle=True, seed=2, rank=rank, world_size=world_size, collate_fn=list
    )
    trained = []

    def update(it):
        for _ in range(dl.grad_accum):
            batch = next(it)
            trained.extend((dl.epoch, p, int(s[0])) for p, s in zip(dl.last_indices().tolist(), batch))

    if resumed_step is None:
        dl.step, it = 0, iter(dl)
        for step in range(3):
            if step == 2:
                assert dl.change_mixture([0, 1, 1]) is not None
            update(it)
        assert dl.change_mixture([1, 0, 1]) is not None  # at step 3
        for _ in range(rank):
            update(it)
        dcp.save({"loader": LoaderState(dl)}, checkpoint_id=path)
    else:
        dcp.load({"loader": LoaderState(dl)}, checkpoint_id=path)
        dl.step = resumed_step
        assert dl.change_mixture([1, 1, 1]) is None  # step 3 replayed: the recorded weights stand
        for epoch in (dl.epoch, dl.epoch + 1):
            dl.set_epoch(epoch)
            trained += [(epoch, p, int(s[0])) for b in dl for p, s in zip(dl.last_indices().tolist(), b)]
    return trained, json.dumps(mix.plan.to_dict())


@pytest.mark.slow
def test_online_mixture_changes_ride_in_the_dcp_state_and_resume_at_another_world_size(tmp_path):
    """Weights changed online at steps 2 and 3, saved through DCP by 3 ranks that consumed unequally, loaded by 2:
    the plan with both changes comes back (the replayed request at step 3 ignored), and over two epochs every
    position is trained once, as the sample the recorded plan names there, each source a permutation per source
    epoch; after the first change (source 0 at weight 0) no sample of source 0 until the second."""
    from loader.sources import MixturePlan
    from tests.test_mixture_online import WINDOW, check_exactly_once

    path = str(tmp_path / "ckpt")
    saved = run_group(_online, 3, path, None)
    resumed = run_group(_online, 2, path, 3)
    plans = {plan for _, plan in saved + resumed}
    assert len(plans) == 1  # every rank of both runs under the saved plan
    plan = MixturePlan.from_dict(json.loads(plans.pop()))
    (first, a), (second, b) = plan.requests
    assert (first, second) == (2, 3) and a < b
    trained = [t for run in saved + resumed for t in run[0]]
    check_exactly_once(trained, plan, 2)
    paused = [v for e, p, v in trained if e == 0 and a * WINDOW <= p < b * WINDOW]
    assert paused and all(v // 1000 != 0 for v in paused)


def test_a_dcp_state_with_online_changes_is_refused_by_another_mixture_and_leaves_it_as_it_was(tmp_path):
    """The plan in the DCP state is checked as resume checks the manifest's: a Mixture of other weights, or a
    dataset that is not a Mixture, is refused naming it, the loader and its plan unchanged; without a change the
    `dataset` entry is the fingerprint alone, as before."""
    from loader.core.state import StateError
    from loader.sources import Mixture
    from tests.test_mixture_online import WINDOW, N, sources

    def loader(weights=(0.5, 0.2, 0.3)):
        mix = Mixture(sources(), list(weights), N, seed=5, window=WINDOW)
        return ResumableDataLoader(mix, batch_size=4, shuffle=True, collate_fn=list)

    dl = loader()
    assert json.loads(LoaderState(dl).state_dict()["dataset"]) == dl.dataset.fingerprint()
    dl.step, it = 0, iter(dl)
    next(it)
    dl.change_mixture([1, 1, 0])
    entry = json.loads(LoaderState(dl).state_dict()["dataset"])
    assert entry["mixture_plan"] == dl.dataset.plan.to_dict() and len(json.dumps(entry)) < 1000
    _dcp_call(dcp.save, dl, tmp_path)
    for other, message in (
        (loader([0.4, 0.3, 0.3]), "not this mixture's plan with changes added"),
        (ResumableDataLoader(IndexDataset(N), batch_size=4), "this loader's dataset is a IndexDataset"),
    ):
        before = other.state_dict(), getattr(other.dataset, "plan", None)
        with pytest.raises(StateError, match=f"the DCP checkpoint loaded into LoaderState: .*{message}"):
            _dcp_call(dcp.load, other, tmp_path)
        assert (other.state_dict(), getattr(other.dataset, "plan", None)) == before
    resumed = loader()
    _dcp_call(dcp.load, resumed, tmp_path)
    assert resumed.dataset.plan == dl.dataset.plan
