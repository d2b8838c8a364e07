"""The peers section: the fault script counts by identity, ours resumes exactly under every fault, and
`python -m benchmarks --peers --smoke` runs every installed system (Grain from the `peers` extra, torchdata's
StatefulDataLoader always) and reports the others with their error. Structure only: nothing timed is asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import ours, torch_skip
from benchmarks.peers.faults import FAULTS, GLOBAL_BATCH, Fault, exactly_once, tally
from benchmarks.peers.section import exactly_once_table
from benchmarks.peers.systems import SYSTEMS

REPO = Path(__file__).resolve().parent.parent


def test_tally_counts_skipped_and_extra_deliveries():
    assert tally(5, [[0, 1], [1, 1, 4]]) == {"skipped": 2, "duplicated": 2, "delivered": 5}


def test_every_fault_keeps_the_global_batch():
    for fault in FAULTS:
        for world in (fault.before, fault.after or fault.before):
            assert fault.batch(world) * world * fault.accum == GLOBAL_BATCH
    assert Fault(4, 3, uneven=True).stop(50) == (50, 51, 49, 50)
    assert Fault(4, 6, accum=2).stop(50) == (100,) * 4


def test_a_global_batch_change_stops_off_the_new_batch_and_resumes_at_it():
    # an odd count of updates of 48 is never a whole number of batches of 96: a count-based resume must round
    ramp = Fault(4, 4, batch_after=96)
    assert ramp.stop(50) == (51,) * 4 and ramp.stop(5) == (5,) * 4
    assert (ramp.batch(4), ramp.batch(4, resumed=True)) == (12, 24)
    assert ramp.schedule(50) == ((0, 48), (51, 96)) and Fault(4, 4).schedule(50) is None
    assert ramp.key != Fault(4, 4).key and ramp.label == "4→4, global batch 48→96"


def _counts(module, n: int, faults: tuple[Fault, ...]) -> dict[str, tuple[int, int]]:
    results = exactly_once(module.PEER, module.__name__, n, 5, faults)
    return {label: (r["skipped"], r["duplicated"]) for label, r in results.items()}


ELASTIC_FAULTS = (Fault(4, 3), Fault(4, 3, uneven=True), Fault(4, 4, batch_after=96), Fault(4, None))


def test_a_count_based_resume_drops_the_tail_by_design_and_loses_what_unequal_ranks_consumed():
    # Grain's ElasticIterator (the `peers` extra): N = 1000, its tail 1000 mod 48 = 40 is dropped in every epoch,
    # resumed or not; the uneven stop adds rank 2's missing micro-batch (12 skipped) and rank 1's extra one (12
    # repeated); after the batch change the tail is the rest's own, (1000 - 5 x 48) mod 96 = 88
    grain_elastic = pytest.importorskip("benchmarks.peers.grain_elastic", reason="grain: pip install -e '.[peers]'")
    assert _counts(grain_elastic, 1000, ELASTIC_FAULTS) == {
        "4→3": (40, 0),
        "4→3 uneven": (52, 12),
        "4→4, global batch 48→96": (88, 0),
        "no restart, W=4": (40, 0),
    }


def test_olmo_core_resumes_at_tokens_over_the_new_global_batch():
    # 5 updates of 48 = 240 samples; at 96 it resumes at batch 240 // 96 = 2, sample 192: 48 served twice; its tail
    # is the order cut to whole global batches of the batch it runs at (1000 mod 96 = 40)
    pytest.importorskip("olmo_core", reason="ai2-olmo-core: installed with --target, see benchmarks/README.md")
    from benchmarks.peers import olmo

    assert _counts(olmo, 1000, ELASTIC_FAULTS) == {
        "4→3": (40, 0),
        "4→3 uneven": (52, 12),
        "4→4, global batch 48→96": (40, 48),
        "no restart, W=4": (40, 0),
    }


def test_the_table_says_what_each_system_drops_by_design():
    section = {"exactly_once": {"ours": {"4→3": {"skipped": 0, "duplicated": 0}}}, "not_run": {"olmo": "Err: x"}}
    header, _, mine, missing = exactly_once_table(section)
    assert "drops by design" in header and mine == "| loader (ours) | nothing | 0/0 |"
    assert missing.startswith("| OLMo-core | the epoch's last partial global batch") and "not run: Err: x" in missing
    assert all(system.drops for system in SYSTEMS)


def test_ours_resumes_exactly_under_every_fault():
    results = exactly_once(ours.PEER, ours.__name__, 960, 5)
    assert set(results) == {f.label for f in FAULTS}
    for label, result in results.items():
        assert (result["skipped"], result["duplicated"]) == (0, 0), (label, result)


def test_skipping_k_batches_misses_what_unequal_ranks_consumed():
    # rank 1 was one micro-batch ahead of rank 0 (its batch comes again), rank 2 one behind (its batch is lost)
    result = exactly_once(torch_skip.PEER, torch_skip.__name__, 960, 5, (Fault(4, 4, uneven=True),))
    assert (result["4→4 uneven"]["skipped"], result["4→4 uneven"]["duplicated"]) == (12, 12)


@pytest.fixture(scope="module")
def peers(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("peers")
    command = [sys.executable, "-m", "benchmarks", "--peers", "--smoke", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (json_path,) = out.glob("cpu-*-peers.json")
    data = json.loads(json_path.read_text())
    data["_markdown"] = json_path.with_suffix(".md").read_text()
    return data


@pytest.mark.slow  # the peers fixture runs the benchmark runner as a process of its own
def test_every_system_is_measured_or_reported_with_its_error(peers):
    section = peers["sections"]["peers"]
    keys = {s.key for s in SYSTEMS}
    assert set(section["exactly_once"]) | set(section["not_run"]) == keys
    assert {"torch_skip", "stateful", "grain_index", "grain_elastic", "energon", "ours"} <= set(section["exactly_once"])
    for key, error in section["not_run"].items():
        assert error and next(s.name for s in SYSTEMS if s.key == key) in peers["_markdown"]
    for results in section["exactly_once"].values():
        for label, result in results.items():
            assert ("skipped" in result) != ("cannot_resume" in result or "error" in result), (label, result)


@pytest.mark.slow
def test_the_smoke_table_has_every_cost_and_the_versions(peers):
    section = peers["sections"]["peers"]
    assert section["versions"]["grain"] != "not installed"
    assert all(p["values"] for p in section["resume"]["points"])
    assert {case["kind"] for case in section["throughput"]} == {"index", "jpeg"}
    for case in section["throughput"]:
        assert "ours" in case["ratios"] and all(r["median"] > 0 for r in case["ratios"].values())
        assert set(case["cpu"]["ratios"]) == set(case["ratios"])  # per CPU second, from the same rounds
        assert all(r["median"] > 0 for r in case["cpu"]["ratios"].values())
        assert len(case["load_average"]) == 2
    markdown = peers["_markdown"]
    assert "### Exactly once" in markdown and "### Costs" in markdown and "how it saves state" in markdown
    assert "| met |" not in markdown


@pytest.mark.slow
def test_energon_resumes_at_its_world_size_and_refuses_another(peers):
    # its documented save_state_global / restore_state_global: every rank's state, one per rank of the old world
    results = peers["sections"]["peers"]["exactly_once"]["energon"]
    assert (results["4→4"]["skipped"], results["4→4"]["duplicated"]) == (0, 0)
    assert "State must be a list of size world_size" in results["4→3"]["cannot_resume"]
    assert (results["no restart, W=3"]["skipped"], results["no restart, W=3"]["duplicated"]) == (0, 0)
    assert "Megatron Energon" in peers["_markdown"] and "restore_state_global" in peers["_markdown"]
