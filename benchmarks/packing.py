"""12. Document packing: padding and split documents against Grain's first-fit and best-fit packers on the same
documents, packed tokens/s against a plain loop packing the same documents in order, and the memory a packed
source of 1e9 documents adds by loading a batch at its middle.

Documents: EOS-terminated, lengths log-normal (median ~ seq_len / 6, a tail past seq_len + 1), in one uint16 token
file. Grain (`grain.experimental.FirstFitPackIterDataset` / `BestFitPackIterDataset`, num_packing_bins = our
rows_per_window R, bins not shuffled) packs the documents in data order, each cut into pieces of at most
seq_len + 1 first (it refuses longer ones), so both sides see the same pieces; ours packs windows of
fill * R * (seq_len + 1) tokens into R rows (`loader.sources.packing`). Padding: 1 - document tokens / row tokens;
"split": documents in more than one row (ours also cuts the document crossing each window edge and splits a piece
that fits no row, both counted). The plain loop packs pieces in order into the current row, a new row when one
does not fit (next fit), with the same metadata (segment_ids, positions, cu_seqlens), stacked in batches: the
limit of packing without random access. Ours: ResumableDataLoader over the PackedSource with shuffle_blocks=R
(each window's rows together, so a window is packed once) and with a global shuffle (a window packed per row).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.config import Config
from benchmarks.loaders import ours
from benchmarks.memory import in_child, peak_added
from benchmarks.progress import say
from benchmarks.rows import count, row, single
from benchmarks.states import global_state_at
from benchmarks.timing import compare
from loader.core.order import sample_seed
from loader.sources import TokenSource
from loader.sources.packing import PackedSource, row_metadata

EOS, ROWS, FILL, BATCH = 0, 64, 0.99, 8
FILLS = (0.98, FILL, 0.995)  # padding is about 1 - fill; a higher fill splits more pieces to fit
PADDING_TARGET = "<= 1"  # points of padding above Grain's best fit
THROUGHPUT_TARGET = ">= 0.5"  # ours (shuffle_blocks=R) / the plain in-order loop, packed tokens/s
MEMORY_TARGET = "< 1"  # MB added by a 1e9-document packed source resumed at its middle, one batch
PLAIN = "plain in-order packing loop"
MEAN_LENGTH = 512  # the analytic documents of the memory probe: lengths in [256, 768)


def write_documents(path: Path, tokens: int, seq_len: int) -> np.ndarray:
    """EOS-terminated documents of log-normal lengths filling about `tokens` tokens; returns their lengths."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(np.log(seq_len / 6), 1.0, tokens // (seq_len // 4) + 1).astype(np.int64))
    lengths = lengths[: max(1, int(np.searchsorted(np.cumsum(lengths + 1), tokens)))]
    stream = rng.integers(1, 50000, int((lengths + 1).sum()), dtype=np.uint16)
    stream[np.cumsum(lengths + 1) - 1] = EOS
    stream.tofile(path)
    return lengths + 1


def pieces_of(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Each document cut into pieces of at most `capacity` tokens, in order."""
    count_ = -(-lengths // capacity)
    rest = lengths - (count_ - 1) * capacity
    pieces = np.full(int(count_.sum()), capacity, np.int64)
    pieces[np.cumsum(count_) - 1] = rest
    return pieces


def grain_padding(pieces: np.ndarray, capacity: int, best: bool) -> dict:
    """Grain's packer over the pieces (tokens of their lengths), data order, R bins: padding and split share."""
    import grain
    import grain.experimental as experimental

    packer = experimental.BestFitPackIterDataset if best else experimental.FirstFitPackIterDataset
    elements = [{"tokens": np.ones(n, np.int32)} for n in pieces.tolist()]
    parent = grain.MapDataset.source(elements).to_iter_dataset()
    rows = list(packer(parent, length_struct={"tokens": capacity}, num_packing_bins=ROWS, shuffle_bins=False))
    used = sum(int((r["tokens_segment_ids"] > 0).sum()) for r in rows)
    return {"padding": 1 - used / (len(rows) * capacity), "rows": len(rows)}


def ours_padding(source: TokenSource, seq_len: int, mode: str, fill: float) -> dict:
    return PackedSource(source, seq_len, mode, rows_per_window=ROWS, fill=fill).stats()


def plain_loop(memmap: np.ndarray, lengths: np.ndarray, seq_len: int, rows: int) -> float:
    """Packed document tokens/s of next-fit packing in data order, with the same metadata, in batches."""
    capacity, start, tokens = seq_len + 1, time.perf_counter(), 0
    row_tokens, row_lengths, batch, at = [], [], [], 0
    for length in pieces_of(lengths, capacity).tolist():
        if sum(row_lengths) + length > capacity:
            padded = np.zeros(capacity, np.int64)
            padded[: sum(row_lengths)] = np.concatenate(row_tokens)
            batch.append({"tokens": torch.from_numpy(padded), **row_metadata(row_lengths, seq_len)})
            tokens, row_tokens, row_lengths = tokens + sum(row_lengths), [], []
            if len(batch) == BATCH:
                torch.utils.data.default_collate(batch)
                batch, rows = [], rows - BATCH
                if rows <= 0:
                    break
        row_tokens.append(memmap[at : at + length].astype(np.int64))
        row_lengths.append(length)
        at += length
    return tokens / (time.perf_counter() - start)


def through(source: TokenSource, seq_len: int, rows: int, **kwargs) -> float:
    """Packed document tokens/s of our loader over a new PackedSource, `rows` rows."""
    packed = PackedSource(source, seq_len, "best_fit", rows_per_window=ROWS, fill=FILL)
    start, tokens = time.perf_counter(), 0
    for _, batch in zip(range(rows // BATCH), ours(packed, batch_size=BATCH, **kwargs)):
        tokens += int((batch["segment_ids"] >= 0).sum())
    return tokens / (time.perf_counter() - start)


class AnalyticDocuments:
    """`count` documents whose lengths come from a keyed hash (256-767 tokens), every quantity computed: the
    memory probe's 1e9 documents without a file of 1e9 offsets. Document d starts at d * 512 + jitter(d)."""

    def __init__(self, count: int) -> None:
        self.count, self.tokens = count, count * MEAN_LENGTH

    def _start(self, documents: np.ndarray) -> np.ndarray:
        jitter = sample_seed(0, 0, documents) % (MEAN_LENGTH // 2)
        return np.where(documents == 0, 0, documents * MEAN_LENGTH + jitter)

    def document_starts(self, low: int, high: int) -> np.ndarray:
        candidates = np.arange(max(low // MEAN_LENGTH - 1, 0), min(high // MEAN_LENGTH + 1, self.count))
        starts = self._start(candidates)
        return starts[(starts >= low) & (starts < high)].astype(np.int64)

    def document_start(self, token: int) -> int:
        return int(self.document_starts(max(token - 2 * MEAN_LENGTH, 0), token + 1)[-1])

    def read_tokens(self, low: int, high: int) -> np.ndarray:
        return np.arange(low, high, dtype=np.int64) % 50000 + 1

    def describe_token(self, token: int) -> str:
        return str(token)

    def fingerprint(self) -> str:
        return f"analytic-{self.count}"


def memory_probe(documents: int, seq_len: int) -> dict:
    """Runs in a fresh process: the peak RSS that a new packed source of `documents` documents, resumed at its
    middle through our loader (shuffled), adds by loading a batch."""

    def first_batch_at_middle() -> None:
        packed = PackedSource(AnalyticDocuments(documents), seq_len, "best_fit", rows_per_window=ROWS, fill=FILL)
        loader = ours(packed, batch_size=BATCH, shuffle=True)
        loader.load_state_dict(global_state_at(packed, BATCH, len(packed) // 2))
        next(iter(loader))

    first_batch_at_middle()  # lazy imports and first-call allocations
    return peak_added(first_batch_at_middle)


def run(cfg: Config) -> dict:
    seq_len, total = cfg.seq_len, min(cfg.tokens_per_source, 2**22)
    rows_timed = max(4 * ROWS, 64) if cfg.mode != "smoke" else 2 * BATCH
    with tempfile.TemporaryDirectory(prefix="loader-bench-packing-") as directory:
        path = Path(directory) / "documents.bin"
        lengths = write_documents(path, total, seq_len)
        source = TokenSource(path, seq_len=seq_len, dtype="uint16", eos_id=EOS)
        pieces, capacity = pieces_of(lengths, seq_len + 1), seq_len + 1
        say("packing", f"{len(lengths)} documents, {int(lengths.sum())} tokens, {len(pieces)} pieces")
        try:
            padding, notes = (
                {
                    "grain first fit": grain_padding(pieces, capacity, False),
                    "grain best fit": grain_padding(pieces, capacity, True),
                },
                [],
            )
        except ImportError as err:  # a peer, not a dependency: the section runs without it, as the peers' does
            padding, notes = {}, [f'Grain not run ({err}): pip install -e ".[peers]" to compare its packers']
            say("packing", notes[0])
        padding |= {
            f"ours first fit, fill {FILL}": ours_padding(source, seq_len, "first_fit", FILL),
            **{f"ours best fit, fill {fill}": ours_padding(source, seq_len, "best_fit", fill) for fill in FILLS},
        }
        long = float((lengths > capacity).mean())
        memmap = np.memmap(path, np.uint16, mode="r")
        candidates = {
            PLAIN: lambda: plain_loop(memmap, lengths, seq_len, rows_timed),
            "ours, shuffle_blocks=R": lambda: through(source, seq_len, rows_timed, shuffle=True, shuffle_blocks=ROWS),
            "ours, global shuffle": lambda: through(source, seq_len, rows_timed, shuffle=True),
        }
        speed = compare(candidates, PLAIN, cfg.reps, cfg.warmup, "packing", "tokens/s")
    documents = 10**9
    if cfg.mode == "smoke":  # the probe's path in this process: a fresh one costs seconds of imports
        memory = memory_probe(documents, seq_len)
    else:
        memory = in_child("benchmarks.packing", [str(documents), str(seq_len)], cfg.memory_timeout_s)
    rows = [row(f"padding: {name} (R = {ROWS})", single(p["padding"]), "%", scale=100) for name, p in padding.items()]
    if "grain best fit" in padding:
        ours_best = padding[f"ours best fit, fill {FILL}"]["padding"] - padding["grain best fit"]["padding"]
        rows.append(
            row(
                f"padding: ours best fit, fill {FILL} - Grain best fit",
                single(ours_best),
                "points",
                PADDING_TARGET,
                scale=100,
            )
        )
    rows += [
        row(
            f"documents split: {name} (window edges + split to fit)",
            single(p["cut_at_window_edges"] + p["split_to_fit"]),
            "%",
            scale=100,
        )
        for name, p in padding.items()
        if name.startswith("ours")
    ]
    rows.append(row("documents longer than seq_len + 1 (cut into rows by both)", single(long), "%", scale=100))
    rows += [
        row(f"packed tokens/s: {name} / {PLAIN}", ratio, "ratio", THROUGHPUT_TARGET if name.endswith("=R") else None)
        for name, ratio in speed["ratios"].items()
    ]
    if "timed_out_s" not in memory:
        say("packing", f"{count(documents)} documents: +{memory['added_bytes'] / 1e6:.2f} MB")
        rows.append(
            row(
                f"memory: resume a {count(documents)}-document packed source at its middle, one batch",
                single(memory["added_bytes"]),
                "MB",
                MEMORY_TARGET,
                scale=1e-6,
            )
        )
    return {
        "seq_len": seq_len,
        "documents": len(lengths),
        "rows_per_window": ROWS,
        "fill": FILL,
        "padding": padding,
        "longer_than_a_row": long,
        "throughput": speed,
        "memory": memory,
        "rows": rows,
        "notes": notes,
    }


if __name__ == "__main__":
    print(json.dumps(memory_probe(int(sys.argv[1]), int(sys.argv[2]))))
