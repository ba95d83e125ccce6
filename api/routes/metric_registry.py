"""/v1/metric-registry: the metrics a training step reports (``hpservice.metrics``), so clients
such as the web page name, describe and format them from the server instead of writing them again."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from hpservice.metrics import METRICS

router = APIRouter(prefix="/v1", tags=["jobs"])


class MetricOut(BaseModel):
    name: str
    unit: str
    description: str
    when: str
    kind: str
    sinks: list[str]


class MetricRegistry(BaseModel):
    metrics: list[MetricOut]


@router.get("/metric-registry", response_model=MetricRegistry)
def metric_registry() -> dict:
    """Every metric a step record may hold, in the registry's order, and where each goes."""
    return {
        "metrics": [
            {"name": m.name, "unit": m.unit, "description": m.description, "when": m.when, "kind": m.kind, "sinks": sorted(m.sinks)}
            for m in METRICS
        ]
    }
