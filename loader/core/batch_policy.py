"""Keeping the objective the same when the world size changes.

Why: the optimisation trajectory, and the learning-rate schedule tuned for it, depend on the global batch
B_global = W · K · B_micro (W data-parallel ranks, K gradient-accumulation steps, B_micro items per rank and step),
not on how it is split. After an elastic restart at another W, :class:`BatchPolicy` keeps B_global by changing K, and
refuses a W that cannot serve it exactly unless the caller opts in to a changed global batch. Within a batch,
:func:`global_mean_loss` divides by the valid count of all ranks, so uneven padding or masking across ranks does not
reweight items either.

A batch-size ramp (GPT-3 and OLMo grow the global batch during warm-up) is a schedule by optimizer step:
``BatchPolicy(global_batch=[(0, 256), (2000, 512)], micro_batch=8)``. K then follows both W and the step; a world
size must serve every global batch of the schedule exactly, which is checked for all of them up front (a refusal at
step 2000, hours into a job, would cost the run). Changing the schedule of a running job is explicit: ``amends=`` the
schedule it trained with, ``change_at=`` the first step that follows the new one.
"""

from __future__ import annotations

import bisect
import math
import warnings
from dataclasses import dataclass
from functools import reduce

import torch
import torch.distributed as dist

from loader.core.checks import check_positive_int, is_int
from loader.core.state import schedule_from


class GlobalBatchChangeWarning(UserWarning):
    """The world size forced a different global batch (only with ``allow_global_batch_change=True``)."""


@dataclass(frozen=True)
class BatchPolicy:
    """B_global = W · K · B_micro with ``global_batch`` = B_global and ``micro_batch`` = B_micro fixed; K follows W.

    ``global_batch`` is an int, or a schedule by optimizer step: (first step, global batch) pairs from step 0, e.g.
    ``[(0, 256), (2000, 512)]``. ``amends`` (the schedule a running job trained with) and ``change_at`` (a step) change
    it explicitly: the old schedule before ``change_at``, ``global_batch`` from it on (see ``schedule``)."""

    global_batch: int | tuple[tuple[int, int], ...]
    micro_batch: int
    allow_global_batch_change: bool = False
    amends: tuple[tuple[int, int], ...] | None = None
    change_at: int | None = None

    def __post_init__(self) -> None:
        check_positive_int("BatchPolicy.micro_batch", self.micro_batch)
        if isinstance(self.global_batch, (list, tuple)):
            object.__setattr__(self, "global_batch", schedule_from(self.global_batch, "BatchPolicy.global_batch"))
        else:
            check_positive_int("BatchPolicy.global_batch", self.global_batch)
        if not isinstance(self.allow_global_batch_change, bool):
            raise ValueError(
                f"BatchPolicy.allow_global_batch_change must be a bool, got {self.allow_global_batch_change!r}"
            )
        if (self.amends is None) != (self.change_at is None):
            raise ValueError(
                "BatchPolicy: amends= (the schedule the run trained with) and change_at= (the first step "
                "of the new one) go together"
            )
        if self.amends is not None:
            object.__setattr__(self, "amends", schedule_from(self.amends, "BatchPolicy.amends"))
            if not is_int(self.change_at) or self.change_at < 0:
                raise ValueError(f"BatchPolicy.change_at must be a step (an int >= 0), got {self.change_at!r}")
        for _, global_batch in self.schedule:
            if global_batch % self.micro_batch:
                below = global_batch // self.micro_batch * self.micro_batch
                nearest = sorted({max(below, self.micro_batch), below + self.micro_batch})
                raise ValueError(
                    f"BatchPolicy.global_batch={global_batch} must be a multiple of micro_batch={self.micro_batch} "
                    f"(every micro-step on every rank is a full micro batch); use e.g. "
                    f"global_batch={' or '.join(map(str, nearest))}, or another micro_batch"
                )

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """The global batch by step, as (first step, global batch) pairs; with ``amends``, the amended schedule's
        pairs before ``change_at``, then the new one's from there."""
        new = ((0, self.global_batch),) if is_int(self.global_batch) else self.global_batch
        change_at = self.change_at  # set with amends or not at all (__post_init__)
        if self.amends is None or change_at is None:
            return new
        at = _at(new, change_at)
        return (*(p for p in self.amends if p[0] < change_at), (change_at, at), *(p for p in new if p[0] > change_at))

    def at(self, step: int) -> int:
        """The global batch of optimizer step `step` (counted from 0)."""
        return _at(self.schedule, step)

    def world_sizes(self) -> list[int]:
        """The world sizes that serve every global batch of the schedule exactly: the divisors of the greatest common
        divisor of global_batch / micro_batch."""
        n = reduce(math.gcd, (g // self.micro_batch for _, g in self.schedule))
        small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
        return sorted(set(small + [n // d for d in small]))

    def grad_accum(self, world_size: int, step: int = 0) -> int:
        """K for this world size (at optimizer step `step`). Raises ValueError when W · K · micro_batch cannot equal
        the global batch, unless the policy allows a changed global batch: then K = max(1, G / (W · B) rounded half
        up), with a :class:`GlobalBatchChangeWarning` naming the old and new global batch."""
        k = self._resolve(world_size, step)
        changed, wanted = world_size * k * self.micro_batch, self.at(step)
        if changed != wanted:
            warnings.warn(
                f"global batch changes from {wanted} to {changed} at world_size={world_size} "
                f"(grad_accum={k}, micro_batch={self.micro_batch}); the learning rate may need rescaling, e.g. by "
                f"{changed}/{wanted} = {changed / wanted:.4g} under the linear scaling rule",
                GlobalBatchChangeWarning,
                stacklevel=2,
            )
        return k

    def global_batch_at(self, world_size: int, step: int = 0) -> int:
        """The global batch actually served at this world size and step (the schedule's unless a change was
        allowed)."""
        return world_size * self._resolve(world_size, step) * self.micro_batch

    def check_world_size(self, world_size: int) -> None:
        """Refuse (ValueError) a world size that cannot serve every global batch of the schedule exactly, whatever
        `allow_global_batch_change` says: a loader deals each step's samples by the schedule's global batch."""
        for first, global_batch in self.schedule:
            if global_batch % (world_size * self.micro_batch):
                raise ValueError(self._unservable(global_batch, world_size, f" (from step {first})", ""))

    def _resolve(self, world_size: int, step: int) -> int:
        check_positive_int("world_size", world_size)
        per_step, global_batch = world_size * self.micro_batch, self.at(step)
        if global_batch % per_step == 0:
            return global_batch // per_step
        if self.allow_global_batch_change:
            return max(1, (2 * global_batch + per_step) // (2 * per_step))
        at_step = "" if len(self.schedule) == 1 else f" (at step {step})"
        allow = (
            f" To run at world_size={world_size} anyway, construct the policy with allow_global_batch_change=True"
            f" (the global batch becomes {world_size} * K * {self.micro_batch}; rescale the learning rate)"
        )
        raise ValueError(self._unservable(global_batch, world_size, at_step, allow))

    def _unservable(self, global_batch: int, world_size: int, at_step: str, allow: str) -> str:
        per_step = world_size * self.micro_batch
        return (
            f"global_batch={global_batch}{at_step} cannot be served at world_size={world_size} with "
            f"micro_batch={self.micro_batch}: it is not a multiple of world_size * micro_batch = {per_step}. "
            f"World sizes that keep {'it' if len(self.schedule) == 1 else 'every global batch'} exactly: "
            f"{', '.join(map(str, self.world_sizes()))}.{allow}"
        )


def _at(schedule: tuple[tuple[int, int], ...], step: int) -> int:
    """The global batch of `step` under a schedule of (first step, global batch) pairs."""
    if not is_int(step) or step < 0:
        raise ValueError(f"step must be an int >= 0 (an optimizer step), got {step!r}")
    return schedule[bisect.bisect_right([first for first, _ in schedule], step) - 1][1]


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
