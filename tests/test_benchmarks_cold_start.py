"""Section 14's code path (`python -m benchmarks --sections cold-start`): the child process resumes where its state
says, imports nothing before it times its imports, and reports ordered timestamps; the rows read a ratio straddling
the target as not resolved. Structure only: no timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cold_start, first_batch
from benchmarks.timing import result_of, summary

REPO = Path(__file__).resolve().parent.parent
N = 1000
PACKED = cold_start.PACKED


def _spec(tmp_path: Path, pipeline: str) -> dict:
    if pipeline == "map":
        return {"pipeline": "map", "n": N, "torch_shuffle": True, "batch_size": cold_start.BATCH, "num_workers": 0}
    from benchmarks.packing import write_documents

    write_documents(tmp_path / "documents.bin", 2**14, cold_start.PACKED["seq_len"])
    data = str(tmp_path / "documents.bin")
    return {"pipeline": "packed", "data": data, "torch_shuffle": True, "batch_size": 8, "num_workers": 0, **PACKED}


def _resumed(tmp_path: Path, spec: dict, where: str, position: int) -> dict:
    ours = {**spec, "system": "ours"}
    path = cold_start._write(tmp_path, f"ours-{where}", ours, cold_start._ours_state(ours, position))
    return json.loads(path.read_text())


def test_the_child_imports_nothing_before_it_times_its_imports():
    """`benchmarks.peers` imported its whole section (torchdata, webdataset) with any adapter: a peer's cold start
    paid for them."""
    heavy = ("torch", "numpy", "torchdata", "webdataset", "loader", "grain", "litdata")
    code = f"import sys, benchmarks.first_batch, benchmarks.peers; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("pipeline", ["map", "packed"])
def test_a_resumed_first_batch_is_the_batch_at_its_position(tmp_path, pipeline):
    spec = _spec(tmp_path, pipeline)
    batch = spec["batch_size"]
    epoch = list(first_batch.loader_of(spec))
    n = len(first_batch.loader_of(spec).dataset)
    for where, position in cold_start.positions(n, batch).items():
        resumed = _resumed(tmp_path, spec, where, position)
        got = next(first_batch._ours(resumed, lambda what: None))
        expected = epoch[position // batch]
        if pipeline == "map":
            assert torch.equal(got, expected), where
        else:
            assert torch.equal(got["tokens"], expected["tokens"]), where


def test_a_resume_at_the_middle_serves_the_rest_of_the_epoch_exactly_once(tmp_path):
    spec = _spec(tmp_path, "map")
    middle = cold_start.positions(N, cold_start.BATCH)["middle"]
    assert 0 < middle < N
    first = [i for b in first_batch.loader_of(spec) for i in b.tolist()][:middle]
    dl = first_batch.loader_of(spec)
    dl.load_state_dict(first_batch.read_state(_resumed(tmp_path, spec, "middle", middle)["state"]))
    rest = [i for b in dl for i in b.tolist()]
    assert sorted(first + rest) == list(range(N))  # every index once: none skipped, none repeated


def test_a_peer_bytes_state_is_read_back_as_bytes(tmp_path):
    path = cold_start._write(tmp_path, "grain", {"system": "grain_index"}, b'{"last_seen_indices": {"0": 5}}')
    assert first_batch.read_state(json.loads(path.read_text())["state"]) == b'{"last_seen_indices": {"0": 5}}'


def _case(ratios: list[float]) -> dict:
    parts = {p: summary([0.1, 0.1]) for p in cold_start.PARTS}
    samples = {cold_start.BASELINE: [1.0] * len(ratios), "ours at middle": ratios}
    return {
        "pipeline": "map",
        "num_workers": 0,
        **{clock: result_of(samples, cold_start.BASELINE, unit) for clock, unit in cold_start.CLOCKS.items()},
        "parts": {name: parts for name in samples},
    }


def test_a_ratio_straddling_the_target_reads_not_resolved():
    straddling = cold_start._rows(_case([1.0, 1.05, 1.15, 1.2]))
    below = cold_start._rows(_case([0.98, 1.0, 1.01, 1.02]))
    assert [r["what"] for r in straddling][0].endswith("DataLoader cold start (process start -> first batch)")
    assert straddling[1]["resolved"] is False and straddling[1]["met"] is None
    assert below[1]["met"] is True and below[1]["target"] == cold_start.TARGET
    assert (
        cold_start._table([_case([1.0, 1.0])])[-1]
        == "| map | 0 | 100 / 100 | 100 / 100 | 100 / 100 | 100 / 100 | 1000 / 1000 |"
    )


@pytest.mark.slow  # two fresh processes, each importing torch
def test_a_cold_start_reports_its_parts_in_order(tmp_path):
    spec = _spec(tmp_path, "map")
    torch_spec = cold_start._write(tmp_path, "torch", {**spec, "system": "torch"})
    ours_spec = tmp_path / "ours-middle.json"
    _resumed(tmp_path, spec, "middle", cold_start.positions(N, cold_start.BATCH)["middle"])
    for path in (torch_spec, ours_spec):
        measured = cold_start.cold_start(path, timeout_s=600)
        assert all(measured[p] >= 0 for p in cold_start.PARTS), measured
        assert measured["wall"] == pytest.approx(sum(measured[p] for p in cold_start.PARTS))
        assert measured["cpu"] > 0
