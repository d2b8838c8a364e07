"""A store host that stops answering (SIGSTOP) never holds a rank in the loader.

The lockstep check (`loader.checkpoint.lockstep`) makes a store round trip on every optimizer update, and torch's store
client never returns from a server that stopped answering, whatever its timeout. The loader must add no wait the
job did not have: it gives up on the store well inside the process group's timeout, with a LockstepWarning, and
the job goes on as plain torch would (to the end of its loop, or to its collective's own timeout).
"""

from __future__ import annotations

import os
import queue
import signal
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loader import ResumableDataLoader
from loader.checkpoint.lockstep import LockstepWarning
from tests.conftest import IndexDataset
from tests.distributed import free_port

pytestmark = pytest.mark.slow

# seconds: the process group's timeout, so where plain torch would fail on the stopped host. The loader gives a store
# round trip a quarter of it (lockstep.round_trip_bound), which each test waits out once or twice.
GROUP_TIMEOUT = 12
N, KW = 60, dict(batch_size=2, shuffle=True, seed=5)  # 2 ranks: 15 updates an epoch
CONTEXT = mp.get_context("fork")


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc), as SIGSTOP leaves it."""
    return open(f"/proc/{pid}/stat").read().split(") ")[-1].startswith("T")


def _wait(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _lockstep_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, LockstepWarning)]


def _end(processes) -> None:
    """SIGCONT, then SIGKILL, every process by pid; reap them all."""
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass
    for process in processes:
        process.join(timeout=10)
    assert all(not process.is_alive() for process in processes), [p.pid for p in processes if p.is_alive()]


def _next_marker(markers, deadline: float, who: str):
    try:
        return markers.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise AssertionError(
            f"{who} did not get past the loader within {GROUP_TIMEOUT} s of the store host "
            f"stopping, the process group's timeout: the loader waits on the stopped store"
        ) from None


# -- rank 0 hosts the store (as torchrun's multi-agent jobs run), and stops ------------------------------------------


def _rank_on_a_host_that_stops(rank: int, port: int, go, markers) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=GROUP_TIMEOUT),
        )
        dl = ResumableDataLoader(IndexDataset(N), **KW)
        it = iter(dl)
        next(it)
        dist.all_reduce(torch.zeros(1))  # the update's gradient all-reduce: both ranks published once
        if rank == 0:
            os.kill(os.getpid(), signal.SIGSTOP)  # the store's host hangs
            return
        if not go.wait(30):
            raise AssertionError("the test never saw rank 0 stop")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            next(it)  # an update completed: the round trip to the stopped store
            markers.put(("next", None))
            fresh = ResumableDataLoader(IndexDataset(N), **KW)  # a loader of its own, whose first round trip is
            fresh.state_dict()  # in state_dict()
            markers.put(("state_dict", _lockstep_warnings(caught)))
        dist.all_reduce(torch.zeros(1))  # where plain torch waits, up to the group's timeout (the test ends it first)
    except BaseException as error:
        markers.put(("error", repr(error)))


def test_a_rank_gets_past_the_loader_when_the_rank_hosting_the_store_stops():
    port, go, markers = free_port(), CONTEXT.Event(), CONTEXT.Queue()
    ranks = [CONTEXT.Process(target=_rank_on_a_host_that_stops, args=(r, port, go, markers)) for r in range(2)]
    try:
        for process in ranks:
            process.start()
        _wait(lambda: _stopped(ranks[0].pid), "rank 0 to stop itself", timeout=60)
        go.set()
        deadline = time.monotonic() + GROUP_TIMEOUT
        assert _next_marker(markers, deadline, "rank 1's next()") == ("next", None)
        what, warned = _next_marker(markers, deadline, "rank 1's state_dict()")
        assert what == "state_dict", warned
        assert len(warned) == 2 and all("did not answer" in message for message in warned), warned
    finally:
        _end(ranks)


# -- a standalone store host stops; both ranks train on ---------------------------------------------------------------


def _store_host(ports) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ports.put(store.port)
    while True:
        time.sleep(1)


def _rank_with_a_store_that_stops(rank: int, port: int, go, markers) -> None:
    try:
        timeout = timedelta(seconds=GROUP_TIMEOUT)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        dl = ResumableDataLoader(IndexDataset(N), **KW)
        it = iter(dl)
        before = [next(it).tolist()]
        dist.all_reduce(torch.zeros(1))  # both ranks published once
        markers.put(("ready", rank))
        if not go.wait(30):
            raise AssertionError("the test never saw the store host stop")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):  # lockstep updates while the store's host is stopped
                before.append(next(it).tolist())
                dist.all_reduce(torch.zeros(1))
            state = dl.state_dict()
            after = []
            for batch in it:  # and on to the end of the epoch
                after.append(batch.tolist())
                dist.all_reduce(torch.zeros(1))
        markers.put(("done", (rank, before, state, after, _lockstep_warnings(caught))))
    except BaseException as error:
        markers.put(("error", repr(error)))


def test_ranks_train_on_exactly_once_when_a_standalone_store_host_stops():
    ports, go, markers = CONTEXT.Queue(), CONTEXT.Event(), CONTEXT.Queue()
    host = CONTEXT.Process(target=_store_host, args=(ports,))
    processes = [host]
    try:
        host.start()
        port = ports.get(timeout=30)
        processes += [
            CONTEXT.Process(target=_rank_with_a_store_that_stops, args=(r, port, go, markers)) for r in range(2)
        ]
        for process in processes[1:]:
            process.start()
        assert sorted(markers.get(timeout=60) for _ in range(2)) == [("ready", 0), ("ready", 1)]
        os.kill(host.pid, signal.SIGSTOP)
        _wait(lambda: _stopped(host.pid), "the store host to stop")
        go.set()
        deadline = time.monotonic() + GROUP_TIMEOUT
        results = {}
        for _ in range(2):
            what, value = _next_marker(markers, deadline, "a rank's loop")
            assert what == "done", value
            results[value[0]] = value[1:]
    finally:
        _end(processes)
    trained = []
    for _rank, (before, state, after, warned) in sorted(results.items()):
        assert len(warned) == 1 and "did not answer" in warned[0], warned  # once: the check is off after it
        assert "lockstep" not in state and len(before) == 5 and len(after) == 10
        trained += before
    resumed = ResumableDataLoader(IndexDataset(N), **KW)  # the ranks' states, taken with the store stopped
    resumed.load_state_dict([results[r][1] for r in range(2)])
    trained += [batch.tolist() for batch in resumed]
    assert sorted(i for batch in trained for i in batch) == list(range(N))  # every index once
    every = [i for _, (before, _, after, _) in sorted(results.items()) for i in sum(before + after, [])]
    assert sorted(every) == list(range(N))  # and the ranks' own epoch, once
