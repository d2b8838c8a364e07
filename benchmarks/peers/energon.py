"""Megatron Energon: `get_train_dataset` on WebDataset shards prepared with its own `energon prepare`, through
`get_savable_loader`, one epoch (`repeat=False`), with the shuffle settings of its save/restore documentation
(`shuffle_buffer_size=100`, `max_samples_per_sequence=100`).

Under data parallelism the job saves `save_state_global(global_dst_rank=0)`, every rank's state gathered on
rank 0, and every rank restores that list with `restore_state_global`, as its documentation's second scenario
says. The rank and world size are its `WorkerConfig`'s, so one process simulates every rank (as for Grain and
StatefulDataLoader); the one collective, save_state_global's gather_object of each rank's `save_state_rank()`,
is that list assembled in rank order here (`save`). Ranks as processes in a gloo group calling it for real gave
the same counts on five faults at 960 samples, in 76 s against 23 s in one process on this shared machine.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import webdataset
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
from megatron.energon.tools.prepare import command as energon_prepare

from benchmarks.environment import usable_cpus
from benchmarks.peers.phase import InProcess, Phase, deliver
from benchmarks.peers.samples import jpeg_bytes

# get_savable_loader asks for pinned memory, which torch ignores without an accelerator, warning at every loader.
warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true.*")
SAMPLES_PER_SHARD = 4096
# The costs' states at N/2 are reached by delivering N/2 samples (~2.5k/s here): beyond this N, writing, preparing
# and reaching them would take minutes each, so larger N are refused before anything is written.
MAX_SAMPLES = 2 * 10**5
SHUFFLE = {"shuffle_buffer_size": 100, "max_samples_per_sequence": 100}  # as its save/restore documentation
# The sample types its `energon prepare` maps a shard's fields to: the index as text, the JPEG as an image, which
# its decoder turns into a tensor with Pillow (as `samples.decode` does for every other system).
TYPES = {"index": ("TextSample", '{"text": "txt"}'), "jpeg": ("ImageSample", '{"image": "jpg"}')}


def _loader(data: Path, rank: int, world: int, batch: int, workers: int = 0):
    config = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    dataset = get_train_dataset(str(data), batch_size=batch, worker_config=config, repeat=False, **SHUFFLE)
    return get_savable_loader(dataset)


def _ids(batch) -> list[int]:
    return [int(text) for text in batch.text]


class Energon(InProcess):
    saves = (
        "save_state_global(0): every rank's state gathered on rank 0; every rank restores that list with "
        "restore_state_global"
    )

    def prepare(self, n: int, data: Path, kind: str = "index") -> None:
        """Shards written with webdataset's TarWriter, then `energon prepare` (all of it the train split)."""
        if n > MAX_SAMPLES:
            raise ValueError(
                f"N={n:,} is not measured: its state at N/2 would be reached by delivering N/2 samples "
                f"(the state has no counter to move), minutes beyond N={MAX_SAMPLES:,}"
            )
        data.mkdir(parents=True)
        image = jpeg_bytes()
        for first in range(0, n, SAMPLES_PER_SHARD):
            with webdataset.TarWriter(str(data / f"shard-{first // SAMPLES_PER_SHARD:06d}.tar")) as shard:
                for i in range(first, min(n, first + SAMPLES_PER_SHARD)):
                    shard.write({"__key__": f"{i:010d}", **({"txt": str(i)} if kind == "index" else {"jpg": image})})
        sample_type, fields = TYPES[kind]
        workers = min(len(range(0, n, SAMPLES_PER_SHARD)), usable_cpus())  # its default, 16, on 2 CPUs crawls
        arguments = [
            str(data),
            "--non-interactive",
            "--no-progress",
            "--num-workers",
            str(workers),
            "--split-ratio",
            "1,0,0",
            "--sample-type",
            sample_type,
            "--field-map",
            fields,
        ]
        with contextlib.redirect_stdout(io.StringIO()):  # its CLI command, run here: a process of its own took 4 s
            energon_prepare.main(arguments, standalone_mode=False)

    def rank_phase(self, phase: Phase, rank: int, saved: list | None):
        dl = _loader(phase.data, rank, phase.world, phase.batch)
        if saved is not None:
            dl.restore_state_global(saved)
        return [i for b in deliver(dl, phase.steps[rank]) for i in _ids(b)], dl.save_state_rank()

    def save(self, states: list, phase: Phase) -> list:
        return states  # what save_state_global(0) returns on rank 0: every rank's save_state_rank(), by rank

    def state_at(self, n: int, data: Path, batch: int, position: int) -> list:
        """The state it saves after `position` samples, reached by delivering them (its state holds the shuffle
        buffer's samples and each worker's place in its slices: no counter to move)."""
        dl = _loader(data, 0, 1, batch)
        for _ in deliver(dl, max(1, position // batch)):
            pass
        return dl.save_state_global(global_dst_rank=0)

    def first_batch(self, n: int, data: Path, batch: int, state: list):
        dl = _loader(data, 0, 1, batch)
        dl.restore_state_global(state)
        return next(iter(dl))

    def loader(self, n: int, data: Path, batch: int, workers: int, kind: str):
        """Its batches' samples by field, as other loaders collate dicts: the texts, or the images its decoder made
        (a batch object has no length)."""
        field = "text" if kind == "index" else "image"
        return ({"i": getattr(b, field)} for b in _loader(data, 0, 1, batch, workers))


PEER = Energon()
