"""Argument checks shared by the modules, so every one reports a bad value the same way."""


def is_int(value) -> bool:
    """A real int: bools are ints to Python but never a count, a rank or a size."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_rank(rank, world_size: int) -> None:
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
