"""A job's Prometheus gauges (through Ray's metrics agent): one per metric the registry
(``hpservice.metrics``) sends to Prometheus, ``hpservice_<name>``, tagged by job and rank; a table
such as ``expert_load`` also by ``layer`` and ``expert``. Plus the job's last step and restarts."""

from __future__ import annotations

from collections.abc import Callable

from hpservice.metrics import METRICS, scalars

__all__ = ["JobGauges"]


def _ray_gauge(name: str, description: str, tag_keys: tuple[str, ...]):
    from ray.util.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)


class JobGauges:
    """``make(name, description, tag_keys)`` builds a gauge with ``set(value, tags=...)``: Ray's
    ``Gauge`` in the coordinator, a recording fake in tests."""

    def __init__(self, job_id: str, make: Callable = _ray_gauge):
        self.job_id = job_id
        self._gauges = {
            m.name: make(
                f"hpservice_{m.name}",
                f"{m.description} ({m.unit})" if m.unit else m.description,
                ("job", "rank", "layer", "expert") if m.kind == "table" else ("job", "rank"),
            )
            for m in METRICS
            if "prometheus" in m.sinks
        }
        self._step = make("hpservice_step", "last completed step", ("job", "rank"))
        self._restarts = make("hpservice_restarts", "restarts of the worker group", ("job", "rank"))

    def record(self, record: dict) -> None:
        """Rank 0's step record."""
        tags = {"job": self.job_id, "rank": "0"}
        self._step.set(float(record["step"]), tags=tags)
        for name, value in scalars(record, "prometheus"):
            metric, _, cell = name.partition("/")  # a table's cell: expert_load/<layer>/<expert>
            layer, _, expert = cell.partition("/")
            self._gauges[metric].set(value, tags={**tags, "layer": layer, "expert": expert} if cell else tags)

    def restarts(self, count: int) -> None:
        self._restarts.set(float(count), tags={"job": self.job_id, "rank": "0"})
