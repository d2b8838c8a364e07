"""BatchPolicy arithmetic, and global_mean_loss in real gloo process groups (torch.distributed is never mocked)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel

from loader.core.batch_policy import BatchPolicy, GlobalBatchChangeWarning, global_mean_loss
from tests.distributed import run_group

# --- BatchPolicy -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, k", [(1, 24), (2, 12), (3, 8), (4, 6), (6, 4), (8, 3), (12, 2), (24, 1)])
def test_grad_accum_keeps_the_global_batch(world_size, k):
    policy = BatchPolicy(global_batch=96, micro_batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.grad_accum(world_size) == k
        assert policy.global_batch_at(world_size) == 96


def test_world_sizes_are_the_divisors():
    assert BatchPolicy(96, 4).world_sizes() == [1, 2, 3, 4, 6, 8, 12, 24]
    assert BatchPolicy(7, 7).world_sizes() == [1]
    assert BatchPolicy(2**20, 1).world_sizes() == [2**i for i in range(21)]


@pytest.mark.parametrize("world_size", [5, 7, 16, 48])
def test_unservable_world_size_lists_the_working_ones(world_size):
    policy = BatchPolicy(96, 4)
    message = (
        f"global_batch=96 cannot be served at world_size={world_size} with micro_batch=4: it is not a multiple of "
        f"world_size * micro_batch = {world_size * 4}. World sizes that keep it exactly: 1, 2, 3, 4, 6, 8, 12, 24. "
        f"To run at world_size={world_size} anyway, construct the policy with allow_global_batch_change=True"
    )
    for ask in (policy.grad_accum, policy.global_batch_at):
        with pytest.raises(ValueError) as info:
            ask(world_size)
        assert str(info.value).startswith(message)


@pytest.mark.parametrize("world_size, k, served", [(5, 5, 100), (7, 3, 84), (16, 2, 128), (48, 1, 192), (64, 1, 256)])
def test_opt_in_changes_the_global_batch_and_warns(world_size, k, served):
    policy = BatchPolicy(96, 4, allow_global_batch_change=True)
    assert policy.global_batch_at(world_size) == served
    with pytest.warns(GlobalBatchChangeWarning) as caught:
        assert policy.grad_accum(world_size) == k
    (warning,) = caught
    assert str(warning.message) == (
        f"global batch changes from 96 to {served} at world_size={world_size} (grad_accum={k}, micro_batch=4); "
        f"the learning rate may need rescaling, e.g. by {served}/96 = {served / 96:.4g} under the linear scaling rule"
    )


def test_opt_in_does_not_warn_when_exact():
    policy = BatchPolicy(96, 4, allow_global_batch_change=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.grad_accum(8) == 3


def test_opt_in_rounds_ties_up():
    assert BatchPolicy(20, 1, allow_global_batch_change=True).global_batch_at(8) == 24  # 20 / 8 = 2.5 -> K = 3


@settings(max_examples=300, deadline=None, derandomize=True)
@given(n=st.integers(1, 500), micro_batch=st.integers(1, 16), world_size=st.integers(1, 600))
def test_opt_in_picks_the_nearest_global_batch(n, micro_batch, world_size):
    policy = BatchPolicy(n * micro_batch, micro_batch, allow_global_batch_change=True)
    served = policy.global_batch_at(world_size)
    candidates = [world_size * k * micro_batch for k in range(1, n + 2)]
    assert served in candidates
    assert abs(served - policy.global_batch) == min(abs(c - policy.global_batch) for c in candidates)
    assert (served == policy.global_batch) == (world_size in policy.world_sizes())


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1), r"BatchPolicy.global_batch must be a positive int, got 0"),
        ((-8, 1), r"BatchPolicy.global_batch must be a positive int, got -8"),
        ((True, 1), r"BatchPolicy.global_batch must be a positive int, got True"),
        ((8.0, 1), r"BatchPolicy.global_batch must be a positive int, got 8.0"),
        (("8", 1), r"BatchPolicy.global_batch must be a positive int, got '8'"),
        ((8, 0), r"BatchPolicy.micro_batch must be a positive int, got 0"),
        ((8, None), r"BatchPolicy.micro_batch must be a positive int, got None"),
        ((8, 1, 1), r"BatchPolicy.allow_global_batch_change must be a bool, got 1"),
        ((10, 4), r"BatchPolicy.global_batch=10 must be a multiple of micro_batch=4 .* global_batch=8 or 12"),
        ((3, 4), r"BatchPolicy.global_batch=3 must be a multiple of micro_batch=4 .* global_batch=4, or another"),
    ],
)
def test_policy_validation(args, match):
    with pytest.raises(ValueError, match=match):
        BatchPolicy(*args)


@pytest.mark.parametrize("world_size", [0, -2, True, 2.0, None])
def test_world_size_validation(world_size):
    with pytest.raises(ValueError, match=f"world_size must be a positive int, got {world_size!r}"):
        BatchPolicy(8, 1).grad_accum(world_size)


def test_policy_is_frozen():
    with pytest.raises(AttributeError):
        BatchPolicy(8, 1).global_batch = 16


# --- global_mean_loss without a process group ----------------------------------------------------------------------


def test_local_mean_when_not_distributed():
    assert not dist.is_initialized()
    assert global_mean_loss(torch.tensor(6.0), 3).item() == 2.0
    count = torch.tensor([4])
    assert global_mean_loss(torch.tensor(6.0, dtype=torch.float64), count).item() == 1.5
    assert count.tolist() == [4]


def test_zero_count_gives_zero_not_nan():
    loss = global_mean_loss(torch.tensor(0.0, requires_grad=True), 0)
    assert loss.item() == 0.0


@pytest.mark.parametrize(
    "count, error, match",
    [
        (-1, ValueError, "local_count must be a non-negative int or an integer tensor, got -1"),
        (True, ValueError, "got True"),
        (2.5, ValueError, "got 2.5"),
        (torch.tensor(2.0), ValueError, "one-element integer tensor .* dtype=torch.float32"),
        (torch.tensor([1, 2]), ValueError, r"one-element integer tensor .* shape=\(2,\)"),
    ],
)
def test_count_validation(count, error, match):
    with pytest.raises(error, match=match):
        global_mean_loss(torch.tensor(1.0), count)


def test_loss_sum_must_be_a_tensor():
    with pytest.raises(TypeError, match="loss_sum must be a torch.Tensor, got float"):
        global_mean_loss(1.0, 1)


# --- real gloo groups ---------------------------------------------------------------------------------------------


def _global_count_body(rank: int, world_size: int) -> None:
    local_counts = [5, 0, 2]  # uneven, one rank without any valid item
    count = local_counts[rank] if rank < 2 else torch.tensor(local_counts[rank])  # int and tensor counts
    loss_sum = torch.tensor(10.0 * (rank + 1), dtype=torch.float64)

    share = global_mean_loss(loss_sum, count)

    torch.testing.assert_close(share, loss_sum / 7, rtol=0, atol=0)
    if isinstance(count, torch.Tensor):
        assert count.item() == 2, "the caller's count tensor must not be reduced in place"
    total = share.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, torch.tensor(60.0 / 7, dtype=torch.float64))


@pytest.mark.slow
def test_global_mean_loss_divides_by_the_global_count():
    run_group(_global_count_body, 3)


ITEMS = 8
COUNTS = [8, 3, 5]  # valid items per rank


def _data(world_size: int):
    """The same data on every rank, generated from a fixed seed: inputs, targets and validity masks per rank."""
    generator = torch.Generator().manual_seed(1234)
    xs = [torch.randn(ITEMS, 4, generator=generator, dtype=torch.float64) for _ in range(world_size)]
    ys = [torch.randn(ITEMS, generator=generator, dtype=torch.float64) for _ in range(world_size)]
    masks = [torch.arange(ITEMS) < c for c in COUNTS[:world_size]]
    return xs, ys, masks


def _ddp_gradient_body(rank: int, world_size: int) -> None:
    xs, ys, masks = _data(world_size)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, dtype=torch.float64)
    reference = copy.deepcopy(model)
    mask_all = torch.cat(masks)
    prediction = reference(torch.cat(xs)[mask_all]).squeeze(1)
    expected = torch.autograd.grad(((prediction - torch.cat(ys)[mask_all]) ** 2).mean(), reference.parameters())

    ddp = DistributedDataParallel(model)
    x, y, mask = xs[rank], ys[rank], masks[rank]

    def loss_sum(rows: slice) -> torch.Tensor:
        return (((ddp(x[rows]).squeeze(1) - y[rows]) ** 2) * mask[rows]).sum()

    def gradients(*losses) -> list[torch.Tensor]:
        """Backward through DDP, one loss function per micro-step (no_sync on all but the last)."""
        ddp.zero_grad()
        for i, loss in enumerate(losses):
            if i < len(losses) - 1:
                with ddp.no_sync():
                    loss().backward()
            else:
                loss().backward()
        return [p.grad.clone() for p in ddp.parameters()]

    everything, first_half, second_half = slice(None), slice(0, ITEMS // 2), slice(ITEMS // 2, None)
    count = int(mask.sum())
    # The documented formula: times W, because DDP averages gradients over the ranks.
    got = gradients(lambda: global_mean_loss(loss_sum(everything), count) * world_size)
    torch.testing.assert_close(got, list(expected), rtol=1e-6, atol=0)
    # The same with two accumulation micro-steps, each normalised by the step's count.
    got = gradients(
        lambda: global_mean_loss(loss_sum(first_half), count) * world_size,
        lambda: global_mean_loss(loss_sum(second_half), count) * world_size,
    )
    torch.testing.assert_close(got, list(expected), rtol=1e-6, atol=0)
    # Without the factor W the gradient is W times too small ...
    got = gradients(lambda: global_mean_loss(loss_sum(everything), count))
    torch.testing.assert_close(got, [g / world_size for g in expected], rtol=1e-6, atol=0)
    # ... and the per-rank mean gives a different objective when counts are uneven.
    got = gradients(lambda: loss_sum(everything) / count)
    assert not all(torch.allclose(g, e, rtol=1e-3) for g, e in zip(got, expected))


@pytest.mark.slow
def test_ddp_gradient_equals_the_single_process_global_mean():
    run_group(_ddp_gradient_body, 3)
