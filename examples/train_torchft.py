"""Training that goes on while replica groups die and join: torchft, with the loader dealing each step's global
batch over the groups of that step's quorum. Start a lighthouse, then each replica group (here 2 processes each):

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 &
    for rank in 0 1; do RANK=$rank WORLD_SIZE=2 python examples/train_torchft.py --run-dir /tmp/run \
        --lighthouse http://localhost:29510 --group 0 --store-port 29600 --ledger & done
    # the same with --group 1 --store-port 29601, now or later; kill a group, start it again: it heals from a peer

Each step the loop calls `optimizer.zero_grad()` (which starts the step's quorum), then iterates the loader: this
rank's micro-batches of the step's block of the epoch, dealt over (participating groups) x (ranks per group). The
step counts only when `optimizer.step()` commits; a failed commit deals the same block to the next quorum. Inside a
group the ranks average their gradients over the group's own process group (FSDP would shard instead); across
groups the Manager averages them. `--ledger` records what each process trained for `python -m loader audit RUN_DIR`.
Rank 0 of each group prints its steps (the quorum, its samples and loss, whether the step committed); torchft's own
INFO lines (every quorum and commit) are left out unless RUST_LOG=info is set. Fault injection: `--fail-at-step S`
SIGKILLs this process in step S, after its backward, before the allreduce.
`--wait-before S:PATH` waits (bounded) before step S until PATH exists, e.g. until another group has started.
`--ramp 0:8,6:16` grows the global batch by Manager step (a batch-size ramp, as examples/train_elastic.py's).
`--mixture 1,1` trains a Mixture of two regression sources instead (a of N/2 samples, b of N/3, in windows of 8
positions) and `--change-mixture 4:1,3` is its controller: before Manager step 4 (printed as step 5) every rank
asks for weights 1/3 (`dl.change_mixture`; the step asked again after a failed commit keeps the recorded weights,
a healing group takes its peer's plan). Rank 0 of each group keeps the plan it trains under in
RUN_DIR/mixture-group<G>.json, for `python -m loader audit RUN_DIR --mixture RUN_DIR/mixture-group0.json` (a row
per source, and each change).
CPU and gloo here; the loader is the same on GPUs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum and commit at INFO: RUST_LOG=info shows them
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example, also when loaded by path
from train_elastic import FEATURES, Regression, ramp_schedule  # noqa: E402

from loader.checkpoint.ledger import Ledger  # noqa: E402
from loader.integrations.torchft import ManagedLoader  # noqa: E402
from loader.sources import Mixture  # noqa: E402

SOURCES, MIXTURE_WINDOW = ("a", "b"), 8  # --mixture: two sources, their weights in eighths of a window


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address (http://host:port)")
    p.add_argument("--group", type=int, required=True, help="this replica group's number")
    p.add_argument("--store-port", type=int, required=True, help="the group's TCPStore port (its rank 0 hosts it)")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument(
        "--ramp",
        type=ramp_schedule,
        help="a global batch schedule by Manager step, STEP:G,...: e.g. 0:8,6:16 (instead of --global-batch)",
    )
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ledger", action="store_true", help="record every trained sample index for the audit")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a collective may wait for a dead peer")
    p.add_argument("--fail-at-step", type=int, help="SIGKILL this process in this step, before its allreduce")
    p.add_argument(
        "--mixture", type=_weights, metavar="W1,W2", help="train a Mixture of two sources with these weights"
    )
    p.add_argument(
        "--change-mixture",
        type=_change,
        action="append",
        default=[],
        metavar="STEP:W1,W2",
        help="before Manager step STEP, change the Mixture's weights to these (every rank of every group alike)",
    )
    p.add_argument(
        "--wait-before",
        action="append",
        default=[],
        metavar="STEP:PATH",
        help="before step STEP, wait until PATH exists (at most a minute)",
    )
    args = p.parse_args(argv)
    if args.change_mixture and args.mixture is None:
        p.error("--change-mixture changes a Mixture's weights: give --mixture too")
    return args


def _weights(text: str) -> list[float]:
    """--mixture's weights, one per source, e.g. "1,3"."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) != len(SOURCES):
        raise argparse.ArgumentTypeError(f"give {len(SOURCES)} weights separated by a comma, e.g. 1,3; got {text!r}")
    return weights


def _change(text: str) -> tuple[int, list[float]]:
    """--change-mixture's STEP:W1,W2."""
    step, _, weights = text.partition(":")
    if not step.isdigit():
        raise argparse.ArgumentTypeError(f"give STEP:W1,W2, e.g. 4:1,3; got {text!r}")
    return int(step), _weights(weights)


def dataset_of(args: argparse.Namespace):
    """One regression dataset of --samples, or with --mixture two regression sources of other samples (a of N/2,
    b of N/3) mixed into N positions per epoch."""
    if args.mixture is None:
        return Regression(args.samples)
    sources = [Regression(args.samples // 2), Regression(args.samples // 3, offset=args.samples)]
    return Mixture(sources, args.mixture, args.samples, seed=args.seed, names=SOURCES, window=MIXTURE_WINDOW)


def change_mixture(dl: ManagedLoader, weights: list[float], group: int, rank: int) -> None:
    """The controller's request before this step's quorum (every rank of every group asks alike, so no collective
    is needed; one computed from losses would all-reduce them through the Manager first)."""
    change = dl.change_mixture(weights)
    if rank != 0:
        return
    if change is None:  # printed as the steps are: Manager step s is step s + 1
        log(group, f"mixture: step {dl.manager.current_step() + 1} again: the weights it recorded stand")
    else:
        at = "a later epoch" if change.step is None else f"step {change.step + 1}"
        log(group, f"mixture: weights {weights} from mixture position {change.position} ({at})")


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


def log(group: int, text: str) -> None:
    print(f"[group {group}] {text}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    # torchft warns on every quorum that it cannot reset NCCL's flight recorder: there is none on gloo
    logging.getLogger("torchft.manager").addFilter(lambda record: "NCCL flight recorder" not in record.getMessage())
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # the place in the replica group
    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=rank, world_size=size, timeout=timeout)
    torch.manual_seed(args.seed)  # every group starts from the same model: no step-0 sync (init_sync=False)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        init_sync=False,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"group{args.group}",
        store_addr="127.0.0.1",
        store_port=args.store_port,
        rank=rank,
        world_size=size,
        lighthouse_addr=args.lighthouse,
        timeout=timeout,
        quorum_timeout=3 * timeout,
        connect_timeout=timeout,
    )
    optimizer = OptimizerWrapper(manager, inner)
    dataset = dataset_of(args)
    dl = ManagedLoader(
        manager,
        dataset,
        global_batch=args.ramp or args.global_batch,
        batch_size=args.micro_batch,
        group_rank=rank,
        group_size=size,
        shuffle=True,
        seed=args.seed,
    )
    if args.ledger:
        dl.ledger = Ledger.open_attempts(args.run_dir, len(dataset), f"group{args.group}-rank{rank}")
    waits = {int(step): Path(path) for step, path in (w.split(":", 1) for w in args.wait_before)}
    changes, plan_file, saved = dict(args.change_mixture), args.run_dir / f"mixture-group{args.group}.json", None
    (args.run_dir / f"up-{args.group}-{rank}-{os.getpid()}").touch()  # for a launcher: this process is up
    try:
        while manager.current_step() < dl.deal.first_step(args.epochs):
            if manager.current_step() in waits:
                wait_for(waits.pop(manager.current_step()))
            step, trained, total = manager.current_step(), 0, 0.0
            if step in changes:
                change_mixture(dl, changes[step], args.group, rank)
            global_batch = dl.deal.block(step).global_batch
            optimizer.zero_grad()  # starts the step's quorum: the loader deals the step over it
            for x, y in dl:
                loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y, reduction="sum") / global_batch
                loss.backward()  # summed over the step's samples: every sample weighs alike, at any quorum
                trained, total = trained + len(y), total + loss.item()
            if manager.current_step() == args.fail_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            for p in model.parameters():  # the sum over the group's ranks, then the mean over the groups
                grad = torch.zeros_like(p) if p.grad is None else p.grad
                dist.all_reduce(grad)
                manager.allreduce(grad).wait()
                p.grad = grad * manager.num_participants()  # the Manager averages: the sum is the step's gradient
            optimizer.step()  # commits only if every group's step went through; else the step is dealt again
            if rank == 0:
                outcome = "committed" if manager.current_step() > step else "not committed: dealt again"
                log(
                    args.group,
                    f"step {step + 1}: {manager.num_participants()} group(s) in the quorum, {trained} "
                    f"samples on rank 0, its loss {total:.4f}, {outcome}",
                )
            if rank == 0:
                with open(args.run_dir / f"progress-{args.group}.txt", "a") as out:
                    out.write(f"{manager.current_step()}\n")
                if args.mixture is not None and dl.loader.dataset.plan.requests != saved:  # changed, or healed
                    dl.loader.dataset.plan.save(plan_file)
                    saved = dl.loader.dataset.plan.requests
        dl.close()
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
