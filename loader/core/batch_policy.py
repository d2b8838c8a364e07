"""Keeping the objective the same when the world size changes.

Why: the optimisation trajectory, and the learning-rate schedule tuned for it, depend on the global batch
B_global = W · K · B_micro (W data-parallel ranks, K gradient-accumulation steps, B_micro items per rank and step),
not on how it is split. After an elastic restart at another W, :class:`BatchPolicy` keeps B_global by changing K, and
refuses a W that cannot serve it exactly unless the caller opts in to a changed global batch. Within a batch,
:func:`global_mean_loss` divides by the valid count of all ranks, so uneven padding or masking across ranks does not
reweight items either.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loader.core.checks import check_positive_int


class GlobalBatchChangeWarning(UserWarning):
    """The world size forced a different global batch (only with ``allow_global_batch_change=True``)."""


@dataclass(frozen=True)
class BatchPolicy:
    """B_global = W · K · B_micro with ``global_batch`` = B_global and ``micro_batch`` = B_micro fixed; K follows W."""

    global_batch: int
    micro_batch: int
    allow_global_batch_change: bool = False

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch"):
            check_positive_int(f"BatchPolicy.{name}", getattr(self, name))
        if not isinstance(self.allow_global_batch_change, bool):
            raise ValueError(
                f"BatchPolicy.allow_global_batch_change must be a bool, got {self.allow_global_batch_change!r}"
            )
        if self.global_batch % self.micro_batch:
            below = self.global_batch // self.micro_batch * self.micro_batch
            nearest = sorted({max(below, self.micro_batch), below + self.micro_batch})
            raise ValueError(
                f"BatchPolicy.global_batch={self.global_batch} must be a multiple of micro_batch={self.micro_batch} "
                f"(every micro-step on every rank is a full micro batch); use e.g. "
                f"global_batch={' or '.join(map(str, nearest))}, or another micro_batch"
            )

    def world_sizes(self) -> list[int]:
        """The world sizes that serve ``global_batch`` exactly: the divisors of global_batch / micro_batch."""
        n = self.global_batch // self.micro_batch
        small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
        return sorted(set(small + [n // d for d in small]))

    def grad_accum(self, world_size: int) -> int:
        """K for this world size. Raises ValueError when W · K · micro_batch cannot equal global_batch, unless the
        policy allows a changed global batch: then K = max(1, G / (W · B) rounded half up), with a
        :class:`GlobalBatchChangeWarning` naming the old and new global batch."""
        k = self._resolve(world_size)
        changed = world_size * k * self.micro_batch
        if changed != self.global_batch:
            warnings.warn(
                f"global batch changes from {self.global_batch} to {changed} at world_size={world_size} "
                f"(grad_accum={k}, micro_batch={self.micro_batch}); the learning rate may need rescaling, e.g. by "
                f"{changed}/{self.global_batch} = {changed / self.global_batch:.4g} under the linear scaling rule",
                GlobalBatchChangeWarning,
                stacklevel=2,
            )
        return k

    def global_batch_at(self, world_size: int) -> int:
        """The global batch actually served at this world size (== global_batch unless a change was allowed)."""
        return world_size * self._resolve(world_size) * self.micro_batch

    def _resolve(self, world_size: int) -> int:
        check_positive_int("world_size", world_size)
        per_step = world_size * self.micro_batch
        if self.global_batch % per_step == 0:
            return self.global_batch // per_step
        if self.allow_global_batch_change:
            return max(1, (2 * self.global_batch + per_step) // (2 * per_step))
        raise ValueError(
            f"global_batch={self.global_batch} cannot be served at world_size={world_size} with "
            f"micro_batch={self.micro_batch}: it is not a multiple of world_size * micro_batch = {per_step}. "
            f"World sizes that keep it exactly: {', '.join(map(str, self.world_sizes()))}. To run at "
            f"world_size={world_size} anyway, construct the policy with allow_global_batch_change=True "
            f"(the global batch becomes {world_size} * K * {self.micro_batch}; rescale the learning rate)"
        )


def global_mean_loss(
    loss_sum: torch.Tensor, local_count: int | torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``loss_sum`` divided by the number of valid items (or tokens) summed over all ranks of ``group``.

    Why: dividing by the *local* count weights an item by 1/n_r, so ranks with fewer valid items count more and the
    objective changes with W and with padding. Dividing by the global count N = Σ_r n_r (an all-reduce SUM when
    torch.distributed is initialised, else the local count) makes every item weigh 1/N.

    With DDP, which *averages* gradients over the W ranks, backpropagate ``global_mean_loss(s, n) * W``: rank r then
    contributes W · ∇s_r / N, and DDP's average (1/W) Σ_r W · ∇s_r / N = ∇(Σ_r s_r) / N is exactly the gradient of the
    global mean. With K accumulation micro-steps (``no_sync`` on all but the last), pass as ``local_count`` this rank's
    count over all K micro-batches of the optimiser step, so N is the step's global count and the K backward passes
    sum to the same gradient.

    The result is this rank's share: all-reduce (SUM) a detached copy to log the global mean. When no rank has a
    valid item, N is taken as 1, so the loss is 0 (not NaN) and the step changes nothing.
    """
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(f"loss_sum must be a torch.Tensor, got {type(loss_sum).__name__}")
    if isinstance(local_count, torch.Tensor):
        if local_count.numel() != 1 or local_count.is_floating_point() or local_count.is_complex():
            raise ValueError(
                f"local_count must be a one-element integer tensor (a count), got dtype={local_count.dtype} "
                f"shape={tuple(local_count.shape)}"
            )
        count = local_count.detach().reshape(()).to(device=loss_sum.device, dtype=torch.int64, copy=True)
    elif isinstance(local_count, int) and not isinstance(local_count, bool) and local_count >= 0:
        count = torch.tensor(local_count, dtype=torch.int64, device=loss_sum.device)
    else:
        raise ValueError(f"local_count must be a non-negative int or an integer tensor, got {local_count!r}")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return loss_sum / count.clamp_min(1).to(loss_sum.dtype)
