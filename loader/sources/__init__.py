"""Map-style data sources the loader can shuffle, partition and resume."""

from loader.sources.mixture import Mixture, MixturePlan
from loader.sources.tokens import TokenFileError, TokenSource
from loader.sources.webdataset import (
    MissingKeyError,
    ShardFormatError,
    StaleIndexError,
    WebDatasetSource,
    prepare_indexes,
)

__all__ = [
    "MissingKeyError", "Mixture", "MixturePlan", "ShardFormatError", "StaleIndexError", "TokenFileError",
    "TokenSource", "WebDatasetSource", "prepare_indexes",
]
