"""Streams (IterableDataset): progress as the state of each worker's reader at the last delivered batch.

Batches are made in the worker with their worker's state (`source`); the main process keeps the states of what it
delivered (`progress`); the state format and its merge (`state`); sharded streams dealt by (rank, worker)
(`shards`); a worker's random states (`rng`). Builds on `loader.core` only.
"""
