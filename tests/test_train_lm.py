"""examples/train_lm.py: a tiny transformer on a 70/30 mixture of token files survives a SIGKILLed rank and a
resize, with the final model of the uninterrupted run and a clean audit for each source.

Ranks are forked processes in a real gloo group, the kill is a real SIGKILL (tests/elastic.py). The same job under
two torchrun agents, one of them killed, is `python -m loader demo --lm` (slower: it is not run here).
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from loader.checkpoint.audit import Grouping, audit
from loader.cli.main import main as cli
from loader.sources import MixturePlan
from tests.elastic import logs, run_generation

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"


def job(run_dir, data_dir, *extra):
    return ["--run-dir", str(run_dir), "--data-dir", str(data_dir), "--samples", "240", "--global-batch", "24",
            "--micro-batch", "2", "--checkpoint-every", "3", "--ledger", *extra]


def test_a_killed_rank_and_a_resize_keep_the_model_and_every_source_exactly_once(tmp_path, capsys):
    data = tmp_path / "data"
    assert run_generation(2, job(tmp_path / "reference", data), tmp_path / "logs0", example=EXAMPLE) == [0, 0]
    run = tmp_path / "run"
    first = run_generation(4, job(run, data, "--fail-at-step", "4", "--fail-rank", "3"), tmp_path / "logs1",
                           example=EXAMPLE)
    assert first[3] == -9, logs(tmp_path / "logs1")  # rank 3 was SIGKILLed in the middle of step 5
    assert run_generation(3, job(run, data), tmp_path / "logs2", example=EXAMPLE) == [0, 0, 0]
    assert "world size 3, grad_accum 4, resumed at step 3" in logs(tmp_path / "logs2")[0]

    ours, theirs = torch.load(run / "final-model.pt"), torch.load(tmp_path / "reference" / "final-model.pt")
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)

    plan = MixturePlan.load(run / "mixture.json")
    (epoch,) = audit(run, Grouping(plan.names, plan.source_of, plan.num_samples))
    assert epoch.finished and epoch.clean and epoch.seen_once == 240
    assert [(g.name, g.expected, g.seen_once, g.skipped, g.duplicated) for g in epoch.groups] == [
        ("web", 168, 168, 0, 0), ("code", 72, 72, 0, 0)]
    assert cli(["audit", str(run), "--mixture", str(run / "mixture.json")]) == 0
    out = capsys.readouterr().out
    assert "web       168        168        0" in out and "audit: every sample exactly once" in out
    losses = [float(line.rsplit(" ", 1)[1]) for line in logs(tmp_path / "logs0")[0].splitlines() if " loss " in line]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])  # it learns
