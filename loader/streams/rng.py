"""A worker's random state (torch, numpy, random) as one JSON-able string, and torch's own worker seeding.

A stream that draws random numbers in its workers resumes bit-identically only if each worker gets back the exact
state it had after the batches that were delivered: the three generators a dataset may use are captured together.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import random
import struct
import sys
from collections.abc import Callable
from typing import cast

import numpy as np
import torch
from torch.utils.data._utils.worker import _generate_state

_INTS, _FLOATS, _NP_WORDS, _PY_WORDS = 3, 2, 624, 625  # the fixed-size parts; torch's state is the rest
_HEADER = 16  # CPython's object header on 64-bit platforms (reference count, type)


UNCHANGED = ""  # what RngWatch.state() gives while nothing was drawn: no valid state is empty


class RngWatch:
    """A worker's random states after each batch, encoded again only when something was drawn since the last time
    (UNCHANGED otherwise): a stream that draws nothing pays about 2 us per batch and sends a few bytes instead of
    13 KB. The check reads the generators' words where they are, and a state that changed is encoded from what it
    read: 9 us, where get_state() and getstate() (which copy the words into Python objects one by one) took 75."""

    def __init__(self) -> None:
        self._numpy, self._python = _numpy_reader(), _python_reader()
        self._raw: tuple | None = None

    def state(self) -> str:
        raw = (torch.default_generator.get_state().numpy().tobytes(), self._numpy(), self._python())
        if raw == self._raw:
            return UNCHANGED
        self._raw = raw
        return _encode(*raw)


def rng_state() -> str:
    """The process's torch, numpy and random states, packed (10 KB) and base64-encoded."""
    return _encode(torch.get_rng_state().numpy().tobytes(), _numpy_state(), _python_state())


def _encode(torch_state: bytes, numpy: tuple, python: tuple) -> str:
    """numpy's (words, position, has_gauss, gauss) and random's (words, position, gauss), packed with torch's."""
    np_words, np_pos, np_has_gauss, np_gauss = numpy
    py_words, py_pos, py_gauss = python
    packed = b"".join(
        (
            struct.pack(f"={_INTS}q{_FLOATS}d", np_pos, np_has_gauss, py_gauss is not None, np_gauss, py_gauss or 0.0),
            np_words,
            py_words,
            struct.pack("=I", py_pos),
            torch_state,
        )
    )
    return base64.b64encode(packed).decode("ascii")


def _numpy_state() -> tuple:
    """numpy's legacy generator as (words, position, has_gauss, gauss), through its public get_state()."""
    _, words, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return np.asarray(words, dtype=np.uint32).tobytes(), int(pos), int(has_gauss), float(gauss)


def _python_state() -> tuple:
    """random's generator as (words, position, gauss_next), through its public getstate()."""
    _, state, gauss = random.getstate()
    return np.array(state[:-1], dtype=np.uint32).tobytes(), state[-1], gauss


def _numpy_reader() -> Callable[[], tuple]:
    """What `_numpy_state` gives, read in place: the words and position where the bit generator says they are
    (`ctypes.state_address`), the cached gaussian where a probe finds it in the RandomState object; get_state()
    where the probe does not."""
    generator = np.random.mtrand._rand
    address = generator._bit_generator.ctypes.state_address
    words = (ctypes.c_char * (4 * _NP_WORDS)).from_address(address)
    pos = ctypes.c_int.from_address(address + 4 * _NP_WORDS)
    gaussian = _numpy_gaussian(generator)
    if gaussian is None:
        return _numpy_state
    has_gauss, gauss = gaussian

    def read() -> tuple:
        return words.raw, pos.value, has_gauss.value, gauss.value

    return read if read() == _numpy_state() else _numpy_state


@functools.cache
def _numpy_gaussian(generator: np.random.RandomState) -> tuple | None:
    """Where RandomState keeps its cached gaussian (has_gauss, an int 8 bytes before gauss, a double): found by
    setting two known cached values in turn and looking for them in the object (its state is put back exactly);
    None where they are not found, once each, at one place. Once per process (and its forks): the object stays."""
    saved, places = cast(tuple, generator.get_state(legacy=True)), set()  # a tuple (stubs: or a dict)
    try:
        for has_gauss, gauss in ((1, 0.7853981633974483), (0, -2.718281828459045)):
            generator.set_state(saved[:3] + (has_gauss, gauss))
            places.add(_only_place(ctypes.string_at(id(generator), type(generator).__basicsize__), has_gauss, gauss))
    finally:
        generator.set_state(saved)
    place = places.pop() if len(places) == 1 else None
    if place is None:
        return None
    at = id(generator) + place
    return ctypes.c_int.from_address(at - 8), ctypes.c_double.from_address(at)


def _only_place(memory: bytes, has_gauss: int, gauss: float) -> int | None:
    """The one offset of `gauss` in `memory` with `has_gauss` 8 bytes before it, or None."""
    pattern = struct.pack("=d", gauss)
    at = memory.find(pattern)
    if at < 8 or memory.count(pattern) != 1 or struct.unpack_from("=i", memory, at - 8)[0] != has_gauss:
        return None
    return at


def _python_reader() -> Callable[[], tuple]:
    """What `_python_state` gives, read in place on CPython: its position and words sit in the generator object
    after the object header; read there if they match getstate() (checked here, once), else getstate() it is."""
    generator, size = random._inst, 4 * _PY_WORDS
    if sys.implementation.name != "cpython" or type(generator).__basicsize__ < _HEADER + size:
        return _python_state
    at = id(generator) + _HEADER  # CPython: id is the address, and the object never moves
    pos = ctypes.c_int.from_address(at)
    words = (ctypes.c_char * (size - 4)).from_address(at + 4)

    def read() -> tuple:
        # typeshed leaves out gauss_next, which random.Random sets in seed() and setstate()
        return words.raw, pos.value, generator.gauss_next  # type: ignore[attr-defined]

    return read if read() == _python_state() else _python_state


def set_rng_state(text: str) -> None:
    """Undo `rng_state`."""
    packed = base64.b64decode(text)
    cut = np.cumsum([8 * _INTS, 8 * _FLOATS, 4 * _NP_WORDS, 4 * _PY_WORDS])
    np_pos, np_has_gauss, py_has_gauss = np.frombuffer(packed[: cut[0]], dtype=np.int64).tolist()
    np_gauss, py_gauss = np.frombuffer(packed[cut[0] : cut[1]], dtype=np.float64).tolist()
    np_words = np.frombuffer(packed[cut[1] : cut[2]], dtype=np.uint32)
    py_words = tuple(np.frombuffer(packed[cut[2] : cut[3]], dtype=np.uint32).tolist())
    np.random.set_state(("MT19937", np_words, np_pos, np_has_gauss, np_gauss))
    random.setstate((3, py_words, py_gauss if py_has_gauss else None))
    torch.set_rng_state(torch.frombuffer(bytearray(packed[cut[3] :]), dtype=torch.uint8))


def seed_like_torch(base_seed: int, worker: int) -> int:
    """Seed this process as torch seeds worker `worker` of an iterator whose base seed is `base_seed`; returns the
    seed torch reports in WorkerInfo."""
    seed = base_seed + worker
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, worker))
    return seed
