"""9. Restart budget: `loader.checkpoint.replay.replay_plan` fed with what this run measured, and a real elastic
restart.

The plan: t_step is our step time from benchmark 2; t_load is our resume (load_state_dict -> first batch) at the
largest position of benchmark 4, the loader's share of loading a checkpoint (the model's share is not in it);
t_launch is a parameter (`--t-launch`, default 10 s: torchrun with 2-4 gloo processes took 7-11 s on this kind
of machine, per shared/ANCHORS.md). A failure half-way between checkpoints taken every `checkpoint_interval`
steps replays half an interval. StatefulDataLoader's plan uses the linear extrapolation of its resume.

The measured restart (not in --smoke): the elastic job of `python -m loader demo` (two torchrun agents, 4
workers, a node lost mid-step, back with 3), its launch, load and replay seconds next to the plan made from what
was known before the failure (step time, first launch, last checkpoint save).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.config import Config
from benchmarks.loaders import OURS_CHECKPOINTING
from benchmarks.progress import say
from benchmarks.rows import row, single
from loader.checkpoint.replay import replay_plan
from loader.cli.demo import run_elastic_restart


def _plan(cfg: Config, training: dict, resume: dict) -> dict:
    s_ckpt = 10 * cfg.checkpoint_interval
    s_done = s_ckpt + cfg.checkpoint_interval // 2
    t_step = training["values"][OURS_CHECKPOINTING.name]["median"]
    loads = {"ResumableDataLoader": resume["ours"][-1]["seconds"]["median"]}
    if "stateful_extrapolated_s" in resume:
        loads["StatefulDataLoader (t_load extrapolated)"] = resume["stateful_extrapolated_s"]["seconds"]
    plans = {name: replay_plan(s_done, s_ckpt, t_step, cfg.t_launch_s, t_load) for name, t_load in loads.items()}
    inputs = {
        "s_done": s_done,
        "s_ckpt": s_ckpt,
        "t_step_s": t_step,
        "t_launch_s": cfg.t_launch_s,
        "t_load_s": loads,
        "position": resume["ours"][-1]["position"],
    }
    rows = [row(f"planned restart with {name}", single(seconds), "s") for name, seconds in plans.items()]
    return {"inputs": inputs, "plans_s": plans, "rows": rows}


def _measured(cfg: Config) -> dict:
    say("restart", "elastic job: 4 torchrun workers, a node lost mid-step, back with 3 ...")
    with tempfile.TemporaryDirectory(prefix="loader-bench-restart-") as directory:
        measured = run_elastic_restart(Path(directory) / "run")
    rows = [
        row("elastic restart (torchrun 4 -> 3 workers): measured", single(measured["measured_s"]), "s"),
        row("elastic restart: its replay plan, made before the failure", single(measured["plan_s"]), "s"),
    ]
    return {"measured_restart": measured, "rows": rows}


def run(cfg: Config, training: dict, resume: dict) -> dict:
    plan = _plan(cfg, training, resume)
    if not cfg.measure_restart:
        return {"kind": "plan from measured inputs, not a measured restart", **plan}
    measured = _measured(cfg)
    return {
        "kind": "plan from measured inputs, and a measured elastic restart",
        **plan,
        **measured,
        "rows": plan["rows"] + measured["rows"],
    }
