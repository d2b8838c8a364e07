"""examples/train_lm.py: a tiny transformer on packed documents of two token corpora, mixed by a schedule (web text
alone, then a ramp to 70/30), survives a SIGKILLed rank and a resize, with the final model of the uninterrupted run
and a clean audit for each source; its document mask is the same through FlexAttention and the dense SDPA mask.

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
    return [
        "--run-dir",
        str(run_dir),
        "--data-dir",
        str(data_dir),
        "--samples",
        "240",
        "--global-batch",
        "24",
        "--micro-batch",
        "2",
        "--checkpoint-every",
        "3",
        "--ledger",
        *extra,
    ]


def test_a_killed_rank_and_a_resize_keep_the_model_and_every_source_exactly_once(tmp_path, capsys):
    data = tmp_path / "data"
    assert run_generation(2, job(tmp_path / "reference", data), tmp_path / "logs0", example=EXAMPLE) == [0, 0]
    run = tmp_path / "run"
    first = run_generation(
        4, job(run, data, "--fail-at-step", "4", "--fail-rank", "3"), tmp_path / "logs1", example=EXAMPLE
    )
    assert first[3] == -9, logs(tmp_path / "logs1")  # rank 3 was SIGKILLed in the middle of step 5
    assert run_generation(3, job(run, data), tmp_path / "logs2", example=EXAMPLE) == [0, 0, 0]
    assert "world size 3, grad_accum 4, resumed at step 3" in logs(tmp_path / "logs2")[0]

    ours, theirs = torch.load(run / "final-model.pt"), torch.load(tmp_path / "reference" / "final-model.pt")
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)

    plan = MixturePlan.load(run / "mixture.json")
    counts, _ = plan.window_table(np.arange(24))  # web/code slots of the job's 24 windows of 10 positions
    assert counts[:7].tolist() == [[10, 0]] * 7 and counts[18:].tolist() == [[7, 3]] * 6  # warm-up, then 70/30
    assert (np.diff(counts[6:19, 1]) >= 0).all() and counts[12, 1] in (1, 2)  # the ramp in between
    web, code = counts.sum(0).tolist()
    (epoch,) = audit(run, Grouping(plan.names, plan.source_of, plan.num_samples))
    assert epoch.finished and epoch.clean and epoch.seen_once == 240
    assert [(g.name, g.expected, g.seen_once, g.skipped, g.duplicated) for g in epoch.groups] == [
        ("web", web, web, 0, 0),
        ("code", code, code, 0, 0),
    ]
    assert cli(["audit", str(run), "--mixture", str(run / "mixture.json")]) == 0
    out = capsys.readouterr().out
    assert f"web       {web}        {web}        0" in out and "audit: every sample exactly once" in out
    first_launch = logs(tmp_path / "logs1")[0]
    assert "data: web packed best fit into" in first_launch and "0-59 10/0, 60-179 10/0 -> 7/3" in first_launch
    losses = [float(line.rsplit(" ", 1)[1]) for line in logs(tmp_path / "logs0")[0].splitlines() if " loss " in line]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])  # it learns


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager: CPU inference
def test_flex_attention_masks_packed_documents_as_the_dense_mask_does():
    """The example's two attention paths: create_block_mask + flex_attention and SDPA with the dense boolean mask
    give the same logits on packed rows (forward only: torch's CPU FlexAttention has no backward)."""
    import importlib.util

    pytest.importorskip("torch.nn.attention.flex_attention", reason="FlexAttention needs torch >= 2.5")
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    torch.manual_seed(0)
    segments = torch.tensor([[0] * 10 + [1] * 13 + [2] * 8 + [-1] * 2, [0] * 20 + [1] * 13])  # pieces, padding
    positions = torch.cat([torch.arange(n) for n in (10, 13, 8, 2, 20, 13)]).view(2, 33)
    tokens = torch.randint(1, train_lm.VOCAB, (2, 33))
    model = train_lm.TinyLM(33).eval()
    with torch.no_grad():
        dense = model(tokens, positions, segments)
        model.attention = "flex"
        flex = model(tokens, positions, segments)
        tokens[0, 12] = (tokens[0, 12] + 1) % train_lm.VOCAB  # a token of document 1 changes
        changed = model(tokens, positions, segments)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    moved = (changed - flex).abs().amax(-1)[0] > 1e-6
    assert moved.tolist() == [False] * 12 + [True] * 11 + [False] * 10  # only document 1 from that token on


def test_the_loss_controller_changes_the_weights_online_across_a_kill_and_a_resize(tmp_path, capsys):
    """--control-every 2, one worker per rank: every second update, weights from the last update's loss per
    source, applied from a window no rank has prefetched; the checkpoint carries them, rank 2 of 3 is killed
    during step 7 and 2 ranks finish; the plan records each change (its step), the audit by source is clean and
    names them."""
    run = tmp_path / "run"
    argv = job(run, tmp_path / "data", "--control-every", "2", "--workers", "1")
    first = run_generation(3, argv + ["--fail-at-step", "6", "--fail-rank", "2"], tmp_path / "logs1", example=EXAMPLE)
    assert first[2] == -9, logs(tmp_path / "logs1")
    assert run_generation(2, argv, tmp_path / "logs2", example=EXAMPLE) == [0, 0], logs(tmp_path / "logs2")
    asked = [
        line
        for line in logs(tmp_path / "logs1")[0].splitlines() + logs(tmp_path / "logs2")[0].splitlines()
        if "mixture: weights web/code" in line
    ]
    assert asked, logs(tmp_path / "logs2")[0]
    run_dir_plan = run / "mixture.json"
    plan = MixturePlan.load(run_dir_plan)
    assert plan.requests and all(step % 2 == 0 for step, _ in plan.requests)
    assert cli(["audit", str(run), "--mixture", str(run_dir_plan)]) == 0
    out = capsys.readouterr().out
    for step, window in plan.requests:  # none before code has targets (web alone for 6 windows)
        assert f"weights changed online at step {step}: from position {window * 10} (window {window}" in out
    assert "audit: every sample exactly once" in out
