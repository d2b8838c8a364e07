"""Map-style data sources the loader can shuffle, partition and resume."""

from loader.sources.cache import CacheFullError
from loader.sources.mixture import Mixture, MixturePlan
from loader.sources.tokens import TokenFileError, TokenSource
from loader.sources.webdataset import (
    MissingKeyError,
    ShardFormatError,
    ShardUnavailableError,
    StaleIndexError,
    WebDatasetSource,
    prepare_indexes,
)

__all__ = [
    "CacheFullError", "MissingKeyError", "Mixture", "MixturePlan", "ShardFormatError", "ShardUnavailableError",
    "StaleIndexError", "TokenFileError", "TokenSource", "WebDatasetSource", "prepare_indexes",
]
