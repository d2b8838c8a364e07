"""Map-style data sources the loader can shuffle, partition and resume."""

from loader.sources.cache import CacheFullError
from loader.sources.webdataset import (
    MissingKeyError,
    ShardFormatError,
    ShardUnavailableError,
    StaleIndexError,
    WebDatasetSource,
    prepare_indexes,
)

__all__ = [
    "CacheFullError", "MissingKeyError", "ShardFormatError", "ShardUnavailableError", "StaleIndexError",
    "WebDatasetSource", "prepare_indexes",
]
