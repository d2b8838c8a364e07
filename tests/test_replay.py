"""The restart budget: replay cost arithmetic and the optimal checkpoint interval."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.checkpoint.replay import RestartCost, optimal_checkpoint_interval, replay_plan, restart_cost


@pytest.mark.parametrize(
    "args, parts",
    [
        ((104, 100, 8, 20, 12), (32.0, 20.0, 12.0)),  # 4 steps · 8 s + 20 s + 12 s = 64 s
        ((203, 200, 5, 10, 5), (15.0, 10.0, 5.0)),  # 3 steps · 5 s + 10 s + 5 s = 30 s
        ((100, 100, 8, 20, 12), (0.0, 20.0, 12.0)),  # failed right after a checkpoint
        ((np.int64(7), 0, 0.5, 0, 0), (3.5, 0.0, 0.0)),
    ],
)
def test_restart_cost(args, parts):
    cost = restart_cost(*args)
    assert cost == RestartCost(*parts)
    assert replay_plan(*args) == cost.total_s == sum(parts)


def test_worked_examples():
    assert replay_plan(s_done=104, s_ckpt=100, t_step=8, t_launch=20, t_load=12) == 64.0
    assert replay_plan(s_done=203, s_ckpt=200, t_step=5, t_launch=10, t_load=5) == 30.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"s_done": 104.0}, "s_done must be a non-negative integer step count, got 104.0"),
        ({"s_done": True}, "s_done must be a non-negative integer step count, got True"),
        ({"s_ckpt": -1}, "s_ckpt must be a non-negative integer step count, got -1"),
        ({"s_ckpt": "100"}, "s_ckpt must be a non-negative integer step count, got '100'"),
        ({"s_ckpt": 105}, "s_ckpt=105 is after s_done=104"),
        ({"t_step": -8}, "t_step must be a non-negative finite number of seconds, got -8"),
        ({"t_launch": math.nan}, "t_launch must be a non-negative finite number of seconds, got nan"),
        ({"t_load": math.inf}, "t_load must be a non-negative finite number of seconds, got inf"),
        ({"t_load": False}, "t_load must be a non-negative finite number of seconds, got False"),
        ({"t_step": None}, "t_step must be a non-negative finite number of seconds, got None"),
    ],
)
def test_replay_validation(kwargs, match):
    args = {"s_done": 104, "s_ckpt": 100, "t_step": 8, "t_launch": 20, "t_load": 12, **kwargs}
    with pytest.raises(ValueError, match=match):
        replay_plan(**args)


@pytest.mark.parametrize(
    "c, m, method, expected",
    [
        (1, 2, "daly", 25 / 18),  # x = 1/4: 2 · (1 + 1/6 + 1/36) - 1
        (50, 100, "daly", 625 / 9),  # x = 1/4: 100 · 43/36 - 50
        (1, 2, "young", 2.0),
        (50, 100, "young", 100.0),
        (200, 100, "daly", 100.0),  # C = 2M: τ = M
        (500, 100, "daly", 100.0),
        (2 * 100 * (1 - 1e-12), 100, "daly", 800 / 9),  # just below C = 2M: 2M · (1 + 1/3 + 1/9) - 2M = 8M/9
    ],
)
def test_known_intervals(c, m, method, expected):
    assert optimal_checkpoint_interval(c, m, method=method) == pytest.approx(expected, rel=1e-9)


def test_daly_is_the_default():
    assert optimal_checkpoint_interval(1, 2) == optimal_checkpoint_interval(1, 2, method="daly")


def _expected_run_time_factor(tau: np.ndarray, c: float, m: float) -> np.ndarray:
    """Daly's (2006) exact model: expected wall time per unit of work, up to the constant factor M · e^(R/M)."""
    return np.expm1((tau + c) / m) / tau


@pytest.mark.parametrize("ratio", [1e-4, 1e-2, 0.1, 0.3, 0.9])
def test_daly_is_near_the_true_optimum_and_beats_young(ratio):
    m = 1000.0
    c = ratio * m
    grid = np.geomspace(1e-4 * m, 10 * m, 200_001)
    best = _expected_run_time_factor(grid, c, m).min()
    daly, young = (
        _expected_run_time_factor(np.array(optimal_checkpoint_interval(c, m, method=k)), c, m) / best - 1
        for k in ("daly", "young")
    )
    assert -1e-9 < daly < 1e-4
    assert young >= daly


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    c=st.floats(1e-3, 1e5),
    m=st.floats(1e-3, 1e7),
    grow=st.floats(1.001, 10),
)
def test_monotone(c, m, grow):
    for method in ("daly", "young"):
        interval = optimal_checkpoint_interval(c, m, method=method)
        assert interval <= optimal_checkpoint_interval(c * grow, m, method=method)
    assert optimal_checkpoint_interval(c, m, method="young") < optimal_checkpoint_interval(c, m * grow, method="young")
    if c < 2 * m:  # Daly's formula drops from M to 8M'/9 as M' crosses C/2, so it is monotone in M only below that
        assert optimal_checkpoint_interval(c, m) < optimal_checkpoint_interval(c, m * grow)
        assert optimal_checkpoint_interval(c, m) < optimal_checkpoint_interval(c, m, method="young")


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 100), {}, "checkpoint_cost_s must be a positive finite number of seconds, got 0"),
        ((-1, 100), {}, "checkpoint_cost_s must be a positive finite number of seconds, got -1"),
        ((10, 0.0), {}, "mtbf_s must be a positive finite number of seconds, got 0.0"),
        ((10, math.inf), {}, "mtbf_s must be a positive finite number of seconds, got inf"),
        ((math.nan, 10), {}, "checkpoint_cost_s must be a positive finite number of seconds, got nan"),
        ((True, 10), {}, "checkpoint_cost_s must be a positive finite number of seconds, got True"),
        ((10, 100), {"method": "Young"}, "method must be 'daly' or 'young', got 'Young'"),
    ],
)
def test_interval_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimal_checkpoint_interval(*args, **kwargs)
