"""Glue for the frameworks people train with, each behind an optional extra: `loader.integrations.lightning`
(`pip install loader[lightning]`), and the metrics exporters `loader.integrations.tensorboard` (`[tensorboard]`)
and `loader.integrations.prometheus` (`[prometheus]`). Accelerate and DCP need none (see the README).

Nothing in `loader` imports this package: the core never depends on a framework.
"""
