"""Glue for the frameworks people train with, each behind an optional extra: `loader.integrations.lightning`
(`pip install loader[lightning]`), `loader.integrations.torchft` (`[torchft]`: replica groups that leave and join,
see docs/frameworks.md), `loader.integrations.torchtitan` (torchtitan's Trainer: `ResumableTitanLoader.Config`),
and the metrics exporters `loader.integrations.tensorboard` (`[tensorboard]`) and `loader.integrations.prometheus`
(`[prometheus]`, see docs/observability.md). Accelerate and DCP need none (see docs/frameworks.md).

Nothing in `loader` imports this package: the core never depends on a framework.
"""
