"""TensorBoard: a ResumableDataLoader's per-step metrics as scalars, right across restarts (`pip install
loader[tensorboard]`).

    step = resume(run_dir, model=..., optimizer=..., loader=dl)        # 0 on a fresh run
    writer = SummaryWriter(log_dir, purge_step=step + 1)               # purge_step: see below
    board = TensorBoardMetrics(writer)
    for batch in dl:
        ...
        if dl.update_complete:
            opt.step(); step += 1
            board.write(dl.metrics(), step)

Why `purge_step`: a relaunched job resumes from its checkpoint's step S and trains the steps after it again, so
their scalars are written twice (the earlier launch wrote them up to where it died). A writer made with
`purge_step=S + 1` opens its event file with a SessionLog.START at S + 1, and TensorBoard's readers then discard
every earlier event at step S + 1 or later: each step shows the values of the last launch that trained it, and a
sum over steps counts each one once. `loader/launch` tells which launch that was (with a ledger attached). The
launch's own totals (`total/...`) are not written: they count work, replays included, and belong to counters
(`loader.integrations.prometheus`), not to a per-step series.

A write that fails (the log folder removed, a full disk) never stops training: a MetricsWarning says so once, that
step's scalars are lost, and the next write opens a new event file (torch's SummaryWriter makes the folder again).
"""

from __future__ import annotations

import contextlib
from typing import Any

from loader.metrics import STEP_KEYS, Retrying

WRITTEN = ("launch", *STEP_KEYS, "resume_seconds")  # and every source/... counter


class TensorBoardMetrics:
    """Writes `dl.metrics()` through a `SummaryWriter` (torch.utils.tensorboard's, or tensorboardX's): one scalar per
    value, `prefix` + its key, at the step it belongs to. Values that are None (nothing measured yet, bytes not
    counted) are left out."""

    def __init__(self, writer: Any, prefix: str = "loader/") -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(
                f"TensorBoardMetrics needs a SummaryWriter (with add_scalar), got {type(writer).__name__}: "
                f"torch.utils.tensorboard.SummaryWriter(log_dir, purge_step=resumed_step + 1), which "
                f"needs pip install 'loader[tensorboard]'"
            )
        self.writer, self.prefix = writer, prefix
        self._retrying = Retrying()

    def write(self, metrics: dict, step: int | None = None) -> None:
        """The per-step values of `metrics` (`dl.metrics()`) at `step`, the optimizer step they belong to (default:
        the ledger's, `metrics["step"]`)."""
        step = metrics.get("step") if step is None else step
        if step is None:
            raise ValueError(
                "TensorBoardMetrics.write needs the optimizer step these metrics belong to: pass step=, "
                "or attach a Ledger to the loader (its step is then in dl.metrics()['step'])"
            )
        written = self._retrying.call(
            f"TensorBoardMetrics.write at step {step}",
            lambda: self._write(metrics, step),
            False,
            "the scalars of the steps that fail are lost",
        )
        if not written:
            self._reopen()

    def _write(self, metrics: dict, step: int) -> bool:
        for key, value in metrics.items():
            if value is not None and (key in WRITTEN or key.startswith("source/")):
                self.writer.add_scalar(self.prefix + key, value, global_step=step)
        return True

    def _reopen(self) -> None:
        """After a failed write, the writer's event file is forgotten, so that its next add_scalar opens a new one:
        a SummaryWriter (torch's, tensorboardX's) does so once closed, but its close() raises when the file is gone
        before it forgets the file."""
        with contextlib.suppress(Exception):
            self.writer.close()
        if hasattr(self.writer, "all_writers"):
            self.writer.file_writer = self.writer.all_writers = None
