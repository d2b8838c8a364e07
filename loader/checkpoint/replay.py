"""The restart budget: what a failure costs, and how often to checkpoint to keep that cost low.

Why: every failure throws away the steps since the last checkpoint and adds a relaunch and a checkpoint load. Saving
more often shrinks the lost work but costs time on every save; :func:`optimal_checkpoint_interval` balances the two,
and :func:`replay_plan` says what one particular restart costs.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RestartCost:
    """Seconds one restart costs, by cause."""

    replay_s: float  # recomputing the steps done after the checkpoint
    launch_s: float  # bringing the job back up
    load_s: float  # reading the checkpoint

    @property
    def total_s(self) -> float:
        return self.replay_s + self.launch_s + self.load_s


def restart_cost(s_done: int, s_ckpt: int, t_step: float, t_launch: float, t_load: float) -> RestartCost:
    """The cost of resuming from the checkpoint of step ``s_ckpt`` after a failure once ``s_done`` steps were done.

    The ``s_done - s_ckpt`` steps since the checkpoint are replayed at ``t_step`` seconds each, after ``t_launch``
    seconds to relaunch and ``t_load`` seconds to load the checkpoint."""
    for name, value in (("s_done", s_done), ("s_ckpt", s_ckpt)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer step count, got {value!r}")
    if s_ckpt > s_done:
        raise ValueError(
            f"s_ckpt={s_ckpt} is after s_done={s_done}: a checkpoint cannot be newer than the progress it saved; "
            f"pass the step the failed run had reached as s_done"
        )
    for name, seconds in (("t_step", t_step), ("t_launch", t_launch), ("t_load", t_load)):
        _check_seconds(name, seconds, allow_zero=True)
    return RestartCost(replay_s=float((s_done - s_ckpt) * t_step), launch_s=float(t_launch), load_s=float(t_load))


def replay_plan(s_done: int, s_ckpt: int, t_step: float, t_launch: float, t_load: float) -> float:
    """Total seconds of :func:`restart_cost`: (s_done - s_ckpt) · t_step + t_launch + t_load."""
    return restart_cost(s_done, s_ckpt, t_step, t_launch, t_load).total_s


def optimal_checkpoint_interval(
    checkpoint_cost_s: float, mtbf_s: float, *, method: Literal["daly", "young"] = "daly"
) -> float:
    """Seconds of work between checkpoints that minimise the expected total run time.

    ``method="young"``: Young (1974), τ = sqrt(2 C M), first order in C / M.
    ``method="daly"`` (default): Daly (2006), τ = sqrt(2 C M) · [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] − C for
    C < 2M, else τ = M. It stays close to the true optimum of Daly's model when C is not small against M, where
    Young's checkpoints too rarely; for C ≪ M both agree. Daly's piecewise formula jumps from 8M/9 to M at C = 2M.

    Assumptions: failures are a Poisson process (exponential inter-failure times with mean ``mtbf_s`` = M for the job
    as a whole, i.e. node MTBF / number of nodes); a checkpoint costs ``checkpoint_cost_s`` = C of stalled training
    each time; τ counts training time only (the wall-clock period is τ + C). The restart cost R (relaunch + load) does
    not appear: in Daly's model it scales the expected run time by the constant factor e^(R/M), so it leaves the
    optimum where it is. Convert τ into steps with ``max(1, round(τ / t_step))``.
    """
    _check_seconds("checkpoint_cost_s", checkpoint_cost_s, allow_zero=False)
    _check_seconds("mtbf_s", mtbf_s, allow_zero=False)
    if method not in ("daly", "young"):
        raise ValueError(f"method must be 'daly' or 'young', got {method!r}")
    c, m = float(checkpoint_cost_s), float(mtbf_s)
    young = math.sqrt(2 * c * m)
    if method == "young":
        return young
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return young * (1 + math.sqrt(x) / 3 + x / 9) - c


def _check_seconds(name: str, value: object, *, allow_zero: bool) -> None:
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be a {bound} finite number of seconds, got {value!r}")
