"""How the benchmarks grade what they measure (issue 24): a pass is timed to its last batch, a spread that straddles
its target is "not resolved", and the CPU time of a pass counts the worker processes. Nothing timed is asserted:
the clock is a counter here, and the processes are only found, not measured."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

import benchmarks.throughput as throughput
from benchmarks.peers.section import _ratio
from benchmarks.report import markdown
from benchmarks.rows import row
from benchmarks.timing import summary


class _Clock:
    """A clock that moves only when told: a batch takes 1 s, and the end of the pass takes 100 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pass(clock: _Clock, batches: int, batch_size: int):
    for _ in range(batches):
        clock.now += 1.0
        yield {"i": list(range(batch_size))}
    clock.now += 100.0  # what RandomSampler does when a pass ends: the next pass's whole permutation


def test_a_pass_is_timed_from_the_first_batch_to_the_last(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=clock, process_time=clock))
    monkeypatch.setattr(throughput, "descendants", dict)  # no worker processes: the pass runs in this one
    monkeypatch.setattr(throughput, "_reaped_s", lambda: 0.0)
    rates = throughput.timed_pass(_pass(clock, 11, 64), 0, "counted")
    # the first batch is start-up; 10 batches of 64 in 10 s; the end of the pass is nobody's throughput
    assert rates == {"wall": 64.0, "cpu": 64.0}


def test_the_cpu_time_of_a_pass_includes_its_child_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in throughput.descendants()
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.pid not in throughput.descendants()


def test_a_spread_that_straddles_its_target_is_not_resolved():
    straddling = summary([0.96, 0.98, 0.99, 1.0, 1.01, 1.02, 1.04])
    graded = row("ours / DataLoader", straddling, "ratio", ">= 0.99")
    assert graded["met"] is None and graded["resolved"] is False
    clear = row("ours / DataLoader", summary([1.01, 1.02, 1.03, 1.05]), "ratio", ">= 0.99")
    assert clear["met"] is True and "resolved" not in clear
    below = row("ours / DataLoader", summary([0.90, 0.92, 0.93, 0.95]), "ratio", ">= 0.99")
    assert below["met"] is False
    once = row("state bytes", summary([529]), "B", "<= 1024")  # one value: compared as it is
    assert once["met"] is True


def test_the_table_says_not_resolved_with_the_quartiles():
    straddling = row("ours / DataLoader", summary([0.96, 0.98, 0.99, 1.0, 1.01, 1.02, 1.04]), "ratio", ">= 0.99")
    results = {
        "mode": "quick",
        "config": {"reps": 7, "warmup": 1},
        "plots": {},
        "environment": {
            "device": "cpu",
            "device_name": "test",
            "torch": "t",
            "numpy": "n",
            "torchdata": "d",
            "webdataset": "w",
            "python": "p",
            "cpus_usable": 2,
            "git_commit": None,
            "git_dirty": False,
            "load_average_at_start": [3.0, 2.0, 1.0],
        },
        "sections": {"throughput": {"title": "1. throughput", "rows": [straddling]}},
    }
    assert "| not resolved (quartiles 0.985 - 1.02) |" in markdown(results)


@pytest.mark.parametrize(
    "ratios, cell",
    [
        ([0.6, 0.9, 1.1, 1.4, 2.4], "not resolved (0.90-1.40)"),  # a median of 1.1 that says nothing
        ([1.2, 1.3, 1.4, 1.5, 1.6], "1.40"),
        ([0.004, 0.005, 0.005, 0.006], "0.005"),
    ],
)
def test_a_peers_throughput_cell_is_a_number_only_where_the_rounds_resolve_parity(ratios, cell):
    assert _ratio(summary(ratios)) == cell


def test_the_instruction_counts_are_read_per_candidate_and_round_and_graded_as_a_speed(tmp_path):
    """benchmarks.instructions without valgrind: callgrind's dumps (one before each mark) read back in order, each
    measured run's dump given to its candidate per batch, and DataLoader's count over ours read against 0.98."""
    from benchmarks.instructions import MEASURED, per_batch, rows, totals

    for k, total in enumerate([7, 100, 9, 200, 9, 204], start=1):
        (tmp_path / f"out.{k}").write_text(f"events: Ir\nsummary: {total}\ntotals: {total}\n")
    (tmp_path / "out.7").write_text("events: Ir\nsummary: 5\n")  # at exit, after the last mark
    dumps = totals(tmp_path)
    assert dumps == [7, 100, 9, 200, 9, 204, 5]
    values = per_batch(dumps, 6, MEASURED, batches=2)
    assert values == {"DataLoader": [50.0], "ResumableDataLoader": [100.0], "ResumableDataLoader+state_dict": [102.0]}
    graded = {r["what"]: r for r in rows(values)}
    checkpointing = graded["ResumableDataLoader+state_dict / DataLoader (instructions)"]
    assert checkpointing["median"] == pytest.approx(50 / 102) and checkpointing["met"] is False
    with pytest.raises(RuntimeError, match="another caller of zlib.adler32"):
        per_batch(dumps[:4], 6, MEASURED, batches=2)


@pytest.mark.parametrize("module", ["benchmarks.instructions", "benchmarks.cold_start_instructions"])
def test_the_instruction_count_without_valgrind_says_so_and_exits_cleanly(tmp_path, module):
    done = subprocess.run(
        [sys.executable, "-m", module],
        env={"PATH": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "valgrind is not on PATH: nothing measured" in done.stdout, done.stderr
