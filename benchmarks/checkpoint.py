"""3. Checkpoint costs: state_dict() latency and size, and merge_states latency, against N, position and drift.

Lockstep ranks commit one interval, so a state should not grow with N or the position. Two simulated ranks, rank 0
ahead of rank 1 by k micro-batches, leave k holes: the merged state grows with k only, and after a resume from it
every state_dict() carries it as its base, so that is the state_dict() measured. StatefulDataLoader's state is
measured side by side at sizes where it can start (it builds randperm(N) first).
"""

from __future__ import annotations

import io
import json
from functools import partial

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from benchmarks.config import Config
from benchmarks.datasets import IndexDataset
from benchmarks.loaders import ours
from benchmarks.rows import count, row, single
from benchmarks.states import global_state_at
from benchmarks.timing import compare, measure, per_call
from loader import merge_states

BATCH = 8  # small micro-batches: k of them cost little to iterate, and each leaves its own hole
LOCKSTEP_BYTES_TARGET = "<= 1024"  # a lockstep state stays a few hundred bytes at any N


def serialized_bytes(state: dict) -> dict:
    """Bytes of the state as JSON (None when it is not JSON-able, e.g. holds tensors) and as torch.save writes it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        as_json = len(json.dumps(state).encode())
    except TypeError:
        as_json = None
    return {"json": as_json, "torch.save": buffer.getbuffer().nbytes}


def advance(loader, batches: int):
    """Deliver `batches` micro-batches (range first: zip then takes no batch beyond them) and return the loader."""
    for _ in zip(range(batches), loader):
        pass
    return loader


def _rank_states(dataset, position: int, ahead: int) -> list[dict]:
    """States of two ranks resumed at `position`: rank 1 delivered one micro-batch, rank 0 `ahead` more."""
    base = global_state_at(dataset, BATCH, position)
    states = []
    for rank, batches in ((0, 1 + ahead), (1, 1)):
        loader = ours(dataset, batch_size=BATCH, shuffle=True, rank=rank, world_size=2)
        loader.load_state_dict(base)
        states.append(advance(loader, batches).state_dict())
    return states


def _case(cfg: Config, n: int, position: int, ahead: int) -> dict:
    dataset = IndexDataset(n)
    states = _rank_states(dataset, position, ahead)
    merge = partial(merge_states, states, uneven=True)  # rank 0 ran ahead on purpose
    merged = merge()
    resumed = ours(dataset, batch_size=BATCH, shuffle=True)
    resumed.load_state_dict(merged)
    advance(resumed, 1)
    section = f"checkpoint N={count(n)} position={count(position)} ahead={ahead}"
    timed = partial(measure, reps=cfg.reps, warmup=cfg.warmup, section=section, unit="s/call")
    return {
        "n": n,
        "position": position,
        "ahead": ahead,
        "intervals": sum(len(spans) // 2 for _, spans in merged["committed"]),
        "state_dict_s": timed("state_dict", partial(per_call, resumed.state_dict, cfg.min_call_s)),
        "merge_states_s": timed("merge_states", partial(per_call, merge, cfg.min_call_s)),
        "state_bytes": serialized_bytes(resumed.state_dict()),
        "merged_bytes": serialized_bytes(merged),
    }


def _side_by_side(cfg: Config, n: int) -> dict:
    """state_dict() latency of ours and StatefulDataLoader's after two batches of one N, interleaved."""
    dataset = IndexDataset(n)
    loaders = {
        "ResumableDataLoader": advance(ours(dataset, batch_size=BATCH, shuffle=True), 2),
        "StatefulDataLoader": advance(StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True), 2),
    }
    candidates = {name: partial(per_call, loader.state_dict, cfg.min_call_s) for name, loader in loaders.items()}
    section = f"checkpoint side by side N={count(n)}"
    result = compare(candidates, "ResumableDataLoader", cfg.reps, cfg.warmup, section, "s")
    bytes_ = {name: serialized_bytes(loader.state_dict()) for name, loader in loaders.items()}
    return {"n": n, **result, "bytes": bytes_}


def _rows(lockstep: list[dict], uneven: list[dict], side: list[dict]) -> list[dict]:
    small, large = lockstep[0], lockstep[-1]
    flat = single(large["state_dict_s"]["median"] / small["state_dict_s"]["median"])
    rows = [
        row(f"state_dict() N={count(large['n'])} lockstep", large["state_dict_s"], "us", scale=1e6),
        row(f"state_dict() N={count(large['n'])} / N={count(small['n'])}", flat, "ratio", "<= 1.5"),
        row(
            f"state bytes (json) N={count(large['n'])} lockstep",
            single(large["state_bytes"]["json"]),
            "B",
            LOCKSTEP_BYTES_TARGET,
        ),
        row(f"merge_states() 2 ranks N={count(large['n'])} lockstep", large["merge_states_s"], "us", scale=1e6),
    ]
    for case in uneven[-1:]:
        rows += [
            row(
                f"state_dict() ahead={case['ahead']} ({case['intervals']} intervals)",
                case["state_dict_s"],
                "us",
                scale=1e6,
            ),
            row(f"state bytes (json) ahead={case['ahead']}", single(case["state_bytes"]["json"]), "B"),
            row(f"merge_states() ahead={case['ahead']}", case["merge_states_s"], "us", scale=1e6),
        ]
    for case in side:
        rows.append(
            row(
                f"StatefulDataLoader / ours state_dict() N={count(case['n'])}",
                case["ratios"]["StatefulDataLoader"],
                "ratio",
            )
        )
        rows.append(
            row(
                f"StatefulDataLoader state bytes (torch.save) N={count(case['n'])}",
                single(case["bytes"]["StatefulDataLoader"]["torch.save"]),
                "B",
            )
        )
    return rows


def run(cfg: Config) -> dict:
    lockstep = [_case(cfg, n, int(n * f), 0) for n in cfg.state_sizes for f in cfg.state_fractions]
    largest = max(cfg.state_sizes)
    uneven = [_case(cfg, largest, largest // 2, k) for k in cfg.ahead]
    side = [_side_by_side(cfg, n) for n in cfg.stateful_state_sizes]
    return {
        "batch_size": BATCH,
        "lockstep": lockstep,
        "uneven": uneven,
        "stateful": side,
        "rows": _rows(lockstep, uneven, side),
    }
