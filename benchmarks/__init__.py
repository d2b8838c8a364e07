"""Benchmarks of `loader` against its baselines: `python -m benchmarks --quick` (see benchmarks/README.md).

Every comparison runs its candidates interleaved in one process and reports the median ratio with its spread:
absolute times depend on the machine, ratios measured side by side much less.
"""
