"""One cold start of section 14: `python -m benchmarks.first_batch SPEC.json` starts, imports what one pipeline
needs, builds its loader, reads and loads its state file, takes the first batch, and prints one JSON line: the
`time.monotonic()` (a system-wide clock on Linux, so the parent's clock before it started the process is comparable)
at which each of those ended, and the CPU seconds of this process and its workers at the first batch (both taken
while the loader's iterator lives: dropping it joins its workers, no part of a first batch, and reaped workers'
CPU seconds are no longer a descendant's).

Only the standard library is imported at module level: every import a pipeline needs happens inside it and is
timed, as a restarted job pays it. A spec (written by `benchmarks.cold_start`): `system` (torch, ours, or a peer
adapter's key: grain_index, lit, olmo), `pipeline` (map, packed, webdataset), `num_workers`, `batch_size`, `n`
(samples), `data` (where the pipeline's files are), `state` (a JSON state file; none for torch), and the
pipeline's own fields.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.processes import descendants

Stamp = Callable[[str], None]


def _dataset(spec: dict) -> Any:
    """The pipeline's dataset, the same object under every loader."""
    if spec["pipeline"] == "map":
        from benchmarks.datasets import IndexDataset

        return IndexDataset(spec["n"])
    if spec["pipeline"] == "packed":
        from loader.sources import TokenSource
        from loader.sources.packing import PackedSource

        tokens = TokenSource(spec["data"], seq_len=spec["seq_len"], dtype="uint16", eos_id=spec["eos"])
        return PackedSource(tokens, spec["seq_len"], "best_fit", rows_per_window=spec["rows"], fill=spec["fill"])
    from loader.sources import WebDatasetSource

    return WebDatasetSource(
        spec["urls"],
        decode=[],  # webdataset's .decode() with no arguments, as section 6
        keys=spec["keys"],
        storage_options=spec["storage_options"],
        cache_dir=spec["cache_dir"],
        cache_limit=spec["cache_limit"],
        progress=False,
    )


def read_state(path: str) -> Any:
    """A state file as JSON (a peer's bytes state is kept as {"bytes": its text})."""
    state = json.loads(Path(path).read_text())
    return state["bytes"].encode() if isinstance(state, dict) and set(state) == {"bytes"} else state


def _torch(spec: dict, stamp: Stamp) -> Iterator:
    """torch's DataLoader starting the epoch: the cold start every other is read against (it has no resume)."""
    from torch.utils.data import DataLoader

    stamp("imported")
    dl = DataLoader(
        _dataset(spec), batch_size=spec["batch_size"], shuffle=spec["torch_shuffle"], num_workers=spec["num_workers"]
    )
    stamp("built")
    stamp("loaded")
    return iter(dl)


def loader_of(spec: dict) -> Any:
    """Our loader of the spec's pipeline, as the state file was saved from (`benchmarks.cold_start`)."""
    from loader import ResumableDataLoader

    dataset = _dataset(spec)
    blocks = {"shuffle_blocks": dataset.shard_sizes} if spec["pipeline"] == "webdataset" else {}
    return ResumableDataLoader(
        dataset,
        batch_size=spec["batch_size"],
        shuffle=True,
        seed=0,
        rank=0,
        world_size=1,
        num_workers=spec["num_workers"],
        **blocks,
    )


def _ours(spec: dict, stamp: Stamp) -> Iterator:
    import loader  # noqa: F401  (imported first, so that its import is not counted as construction)

    stamp("imported")
    dl = loader_of(spec)
    stamp("built")
    dl.load_state_dict(read_state(spec["state"]))
    stamp("loaded")
    return iter(dl)


def _peer(spec: dict, stamp: Stamp) -> Iterator:
    """A peer's resume through its adapter's `first_batch` (build, load, first batch: not split; num_workers=0)."""
    import importlib

    peer = importlib.import_module(f"benchmarks.peers.{spec['system']}").PEER
    stamp("imported")
    state = read_state(spec["state"])
    return iter([peer.first_batch(spec["n"], Path(spec["data"]), spec["batch_size"], state)])


def main(spec_path: str) -> dict:
    spec = json.loads(Path(spec_path).read_text())
    stamps: dict[str, float] = {}

    def stamp(what: str) -> None:
        stamps[what] = time.monotonic()

    run = {"torch": _torch, "ours": _ours}.get(spec["system"], _peer)
    batches = run(spec, stamp)
    next(batches)
    stamp("first")  # and the CPU seconds, while the iterator and its workers live: dropping it joins them
    return {"stamps": stamps, "cpu_s": time.process_time() + sum(descendants().values())}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
