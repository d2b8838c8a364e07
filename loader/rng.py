"""A worker's random state (torch, numpy, random) as one JSON-able string, and torch's own worker seeding.

A stream that draws random numbers in its workers resumes bit-identically only if each worker gets back the exact
state it had after the batches that were delivered: the three generators a dataset may use are captured together.
"""

from __future__ import annotations

import base64
import ctypes
import random
import sys
from typing import Callable

import numpy as np
import torch
from torch.utils.data._utils.worker import _generate_state

_INTS, _FLOATS, _NP_WORDS, _PY_WORDS = 3, 2, 624, 625  # the fixed-size parts; torch's state is the rest
_HEADER = 16  # CPython's object header on 64-bit platforms (reference count, type)


UNCHANGED = ""  # what RngWatch.state() gives while nothing was drawn: no valid state is empty


class RngWatch:
    """A worker's random states after each batch, captured and encoded again only when something was drawn since
    the last time (UNCHANGED otherwise): a stream that draws nothing then pays about 2 us per batch, not 20, and
    sends a few bytes instead of 13 KB. The check reads the generators' words where they are (get_state() and
    getstate() copy them into Python objects, 10x slower)."""

    def __init__(self):
        self._numpy_address = np.random.mtrand._rand._bit_generator.ctypes.state_address
        self._python_words = _python_words_reader()
        self._raw: tuple | None = None
        self._np_gauss = False  # numpy's cached gaussian may be used up without its words changing

    def state(self) -> str:
        raw = (torch.get_rng_state().numpy().tobytes(), ctypes.string_at(self._numpy_address, 4 * _NP_WORDS + 4),
               self._python_words())
        if raw == self._raw and not self._np_gauss:
            return UNCHANGED
        self._raw, self._np_gauss = raw, bool(np.random.get_state(legacy=True)[3])
        return rng_state()


def _python_words_reader() -> Callable[[], object]:
    """What tells whether Python's random state changed: on CPython its words and position sit in the generator
    object after the object header; they are read there if they match getstate() (checked here, once), else
    getstate() it is."""
    generator, size = random._inst, 4 * _PY_WORDS
    if sys.implementation.name != "cpython" or type(generator).__basicsize__ < _HEADER + size:
        return random.getstate
    at = id(generator) + _HEADER  # CPython: id is the address, and the object never moves
    words = np.frombuffer(ctypes.string_at(at, size), dtype=np.uint32)
    _, state, _ = random.getstate()
    if words[1:].tolist() != list(state[:-1]) or int(words[0]) != state[-1]:
        return random.getstate
    return lambda: (ctypes.string_at(at, size), generator.gauss_next)


def rng_state() -> str:
    """The process's torch, numpy and random states, packed (10 KB) and base64-encoded."""
    _, np_words, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    _, py_words, py_gauss = random.getstate()
    packed = b"".join((
        np.array([np_pos, np_has_gauss, py_gauss is not None], dtype=np.int64).tobytes(),
        np.array([np_gauss, py_gauss or 0.0], dtype=np.float64).tobytes(),
        np.asarray(np_words, dtype=np.uint32).tobytes(),
        np.array(py_words, dtype=np.uint32).tobytes(),
        torch.get_rng_state().numpy().tobytes(),
    ))
    return base64.b64encode(packed).decode("ascii")


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
