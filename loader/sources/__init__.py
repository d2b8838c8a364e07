"""Data sources the loader can shuffle, partition and resume at any world size: tar shards as a map-style dataset,
and sharded streams (files, webdataset pipelines, Hugging Face streaming datasets)."""

from loader.sources.budget import TokenBudgetBatches
from loader.sources.cache import CacheFullError, DiskFullError
from loader.sources.mixture import Mixture, MixturePlan
from loader.sources.packing import ArrowDocuments, PackedSource
from loader.sources.sharded import FileShards, HuggingFaceShards, WebDatasetShards
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
    "ArrowDocuments",
    "CacheFullError",
    "DiskFullError",
    "FileShards",
    "HuggingFaceShards",
    "MissingKeyError",
    "Mixture",
    "MixturePlan",
    "PackedSource",
    "ShardFormatError",
    "ShardUnavailableError",
    "StaleIndexError",
    "TokenBudgetBatches",
    "TokenFileError",
    "TokenSource",
    "WebDatasetShards",
    "WebDatasetSource",
    "prepare_indexes",
]
