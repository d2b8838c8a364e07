"""The peers section: the fault script counts by identity, ours resumes exactly under every fault, and
`python -m benchmarks --peers --smoke` runs every installed system (Grain from the `peers` extra, torchdata's
StatefulDataLoader always) and reports the others with their error. Structure only: nothing timed is asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import capabilities, ours, torch_skip
from benchmarks.peers.faults import FAULTS, GLOBAL_BATCH, Fault, exactly_once, tally
from benchmarks.peers.samples import SEQ_LEN
from benchmarks.peers.section import exactly_once_table
from benchmarks.peers.systems import SYSTEMS

APART = (
    "is not importable: a peer the benchmarks compare against, not a dependency; its pins conflict with the "
    "constraints, so it is installed apart (pip install --target DIR --no-deps, benchmarks/README.md, Peers) "
    "and found with PYTHONPATH=DIR"
)

REPO = Path(__file__).resolve().parent.parent


def test_tally_counts_skipped_and_extra_deliveries():
    assert tally(5, [[0, 1], [1, 1, 4]]) == {"skipped": 2, "duplicated": 2, "delivered": 5}


def test_tally_counts_a_filtered_record_as_a_delivery_and_each_source_apart():
    # ~i is sample i recorded as filtered: 2 filtered once is no skip, 3 trained and filtered is a duplicate
    assert tally(5, [[0, ~2, 3], [~3, 4, 4]], [range(0, 3), range(3, 5)]) == {
        "skipped": 1,
        "duplicated": 2,
        "delivered": 4,
        "filtered": 2,
        "by_source": [{"skipped": 1, "duplicated": 0}, {"skipped": 0, "duplicated": 2}],
    }


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
    pytest.importorskip("olmo_core", reason=f"ai2-olmo-core {APART}")
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


def _case_counts(capability: str, system: str, n: int = 240) -> dict[str, dict]:
    case = next(c for c in capabilities.CASES if (c.capability, c.system) == (capability, system))
    results = capabilities.run_case(case, n, 2)
    assert "not_run" not in results, results
    return results


def _without_state(results: dict[str, dict]) -> dict[str, dict]:
    return {label: {k: v for k, v in r.items() if k != "state_bytes"} for label, r in results.items()}


def test_ours_trains_or_records_as_filtered_every_sample_of_a_filter_a_packing_and_a_mixture():
    # 240 samples = 5 global batches, stopped after 2 updates: the filter's 24 (every tenth) recorded as filtered,
    # every packed token once (240 x 32 tokens), every sample of each mixture source once
    sources = [{"skipped": 0, "duplicated": 0}] * 2
    for label, result in _without_state(_case_counts("filter", "ours")).items():
        assert result == {"skipped": 0, "duplicated": 0, "delivered": 216, "filtered": 24}, label
    for label, result in _without_state(_case_counts("packing", "ours")).items():
        assert result == {"skipped": 0, "duplicated": 0, "delivered": 240 * SEQ_LEN}, label
    for label, result in _without_state(_case_counts("mixture", "ours")).items():
        assert result == {"skipped": 0, "duplicated": 0, "delivered": 240, "by_source": sources}, label


def test_grain_refuses_a_filter_and_packing_and_mixes_in_lockstep_only():
    """Grain's ElasticIterator (the `peers` extra) raises on `filter` and on its packer, at the stop already; its
    `MapDataset.mix` resumes a lockstep run at 3 ranks, and loses rank 2's missing micro-batch and repeats rank 1's
    extra one after an uneven stop (12 each), per source as they fell."""
    pytest.importorskip("benchmarks.peers.grain_elastic", reason="grain: pip install -e '.[peers]'")
    filtered, packed = _case_counts("filter", "grain_elastic"), _case_counts("packing", "grain_elastic")
    assert "ElasticIterator does not support `filter` transformation" in filtered["4→3"]["error"]
    assert "'FirstFitPackIterDataset' object is not subscriptable" in packed["4→3"]["error"]
    assert all("error" in r for r in [*filtered.values(), *packed.values()])
    mixed = _without_state(_case_counts("mixture", "grain_elastic"))
    assert (mixed["4→3"]["skipped"], mixed["4→3"]["duplicated"]) == (0, 0)
    uneven = mixed["4→3 uneven"]
    assert (uneven["skipped"], uneven["duplicated"]) == (12, 12)
    assert [sum(s[k] for s in uneven["by_source"]) for k in ("skipped", "duplicated")] == [12, 12]
    table = capabilities.table({"cases": [{"capability": "filter", "system": "grain_elastic", "results": filtered}]})
    assert table[2].endswith(
        "| raised at the stop [1] | raised at the stop [1] | raised at the stop [1] | raised [1] |"
    )
    assert table[-1].startswith("[1] ValueError: ElasticIterator does not support `filter` transformation.")


@pytest.mark.slow  # a gloo group of rank processes per launch
def test_litdata_refuses_a_mixture_at_another_world_size():
    pytest.importorskip("litdata", reason=f"litdata {APART}")
    results = _case_counts("mixture", "lit")
    refusal = "support resume only when world_size, num_workers, and batch_size match the checkpoint"
    assert refusal in results["4→3"]["cannot_resume"] and refusal in results["4→3 uneven"]["cannot_resume"]
    control = results["no restart, W=4"]
    assert (control["skipped"], control["duplicated"]) == (0, 0)
