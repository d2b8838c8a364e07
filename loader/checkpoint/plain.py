"""Reading a DCP checkpoint without running code from it: what a pickle in it may name, and the reader and planner
that read its `.metadata` and its non-tensor values with those rules.

Why: torch.distributed.checkpoint unpickles `.metadata` with plain `pickle.load`, and values other than tensors with
torch.load(weights_only=False); either runs whatever code a crafted file names. Here `.metadata` may name only DCP's
own metadata types (the dataclasses and enums of its metadata, filesystem and planner modules, listed from those
modules so that a torch release adding one still reads), torch.Size, torch's dtypes, layouts and memory formats as
torch pickles them, paths and a few plain containers; any other value is read with torch.load(weights_only=True)."""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import re
from collections import OrderedDict
from typing import IO, Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from loader.checkpoint.publish import CheckpointError


def _metadata_types() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for every global a genuine `.metadata` names. Constructing any of them runs no code
    but a dataclass's generated __init__, an enum's lookup, a path's or a container's constructor, or torch's lookup
    of a layout by name."""
    allowed: dict[tuple[str, str], Any] = {}

    def add(obj: Any, *modules: str) -> None:
        for module in {obj.__module__, *modules}:
            allowed[(module, obj.__qualname__)] = obj

    for module in (dcp_metadata, dcp_filesystem, dcp_planner):
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and obj.__module__ == module.__name__
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
            ):
                add(obj)
    for path in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath):
        add(path, "pathlib")  # a StorageMeta's checkpoint_id when DCP was given a Path
    for container in (OrderedDict, set, frozenset):
        add(container)
    add(torch.Size, "torch")
    for kind in (torch.dtype, torch.layout, torch.memory_format):  # torch's reducers of them (a layout's: by name)
        sample = next(v for v in vars(torch).values() if isinstance(v, kind))
        reducer = copyreg.dispatch_table.get(kind)
        if reducer is not None:
            add(reducer(sample)[0])
    return allowed


_ALLOWED = _metadata_types()
# torch's dtypes, layouts and memory formats: a dtype pickles as its name in `torch`, a memory format as the dotted
# name "torch.<name>" looked up in whichever loaded module imports torch; both are answered from this table, never
# by importing or reading the module the pickle names.
_TORCH_VALUES = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals a genuine `.metadata` names; any other refuses the file."""

    def __init__(self, stream: IO[bytes], where: str):
        super().__init__(stream)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch":
            found = _TORCH_VALUES.get(name)
        if found is None and name.startswith("torch."):
            found = _TORCH_VALUES.get(name[len("torch.") :])
        if found is None:
            raise CheckpointError(
                f"{self.where} names {module}.{name}, which is not one of DCP's metadata types: the loader never "
                f"unpickles it, as that could run any code. This checkpoint was not written by "
                f"torch.distributed.checkpoint, or was altered: do not load it"
            )
        return found


def read_metadata(stream: IO[bytes], where: str) -> dcp_metadata.Metadata:
    """A DCP `.metadata` file, unpickled with only DCP's metadata types; a CheckpointError naming `where` and the
    global refuses any other, before it is resolved (nothing imported, nothing run)."""
    try:
        metadata = _MetadataUnpickler(stream, where).load()
    except CheckpointError:
        raise
    except Exception as err:  # truncated, or a constructor refused its arguments
        raise CheckpointError(f"{where} is not a DCP metadata pickle ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class PlainReader(FileSystemReader):
    """DCP's file reader, except that `.metadata` is read by `read_metadata`: DCP's own unpickles it, which runs
    whatever code a crafted file names. Tensors DCP reads with torch.load(weights_only=True) already."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            # torch annotates create_stream as io.IOBase; it yields the file opened in binary mode, an IO[bytes]
            metadata = read_metadata(stream, f"checkpoint file {path}")  # type: ignore[arg-type]
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:  # as DCP's reader does
            storage_meta = metadata.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def check_metadata(checkpoint_id: str | os.PathLike) -> set[str]:
    """Every metadata file of DCP checkpoint directory `checkpoint_id` (`.metadata`, or one per rank) read as
    `PlainReader` reads it, before DCP does: DCP logs a reader's error with its traceback and raises it as an
    AssertionError, so a refusal raised here is the one the caller sees. Returns the keys the checkpoint holds."""
    keys: set[str] = set()
    for path in sorted(pathlib.Path(checkpoint_id).glob("*.metadata")):
        with open(path, "rb") as stream:
            keys |= set(read_metadata(stream, f"checkpoint file {path}").state_dict_metadata)
    return keys


def load_plain(stream: IO[bytes], what: str) -> Any:
    """torch.load(weights_only=True): tensors and plain data; any other object is refused, its code never run."""
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed global by default|\.?\n|$)", str(err))
        raise CheckpointError(
            f"{what} holds objects other than tensors and plain data ({found.group(1) if found else err}): the loader "
            f"never unpickles them, as that could run any code. This checkpoint was not written by save_checkpoint, "
            f"or was altered: do not load it"
        ) from None


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a value other than a tensor is read with `load_plain`: DCP's own reads it
    with torch.load(weights_only=False), which runs whatever code a crafted checkpoint holds."""

    def load_bytes(self, read_item: dcp_planner.ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        *parents, last = self.mappings[fqn]  # where the flattened key sits in the caller's nested state
        target: Any = self.original_state_dict  # nested dicts and lists, by str and int keys
        for key in parents:
            target = target[key]
        target[last] = load_plain(value, f"entry {fqn!r}")
