"""The capabilities of issue 30 against the peers that offer them at all, under the exactly-once table's script:
a filter (Grain's `filter` through its ElasticIterator), packing (Grain's first-fit packer under it) and a mixture
(LitData's CombinedStreamingDataset, Grain's `MapDataset.mix`), each beside ours (`filter=`, `PackedSource`,
`Mixture`). Every cell is measured in this run: skipped / duplicated by identity (samples; tokens for packing;
per source for a mixture), or the system's own refusal, its text as raised. The global batch changed 48 -> 96 is
the exactly-once table's column of that name.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass

from benchmarks.peers.config import PeersConfig
from benchmarks.peers.faults import Fault, cell, exactly_once
from benchmarks.peers.phase import error_text
from benchmarks.peers.samples import MIXTURE, SEQ_LEN, mixture_sources
from benchmarks.peers.systems import SYSTEMS
from benchmarks.progress import say

FAULTS = (Fault(4, 4), Fault(4, 3), Fault(4, 3, uneven=True), Fault(4, None))


@dataclass(frozen=True)
class Case:
    capability: str
    system: str  # its key in `systems.SYSTEMS`
    peer: str  # the adapter's name in the system's module
    how: str  # what is run, in words

    @property
    def module(self) -> str:
        return f"benchmarks.peers.{self.system}:{self.peer}"

    @property
    def name(self) -> str:
        return next(s.name for s in SYSTEMS if s.key == self.system)

    def size(self, n: int) -> int:
        """What is counted: n samples, or the tokens of about n rows (packing)."""
        return n * SEQ_LEN if self.capability == PACKING else n

    def sources(self, n: int) -> list[range]:
        return mixture_sources(n) if self.capability == MIXTURE_CASE else []


FILTER, PACKING, MIXTURE_CASE = "filter", "packing", "mixture"
CASES = (
    Case(FILTER, "grain_elastic", "FILTER", "`MapDataset.range(N).shuffle(seed).filter(keep)` through ElasticIterator"),
    Case(FILTER, "ours", "FILTER", "`filter=keep`; `last_filtered()` reported as filtered"),
    Case(PACKING, "grain_elastic", "PACKED", "`FirstFitPackIterDataset` of the shuffled documents, 64 bins"),
    Case(PACKING, "ours", "PACKED", "`PackedSource(TokenSource(doc_offsets=), mode='best_fit')`"),
    Case(MIXTURE_CASE, "lit", "MIXED", "`CombinedStreamingDataset` of two datasets' chunks, its defaults"),
    Case(MIXTURE_CASE, "grain_elastic", "MIXED", "`MapDataset.mix(sources, weights).shuffle(seed)`"),
    Case(MIXTURE_CASE, "ours", "MIXED", "`Mixture(sources, weights, N)`"),
)


def run_case(case: Case, n: int, stop_updates: int, timeout_s: float = 600.0) -> dict:
    """One case under every fault, or why it was not run (its system does not import here)."""
    path, _, name = case.module.partition(":")
    try:
        peer = getattr(importlib.import_module(path), name)
    except Exception as err:  # not installed, or broken here: reported with its error
        return {"not_run": error_text(err)}
    return exactly_once(peer, case.module, case.size(n), stop_updates, FAULTS, timeout_s, case.sources(n))


def run(pc: PeersConfig) -> dict:
    section = {"n": pc.capability_n, "stop_updates": pc.capability_stop, "cases": [], "seconds": {}}
    for case in CASES:
        start = time.perf_counter()
        say("peers", f"capability {case.capability}: {case.name}")
        results = run_case(case, pc.capability_n, pc.capability_stop, pc.launch_timeout_s)
        section["cases"].append({"capability": case.capability, "system": case.system, "results": results})
        section["seconds"][f"{case.capability} {case.system}"] = time.perf_counter() - start
    return section


STOP_FAILED = "the stop failed: "  # `faults._result`: the first launch raised, nothing was saved


def _shown(result: dict, refusals: list[str]) -> str:
    """A cell: skipped / duplicated (filtered, per source), or a refusal, its text numbered below the table."""
    message = result.get("cannot_resume") or result.get("error")
    if message is not None:
        text = message.removeprefix(STOP_FAILED)
        refusals += [text] * (text not in refusals)
        where = "cannot resume" if "cannot_resume" in result else "raised" if text == message else "raised at the stop"
        return f"{where} [{refusals.index(text) + 1}]"
    shown = cell(result)
    if "filtered" in result:
        shown += f", {result['filtered']:,} filtered"
    if "by_source" in result:
        shown += " (" + ", ".join(f"{k} {s['skipped']}/{s['duplicated']}" for k, s in zip(MIXTURE, result["by_source"]))
        shown += ")"
    return shown


def table(section: dict) -> list[str]:
    """A row per case, a column per fault; the refusals' texts below."""
    labels = [f.label for f in FAULTS]
    lines = [
        "| capability | system | run as | " + " | ".join(labels) + " |",
        "|---" * (len(labels) + 3) + "|",
    ]
    refusals: list[str] = []
    for entry in section["cases"]:
        case = next(c for c in CASES if (c.capability, c.system) == (entry["capability"], entry["system"]))
        results = entry["results"]
        cells = (
            [f"not run: {results['not_run']}"] + [""] * (len(labels) - 1)
            if "not_run" in results
            else [_shown(results[label], refusals) for label in labels]
        )
        lines.append(f"| {case.capability} | {case.name} | {case.how} | " + " | ".join(cells) + " |")
    return lines + ([""] + [f"[{i}] {text}" for i, text in enumerate(refusals, 1)] if refusals else [])


def script(section: dict) -> str:
    n = section["n"]
    return (
        f"The same script at N = {n:,} samples (packing: {n * SEQ_LEN:,} tokens of documents of 1-{3 * SEQ_LEN - 1} "
        f"tokens in rows of {SEQ_LEN + 1}, counted by token), 4 ranks stopped after {section['stop_updates']} "
        "updates of a global batch of 48 (rows for packing). A cell is skipped / duplicated over the epoch; the "
        "filter drops every tenth index (`filtered`: the ones the loader recorded as filtered, each counted "
        f"once); a mixture's sources ({', '.join(f'{k} {w:.0%}' for k, w in MIXTURE.items())} of N, so that its "
        'epoch draws every sample once) are also counted apart. "raised at the stop" (before anything was '
        'saved), "cannot resume" and "raised" (the uninterrupted epoch) carry the system\'s exception, numbered '
        "below."
    )
