"""A minimal elastic agent for tests: runs an example (examples/train_elastic.py unless told) in forked ranks, like
torchrun's agent.

Forked processes (torch already imported) make a generation cost about a second instead of torchrun's ~10 s. As
torchrun does, the first rank that fails ends the whole generation: the others are killed by pid. Each generation
gets its own free port; every wait is bounded.
"""

import contextlib
import gc
import importlib.util
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch.multiprocessing as mp

from tests.distributed import free_port

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_elastic.py"


def load_example(path: Path = EXAMPLE):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def held_at_teardown() -> str:
    """What this process still holds that the process group's end would leave to the interpreter's exit: DDP
    models (their reducers hold the group; gloo's teardown at exit can hang, pytorch#56297), ledger files, worker
    processes."""
    import multiprocessing

    from torch.nn.parallel import DistributedDataParallel

    models = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    ledgers = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            ledgers += "/ledger/gen-" in os.readlink(f"/proc/self/fd/{fd}")
    return f"held at teardown: {models} DDP, {ledgers} ledger files, {len(multiprocessing.active_children())} workers"


def _reporting_teardown(destroy):
    def destroy_process_group(*args, **kwargs):
        print(held_at_teardown(), flush=True)
        return destroy(*args, **kwargs)

    return destroy_process_group


def _rank_main(rank, world_size, port, argv, log_dir, example, collector=True):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.destroy_process_group = _reporting_teardown(dist.destroy_process_group)
    if not collector:
        gc.disable()  # what the job leaves to the collector is still there at its teardown, whenever it would run
    warnings.resetwarnings()  # the job's warnings as a job has them, not the suite's errors its fork inherited
    with open(Path(log_dir) / f"rank-{rank}.log", "a", buffering=1) as out:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = load_example(example).main(argv)
            except BaseException:
                traceback.print_exc()
                code = 1
    os._exit(code)


def run_generation(
    world_size: int,
    argv: list[str],
    log_dir: Path,
    timeout: float = 120.0,
    example: Path = EXAMPLE,
    collector: bool = True,
) -> list[int | None]:
    """Run one launch of the job; returns each rank's exit code (negative: killed by that signal). `collector`:
    False runs the ranks without the automatic garbage collector."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, argv, str(log_dir), example, collector))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation of {world_size} ranks still running after {timeout} s")
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank failed: the agent stops the others, as torchrun does
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)
    return [p.exitcode for p in procs]


def logs(log_dir: Path) -> dict[int, str]:
    return {int(p.stem[5:]): p.read_text() for p in sorted(log_dir.glob("rank-*.log"))}
