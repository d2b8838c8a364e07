"""Data sources the loader can shuffle, partition and resume at any world size: tar shards as a map-style dataset,
and sharded streams (files, webdataset pipelines, Hugging Face streaming datasets)."""

from loader.sources.sharded import FileShards, HuggingFaceShards, WebDatasetShards
from loader.sources.webdataset import (
    MissingKeyError,
    ShardFormatError,
    StaleIndexError,
    WebDatasetSource,
    prepare_indexes,
)

__all__ = [
    "FileShards",
    "HuggingFaceShards",
    "MissingKeyError",
    "ShardFormatError",
    "StaleIndexError",
    "WebDatasetShards",
    "WebDatasetSource",
    "prepare_indexes",
]
