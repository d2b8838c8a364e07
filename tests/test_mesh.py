"""The loader under a DeviceMesh: it partitions over the data-parallel coordinates, and every peer of one
data-parallel rank (tensor, context, pipeline or expert parallel) gets bit-identical batches. Real gloo groups of
forked processes, real meshes; every test counts every sample of every epoch: delivered exactly once."""

import hashlib
import json
import math
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.data import Dataset

from loader import ResumableDataLoader, StateError, merge_states
from loader.checkpoint.lockstep import LockstepWarning
from loader.checkpoint.save import global_progress, save_checkpoint
from loader.core.mesh import flat_rank
from loader.streams.shards import ShardedStream
from tests.conftest import IndexDataset
from tests.distributed import run_group
from tests.streams import FORK

pytestmark = pytest.mark.slow


class Drawn(Dataset):
    """A sample: its index, its per-sample seed, and a draw of the worker's own torch generator, which the loader
    seeds (the peers' processes hold different generators)."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, index):
        return int(index), index.seed, torch.rand(()).item()


class Records(ShardedStream):
    """Shards of uneven lengths; a record names itself and carries a draw of the worker's torch generator."""

    LENGTHS = (5, 3, 7, 2, 6, 4)

    def shards(self):
        return [f"shard-{i}" for i in range(len(self.LENGTHS))]

    def iter_shard(self, index, start):
        for record in range(start, self.LENGTHS[index]):
            yield index, record, torch.rand(()).item()


def plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def digest(batch) -> str:
    return hashlib.sha256(json.dumps(plain(batch)).encode()).hexdigest()


def identities(batch) -> list:
    """Sample indices of a map-style batch, (shard, record) pairs of a stream's."""
    return plain(batch[0]) if isinstance(batch[0], torch.Tensor) else [tuple(r[:2]) for r in batch]


def deliver(dl, epochs: int, limit: int | None = None) -> list:
    """(epoch, digest, identities) of each batch delivered up to the end of epoch `epochs - 1`, or `limit` batches."""
    out = []
    for epoch in range(dl.epoch, epochs):
        dl.set_epoch(epoch)
        for batch in dl:
            out.append((epoch, digest(batch), identities(batch)))
            if len(out) == limit:
                return out
    return out


def data_mesh(shape, names, dp_dims):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return mesh, mesh[dp_dims]


MAKERS = {
    "map": lambda **where: ResumableDataLoader(
        Drawn(), batch_size=3, shuffle=True, seed=5, grad_accum=2, sample_seeds=True, num_workers=2, **FORK, **where
    ),
    "stream": lambda **where: ResumableDataLoader(
        Records(), batch_size=2, shuffle=True, seed=5, num_workers=2, collate_fn=list, **FORK, **where
    ),
}


def _peers_job(rank, world_size, shape, names, dp_dims, spelling):
    torch.manual_seed(1000 + rank)  # as a script that seeds by global rank: the peers' generators differ
    _, dp = data_mesh(shape, names, dp_dims)
    where = {"dp_mesh": dp} if spelling == "dp_mesh" else {"dp_group": dp.get_group()}
    out = {}
    for kind, make in MAKERS.items():
        first = make(**where)
        seen = deliver(first, 2, limit=4)  # two updates of epoch 0, then a resume from the saved progress
        progress = json.loads(json.dumps(global_progress(first)))
        resumed = make(**where)
        resumed.load_state_dict(progress)
        out[kind] = (first.rank, first.world_size, seen, deliver(resumed, 2))
    return out


def replicas(results: list, kind: str) -> dict[int, list]:
    """Per data-parallel rank, the deliveries of each of its processes."""
    by_rank: dict[int, list] = {}
    for result in results:
        dp_rank, _, seen, rest = result[kind]
        by_rank.setdefault(dp_rank, []).append(seen + rest)
    return by_rank


def assert_each_once_per_epoch(deliveries: list, expected: list, epochs: int) -> None:
    for epoch in range(epochs):
        counts = Counter(i for d in deliveries for e, _, ids in d if e == epoch for i in ids)
        assert sorted(counts) == sorted(expected) and set(counts.values()) == {1}, f"epoch {epoch}: {counts}"


@pytest.mark.parametrize(
    "case",
    [
        ((2, 2), ("dp", "tp"), "dp", "dp_mesh"),  # tensor parallel peers
        ((2, 2), ("pp", "dp"), "dp", "dp_mesh"),  # pipeline stages: every stage of a dp rank gets its batches
        ((2, 2), ("dp", "cp"), "dp", "dp_group"),  # context parallel, the data-parallel group given as a ProcessGroup
    ],
    ids=["dp2-tp2", "pp2-dp2", "dp2-cp2-group"],
)
def test_the_peers_of_a_data_parallel_rank_get_bit_identical_batches_in_every_epoch_and_after_a_resume(case):
    results = run_group(_peers_job, 4, *case)
    records = [(s, r) for s, length in enumerate(Records.LENGTHS) for r in range(length)]
    for kind, expected in (("map", list(range(30))), ("stream", records)):
        assert {result[kind][:2] for result in results} == {(0, 2), (1, 2)}
        by_rank = replicas(results, kind)
        for dp_rank, (one, other) in by_rank.items():  # the same indices, seeds, draws and records, batch by batch
            assert one == other, f"{kind}: the peers of data-parallel rank {dp_rank} got different batches"
            assert len(one) > 4
        assert_each_once_per_epoch([ones[0] for ones in by_rank.values()], expected, epochs=2)


# -- resuming at another mesh shape ---------------------------------------------------------------------------------

N, MICRO, GLOBAL, EPOCHS, STOP = 100, 2, 24, 2, 3  # the global batch stays 24: grad_accum follows the dp size


def reshape_loader(dp_world: int, **where) -> ResumableDataLoader:
    return ResumableDataLoader(
        IndexDataset(N), batch_size=MICRO, shuffle=True, seed=11, grad_accum=GLOBAL // (MICRO * dp_world), **where
    )


def updates_of(batches: list) -> list:
    """(epoch, micro-batches) per optimizer update, from (epoch, indices, update_complete) per micro-batch."""
    updates, current = [], []
    for epoch, ids, complete in batches:
        current.append(ids)
        if complete:
            updates.append((epoch, current))
            current = []
    return updates


def _reshape_job(rank, world_size, shape, names, dp_dims, progress):
    _, dp = data_mesh(shape, names, dp_dims)
    dl = reshape_loader(dp.size(), dp_mesh=dp)
    if progress is not None:
        dl.load_state_dict(progress)
    batches, saved = [], None
    for epoch in range(dl.epoch, EPOCHS):
        dl.set_epoch(epoch)
        it = iter(dl)
        for batch in it:
            batches.append((epoch, batch.tolist(), dl.update_complete))
            if progress is None and len(updates_of(batches)) == STOP:  # the first launch saves, then dies
                saved = global_progress(dl)
                next(it)  # a micro-batch of the next update, never committed: the resumed launch serves it again
                return dl.rank, batches, saved
    return dl.rank, batches, saved


def run_at(shape, names, dp_dims, progress=None) -> tuple[list, dict | None]:
    """Per data-parallel rank its batches (the same on every peer), and the saved progress."""
    results = run_group(_reshape_job, math.prod(shape), shape, names, dp_dims, progress)
    by_rank: dict[int, list] = {}
    for dp_rank, batches, _ in results:
        assert by_rank.setdefault(dp_rank, batches) == batches, f"the peers of data-parallel rank {dp_rank} differ"
    saved = [s for *_, s in results]
    assert all(s == saved[0] for s in saved)
    return [by_rank[r] for r in sorted(by_rank)], saved[0]


def global_updates(per_rank: list) -> list:
    """Per optimizer update: its epoch and the samples of every data-parallel rank."""
    ranks = [updates_of(batches) for batches in per_rank]
    assert len({len(r) for r in ranks}) == 1  # every rank takes part in every update
    return [(u[0][0], sorted(i for _, micro in u for ids in micro for i in ids)) for u in zip(*ranks)]


@pytest.mark.parametrize(
    "before, after",
    [
        (((2, 2), ("dp", "tp"), "dp"), ((1, 2), ("dp", "tp"), "dp")),
        (((2, 2), ("dp", "tp"), "dp"), ((3, 1), ("dp", "tp"), "dp")),
        (
            ((2, 2), ("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard")),
            ((1, 3), ("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard")),
        ),
    ],
    ids=["dp2xtp2-to-dp1xtp2", "dp2xtp2-to-dp3xtp1", "hsdp2x2-to-hsdp1x3"],
)
def test_a_resume_at_another_mesh_shape_trains_every_sample_once_in_the_same_global_batches(before, after):
    first, saved = run_at(*before)
    second, _ = run_at(*after, progress=saved)
    resumed = global_updates(first)[:STOP] + global_updates(second)
    dp_world = len(first)
    reference = [reshape_loader(dp_world, rank=r, world_size=dp_world) for r in range(dp_world)]
    uninterrupted = [[(e, b.tolist(), dl.update_complete) for e in range(EPOCHS) for b in dl] for dl in reference]
    assert resumed == global_updates(uninterrupted)  # each update holds the samples it held without the restart
    for epoch in range(EPOCHS):
        counts = Counter(i for e, ids in resumed if e == epoch for i in ids)
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}


# -- the save checks the peers ---------------------------------------------------------------------------------------


def _diverging_job(rank, world_size, tmp, names, dp_dims, odd_one_out, extra):
    mesh, dp = data_mesh((2, 2), names, dp_dims)
    dl = ResumableDataLoader(IndexDataset(40), batch_size=2, shuffle=True, seed=3, dp_mesh=dp)
    batches = 0 if rank in odd_one_out and extra is None else 2 + (extra if rank in odd_one_out else 0)
    it = iter(dl)
    for _ in range(batches):
        next(it)
    model = torch.nn.Linear(2, 1)
    try:
        save_checkpoint(tmp, 1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=dl)
    except StateError as err:
        return str(err)
    return "saved"


@pytest.mark.parametrize(
    "names, dp_dims, odd_one_out, extra, named",
    [
        (
            ("dp", "tp"),
            "dp",
            {3},
            1,
            "global rank 2 and global rank 3 hold the progress of the same data-parallel "
            "rank 1, but it differs (completed 2 vs 3)",
        ),
        # a pipeline stage that needs no input and skipped the loader: stage 1 (global ranks 2, 3) never iterated
        (
            ("pp", "dp"),
            "dp",
            {2, 3},
            None,
            "global rank 0 and global rank 2 hold the progress of the same "
            "data-parallel rank 0, but it differs (completed 2 vs 0)",
        ),
    ],
    ids=["tp-peer-one-batch-ahead", "pipeline-stage-that-skipped-the-loader"],
)
def test_a_peer_whose_progress_differs_from_its_replica_is_refused_at_save_naming_both(
    tmp_path, names, dp_dims, odd_one_out, extra, named
):
    errors = run_group(_diverging_job, 4, tmp_path, names, dp_dims, odd_one_out, extra)
    assert all(named in e for e in errors), errors[0]
    assert not list(tmp_path.iterdir())  # nothing published


def test_merge_states_keeps_one_state_per_data_rank_and_refuses_replicas_that_differ():
    def state_after(rank, batches):
        dl = ResumableDataLoader(IndexDataset(40), batch_size=2, shuffle=True, seed=3, rank=rank, world_size=2)
        it = iter(dl)
        for _ in range(batches):
            next(it)
        return dl.state_dict()

    ones = [state_after(0, 2), state_after(1, 2)]
    gathered = [ones[0], ones[1], state_after(0, 2), state_after(1, 2)]  # dp 2 x tp 2, in global rank order
    assert merge_states(gathered) == merge_states(ones)
    gathered[2] = {**gathered[2], "lockstep": {"rank": 1, "updates": 4, "own_updates": 2}}  # a peer saw rank 1 then
    assert merge_states(gathered) == merge_states(ones)  # what a state saw of the others is not its progress
    gathered[3] = state_after(1, 3)
    with pytest.raises(
        StateError,
        match=r"states\[1\] and states\[3\] hold the progress of the same data-parallel "
        r"rank 1, but it differs \(completed 2 vs 3\)",
    ):
        merge_states(gathered)


# -- the lockstep watch compares data-parallel ranks ----------------------------------------------------------------


def _lockstep_job(rank, world_size):
    mesh, dp = data_mesh((2, 2), ("dp", "tp"), "dp")
    dl = ResumableDataLoader(IndexDataset(80), batch_size=2, shuffle=True, seed=3, dp_mesh=dp)
    it = iter(dl)
    caught = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            next(it)
        dist.barrier()
        dl.state_dict()  # every peer in step: nothing to say
        caught.append([str(w.message) for w in seen if issubclass(w.category, LockstepWarning)])
        dist.barrier()
        if dl.rank == 1:  # both peers of data-parallel rank 1 run two updates ahead
            next(it), next(it)
        dist.barrier()
        if dl.rank == 0:
            dl.state_dict()
        caught.append([str(w.message) for w in seen if issubclass(w.category, LockstepWarning)][len(caught[0]) :])
        dist.barrier()
    return dl.rank, caught


def test_the_lockstep_check_compares_data_parallel_ranks_whose_peers_publish_alike():
    results = run_group(_lockstep_job, 4)
    assert all(caught[0] == [] for _, caught in results)  # replicas sharing a key raise no false alarm
    for dp_rank, caught in results:
        if dp_rank == 0:
            assert len(caught[1]) == 1 and "after rank 1 had completed 5 optimizer updates" in caught[1][0]
        else:
            assert caught[1] == []


# -- the spelling ---------------------------------------------------------------------------------------------------


def _spelling_job(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    hsdp = mesh["dp_replicate", "dp_shard"]
    flattened = hsdp._flatten("dp")  # torchtitan's dp mesh
    # global ranks laid out out of order: the mesh's order is not the order of the global ranks in its groups
    shuffled = DeviceMesh("cpu", torch.tensor([[3, 1], [2, 0]]), mesh_dim_names=("dp", "tp"))

    def of(**where):
        dl = ResumableDataLoader(IndexDataset(8), **where)
        return dl.rank, dl.world_size

    errors = []
    for where in (
        {"dp_mesh": hsdp, "rank": 0},
        {"dp_mesh": hsdp, "dp_group": flattened.get_group()},
        {"dp_mesh": flattened.get_group()},
    ):
        try:
            ResumableDataLoader(IndexDataset(8), **where)
        except (ValueError, TypeError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    return (
        {
            "hsdp": of(dp_mesh=hsdp),
            "flattened": of(dp_mesh=flattened),
            "group": of(dp_group=flattened.get_group()),
            "torchtitan": (flattened.get_local_rank(), 4),
        },
        of(dp_mesh=mesh["dp_shard"]),
        of(dp_mesh=shuffled["dp"]),
        errors,
    )


def test_a_multi_dimensional_dp_mesh_is_flattened_in_the_mesh_order_as_torchtitan_flattens_it():
    results = run_group(_spelling_job, 4)
    shuffled = {3: (0, 0), 1: (0, 1), 2: (1, 0), 0: (1, 1)}  # global rank -> (dp, tp) coordinate
    for rank, (spellings, shard, by_coordinate, errors) in enumerate(results):
        assert set(spellings.values()) == {(flat_rank(divmod(rank, 2), (2, 2)), 4)}, spellings
        assert shard == (rank % 2, 2)
        assert by_coordinate == (shuffled[rank][0], 2)  # the peers of a dp coordinate agree whatever the layout
        assert errors[0].startswith(
            "ValueError: rank and dp_mesh were given: name the data-parallel coordinates one way"
        )
        assert errors[1].startswith("ValueError: dp_mesh and dp_group were given")
        assert errors[2].startswith("TypeError: dp_mesh must be a torch.distributed DeviceMesh")


def test_a_data_parallel_group_needs_torch_distributed():
    with pytest.raises(ValueError, match="dp_group= needs torch.distributed initialised"):
        ResumableDataLoader(IndexDataset(8), dp_group=object())
