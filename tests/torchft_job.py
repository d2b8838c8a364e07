"""One rank of a torchft replica group for tests/test_torchft.py: a tiny model trained on a ManagedLoader, its
gradients averaged across the quorum by the Manager (gloo), the identity ledger attached. Rank 0 of the group hosts
the group's store. Each committed step is written to RUN_DIR/progress-<group>.txt, for the test to time its kills."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from loader.checkpoint.ledger import Ledger
from tests.conftest import IndexDataset

SAMPLES, GLOBAL_BATCH, MICRO_BATCH, SEED = 96, 8, 2, 11


def main(group: int, group_rank: int, group_size: int, store_port: int, lighthouse: str, run_dir: str,
         steps: int, hold: dict[int, str], die_at: int | None = None) -> None:
    """`hold`: before step s, wait (bounded) until RUN_DIR/hold[s] exists, which a starting group writes once its
    Manager is up: so that the group still trains when the other joins. `die_at`: SIGKILL this process in that
    step, after its backward and before the gradients' allreduce, so that the other groups' step fails its commit."""
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from loader.integrations.torchft import ManagedLoader

    torch.set_num_threads(1)
    store = None
    if group_rank == 0:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"group{group}", store_addr="127.0.0.1", store_port=store_port, rank=group_rank,
        world_size=group_size, lighthouse_addr=lighthouse, timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10),
        init_sync=False,  # the model is seeded alike: step 0 heals no rank (see ManagedLoader)
    )
    optimizer = OptimizerWrapper(manager, inner)
    dl = ManagedLoader(manager, IndexDataset(SAMPLES), global_batch=GLOBAL_BATCH, batch_size=MICRO_BATCH,
                       group_rank=group_rank, group_size=group_size, shuffle=True, seed=SEED)
    dl.ledger = Ledger.open_attempts(run_dir, SAMPLES, f"group{group}-rank{group_rank}")
    progress = Path(run_dir) / f"progress-{group}.txt"
    (Path(run_dir) / f"up-{group}-{group_rank}-{os.getpid()}").touch()
    try:
        refused(dl)  # before the first quorum
        while manager.current_step() < steps:
            if manager.current_step() in hold:
                wait_for(Path(run_dir) / hold.pop(manager.current_step()))
            optimizer.zero_grad()  # starts the step's quorum
            for x in dl:  # this rank's micro-batches of the step, dealt over that quorum
                (model(x.float().unsqueeze(1)) ** 2).mean().backward()
            refused(dl)  # a second fetch in one step
            if manager.current_step() == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            for p in model.parameters():
                manager.allreduce(p.grad if p.grad is not None else torch.zeros_like(p)).wait()
            optimizer.step()  # should_commit: the step counts only if it commits
            if group_rank == 0:
                with open(progress, "a") as out:
                    out.write(f"{manager.current_step()}\n")
        dl.close()
    finally:
        manager.shutdown(wait=False)
        del store
    os._exit(0)


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


def refused(dl) -> None:
    """A fetch without a new quorum is refused, saying what to call."""
    try:
        iter(dl)
    except RuntimeError as err:
        if "call optimizer.zero_grad()" in str(err):
            return
        raise
    raise AssertionError("a ManagedLoader dealt a step without its quorum")
