"""The metrics as TensorBoard and Prometheus see them, across a real restart: a launch SIGKILLed after it wrote steps
that the next launch replays from its checkpoint. Each step keeps the last launch's values, and nothing is summed
twice. Skipped (with the reason) without the extras."""

import contextlib
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from loader import ResumableDataLoader
from loader.checkpoint import Ledger, resume, save_checkpoint
from loader.checkpoint.audit import audit
from tests.conftest import IndexDataset

N, BATCH, EVERY = 40, 4, 3  # 10 steps an epoch, a checkpoint every 3


def launch(run_dir: Path, log_dir: Path, die_after: int | None = None) -> None:
    """One launch of a training job, as a user writes it: resume, attach the ledger, write every step's loader
    metrics to TensorBoard, checkpoint every EVERY steps; SIGKILLed (by itself) right after step `die_after`."""
    from torch.utils.tensorboard import SummaryWriter

    from loader.integrations.tensorboard import TensorBoardMetrics

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dl = ResumableDataLoader(IndexDataset(N), batch_size=BATCH, shuffle=True, seed=5)
    step = resume(run_dir, model=model, optimizer=optimizer, loader=dl)
    dl.ledger = Ledger.open(run_dir, step, N)
    writer = SummaryWriter(str(log_dir), purge_step=step + 1)
    board = TensorBoardMetrics(writer)
    for batch in dl:
        model(batch.float()[:, None]).sum().backward()
        if dl.update_complete:
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            board.write(dl.metrics())  # the step: the ledger's
            writer.flush()  # on disk at once: the steps this launch dies after are in the log
            if step % EVERY == 0:
                save_checkpoint(run_dir, step, model=model, optimizer=optimizer, loader=dl, ledger=dl.ledger)
            if step == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
    save_checkpoint(run_dir, step, model=model, optimizer=optimizer, loader=dl, ledger=dl.ledger)
    writer.close()


def test_tensorboard_keeps_the_last_launch_of_each_replayed_step(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install 'loader[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    run_dir, log_dir = tmp_path / "run", tmp_path / "tb"
    first = multiprocessing.get_context("fork").Process(target=launch, args=(run_dir, log_dir, 7))
    first.start()
    first.join(timeout=120)
    if first.exitcode is None:
        first.kill()
        first.join()
    assert first.exitcode == -signal.SIGKILL  # it died after step 7; its checkpoint is step 6's
    # TensorBoard reads a directory's event files in name order, which starts with the second each was made: a
    # relaunch comes seconds later (torchrun's takes several), so this one too, or it would be read first
    (made,) = {int(path.name.split(".")[3]) for path in log_dir.glob("events.out.tfevents.*")}
    deadline = time.monotonic() + 5
    while int(time.time()) <= made and time.monotonic() < deadline:
        time.sleep(0.05)
    launch(run_dir, log_dir)  # resumes from step 6 and replays step 7

    written = [
        (event.step, value.tag)
        for path in sorted(log_dir.glob("events.out.tfevents.*"))
        for event in EventFileLoader(str(path)).Load()
        for value in event.summary.value
    ]
    assert written.count((7, "loader/samples")) == 2  # both launches wrote step 7...
    board = EventAccumulator(str(log_dir))
    board.Reload()
    samples, launches = board.Scalars("loader/samples"), board.Scalars("loader/launch")
    assert [e.step for e in samples] == list(range(1, 11))  # ...and a reader keeps one per step
    assert [e.value for e in launches] == [1] * 6 + [2] * 4  # the last launch's, from step 7 on
    assert sum(e.value for e in samples) == N  # every sample once, summed over the steps
    assert {e.value for e in board.Scalars("loader/batches")} == {1.0}
    (epoch,) = audit(run_dir)
    assert epoch.finished and epoch.clean and epoch.seen_once == N


def test_tensorboard_needs_a_step():
    from loader.integrations.tensorboard import TensorBoardMetrics

    class Writer:
        def add_scalar(self, tag, value, global_step):
            raise AssertionError("nothing is written without a step")

    with pytest.raises(ValueError, match="needs the optimizer step"):
        TensorBoardMetrics(Writer()).write(ResumableDataLoader(IndexDataset(4)).metrics())
    with pytest.raises(TypeError, match="needs a SummaryWriter"):
        TensorBoardMetrics(object())


def test_prometheus_gauges_hold_the_last_step_and_counters_count_each_launch_once():
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason="needs the prometheus extra: pip install 'loader[prometheus]'"
    )
    from loader.integrations.prometheus import PrometheusMetrics

    def run(registry, launch, state=None, steps=None):
        dl = ResumableDataLoader(IndexDataset(N), batch_size=BATCH, shuffle=True, seed=5)
        if state is not None:
            dl.load_state_dict(state)
        board, step, it = PrometheusMetrics(rank=0, launch=launch, registry=registry), 0, iter(dl)
        for _ in range(steps or dl.batches_left):
            next(it)
            step += 1
            board.write(dl.metrics(), step)
        return dl

    first = prometheus_client.CollectorRegistry()
    dl = run(first, launch=1, steps=7)
    labels = {"rank": "0", "launch": "1"}
    assert first.get_sample_value("loader_samples_total", labels) == 7 * BATCH
    assert first.get_sample_value("loader_batches_total", labels) == 7
    assert first.get_sample_value("loader_last_step", labels) == 7
    assert first.get_sample_value("loader_last_step_samples", labels) == BATCH
    second = prometheus_client.CollectorRegistry()  # a new launch is a new process, with a registry of its own
    state = dl.state_dict()
    run(second, launch=2, state=state)
    assert second.get_sample_value("loader_samples_total", {"rank": "0", "launch": "2"}) == N - 7 * BATCH
    assert second.get_sample_value("loader_samples_total", labels) is None  # launch 1's counts stay launch 1's
    assert second.get_sample_value("loader_last_step", {"rank": "0", "launch": "2"}) == 3
    assert second.get_sample_value("loader_resume_seconds", {"rank": "0", "launch": "2"}) > 0
    assert b"loader_last_step_wait_seconds" in prometheus_client.generate_latest(second)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the writer's own thread dies
def test_a_log_folder_removed_mid_run_warns_once_and_the_loop_gets_every_batch_and_logs_again(tmp_path):
    """The log folder disappears after step 3: the write that meets the dead event file warns (once, naming the
    step) instead of raising into the loop, every batch of the epoch is delivered once, and the steps after it are
    written to a new event file, in the folder made again."""
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install 'loader[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from loader.integrations.tensorboard import TensorBoardMetrics
    from loader.metrics import MetricsWarning

    log_dir = tmp_path / "tb"
    writer = SummaryWriter(str(log_dir))
    board, delivered = TensorBoardMetrics(writer), []
    dl = ResumableDataLoader(IndexDataset(N), batch_size=BATCH, shuffle=True, seed=5)
    for step, batch in enumerate(dl, start=1):  # one batch an update
        delivered += batch.tolist()
        if step == 4:
            writer.flush()  # steps 1 to 3 on disk, then gone
            shutil.rmtree(log_dir)
            writer.add_scalar("probe", 0, step)  # the writer's thread meets the missing file...
            with pytest.raises(OSError):
                writer.flush()  # ...for sure before the next write: torch raises it at every call from now on
            with pytest.warns(
                MetricsWarning,
                match=r"TensorBoardMetrics.write at step 4 raised \w*Error: .* Training "
                r"goes on and the loader keeps counting, but the scalars of",
            ):
                board.write(dl.metrics(), step)
        else:
            board.write(dl.metrics(), step)  # no warning: the project's warnings are errors here
    writer.close()
    assert sorted(delivered) == list(range(N))
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert [event.step for event in events.Scalars("loader/samples")] == list(range(5, N // BATCH + 1))


def test_a_failed_prometheus_write_warns_once_and_the_next_counts_all_the_work_since():
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason="needs the prometheus extra: pip install 'loader[prometheus]'"
    )
    from loader.integrations.prometheus import PrometheusMetrics
    from loader.metrics import MetricsWarning

    registry = prometheus_client.CollectorRegistry()
    board, labels = PrometheusMetrics(rank=0, launch=1, registry=registry), {"rank": "0", "launch": "1"}
    dl = ResumableDataLoader(IndexDataset(N), batch_size=BATCH, shuffle=False)
    for step, _ in enumerate(dl, start=1):
        metrics = dl.metrics()
        if step in (2, 3):  # a value its gauge refuses: set() raises inside prometheus_client
            warned = pytest.warns(MetricsWarning, match=r"PrometheusMetrics.write at step 2 raised ValueError")
            with warned if step == 2 else contextlib.nullcontext():
                board.write({**metrics, "samples": "four"}, step)
            assert registry.get_sample_value("loader_samples_total", labels) == BATCH  # step 1's
        else:
            board.write(metrics, step)
    assert registry.get_sample_value("loader_samples_total", labels) == N
    assert registry.get_sample_value("loader_last_step", labels) == N // BATCH
