"""The command line (`python -m loader`): the demo, the audit and the shard indexer."""
