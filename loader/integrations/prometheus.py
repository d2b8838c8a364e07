"""Prometheus: a ResumableDataLoader's metrics as gauges and counters of prometheus_client, labelled with the rank
and the launch (`pip install loader[prometheus]`).

    board = PrometheusMetrics(rank=rank)                   # the default registry; launch: the ledger's, if any
    prometheus_client.start_http_server(9100 + local_rank)
    ...
        if dl.update_complete:
            opt.step(); step += 1
            board.write(dl.metrics(), step)

Gauges hold the last step's values and its number (`loader_last_step`): a step that a restart replays is written
again under the same number and the scrape sees the last launch's values (a gauge keeps the last value set).
Counters (`loader_*_total`) count this launch's own work and are labelled with it: they start at zero in each
launch and never carry another's counts, so nothing is summed twice into one series; a sum over launches counts
the work done, replays included (those batches were loaded twice). Progress committed is the checkpoint's, not a
counter's. The source's counters (`loader_source_*`, e.g. the node cache's downloads) are cumulative values read
from disk: gauges.

A write that fails never stops training: a MetricsWarning says so once, the gauges and counters may hold an earlier
step's values, and the next write sets the gauges again and adds to the counters all the work since.
"""

from __future__ import annotations

import re

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
except ImportError as err:  # pragma: no cover - the extra is optional
    raise ImportError(
        "loader.integrations.prometheus needs prometheus_client: pip install 'loader[prometheus]'"
    ) from err

from loader.metrics import STEP_KEYS, TOTAL_KEYS, Retrying

LABELS = ("rank", "launch")


def _name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class PrometheusMetrics:
    """Exports `dl.metrics()` to a prometheus_client registry (default: the global one, which
    `start_http_server` serves). `launch`: the label of this launch (default: the ledger's generation, from the
    metrics; none: an empty label)."""

    def __init__(
        self,
        *,
        rank: int = 0,
        launch: int | None = None,
        registry: CollectorRegistry = REGISTRY,
        namespace: str = "loader",
    ):
        self.rank, self.launch, self.registry, self.namespace = rank, launch, registry, namespace
        self._gauges: dict[str, Gauge] = {}
        self._counters = {
            key: Counter(
                f"{namespace}_{key}",
                f"{key.replace('_', ' ')} of this launch (this process's work)",
                LABELS,
                registry=registry,
            )
            for key in TOTAL_KEYS
        }
        self._counted = dict.fromkeys(TOTAL_KEYS, 0)  # what the counters hold already
        self._retrying = Retrying()

    def _gauge(self, name: str, text: str) -> Gauge:
        if name not in self._gauges:
            self._gauges[name] = Gauge(f"{self.namespace}_{name}", text, LABELS, registry=self.registry)
        return self._gauges[name]

    def write(self, metrics: dict, step: int | None = None) -> None:
        """Set the gauges to the last step's values (`step`: its number, default the ledger's) and add this launch's
        new work to the counters."""
        step = metrics.get("step") if step is None else step
        self._retrying.call(
            f"PrometheusMetrics.write at step {step}",
            lambda: self._write(metrics, step),
            None,
            "gauges and counters may hold an earlier step's values until a write succeeds",
        )

    def _write(self, metrics: dict, step: int | None) -> None:
        launch = self.launch if self.launch is not None else metrics.get("launch")
        labels = {"rank": str(self.rank), "launch": "" if launch is None else str(launch)}
        if step is not None:
            self._gauge("last_step", "the optimizer step the last_step_* gauges belong to").labels(**labels).set(step)
        for key in STEP_KEYS:
            if metrics.get(key) is not None:
                self._gauge(f"last_step_{key}", f"{key.replace('_', ' ')} in the last step").labels(**labels).set(
                    metrics[key]
                )
        if metrics.get("resume_seconds") is not None:
            self._gauge("resume_seconds", "load_state_dict() to the first batch after it").labels(**labels).set(
                metrics["resume_seconds"]
            )
        for key, value in metrics.items():
            if key.startswith("source/") and isinstance(value, (int, float)):
                name = _name(key.replace("/", "_"))
                self._gauge(name, f"the source's counter {key[7:]} (cumulative)").labels(**labels).set(value)
        for key, counter in self._counters.items():
            total = metrics.get(f"total/{key}")
            if total is not None and total > self._counted[key]:
                counter.labels(**labels).inc(total - self._counted[key])
                self._counted[key] = total
