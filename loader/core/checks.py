"""Argument checks shared by the modules, so every one reports a bad value the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13


def is_int(value: object) -> TypeIs[int]:
    """A real int: bools are ints to Python but never a count, a rank or a size."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_rank(rank: object, world_size: int) -> None:
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


MAX_SAMPLES = 2**62 - 1  # the most samples (positions) an epoch may have, the one limit of the order, the mixture
# and the state: a state holds positions up to num_samples, and refuses larger ints as corruption (int64 headroom)


def check_num_samples(name: str, value: object, least: int = 0) -> None:
    """Refused at construction, so that nothing trains whose state the loader would then refuse."""
    if not is_int(value) or not least <= value <= MAX_SAMPLES:
        raise ValueError(
            f"{name} must be an int in [{least}, {MAX_SAMPLES}] (2**62 - 1, the most samples a progress "
            f"state records), got {value!r}"
        )
