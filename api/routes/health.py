"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import ray
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..deps import get_store, get_supervisor
from ..errors import error_body, store_failure
from ..schemas import ErrorOut
from ..store import Store
from ..supervisor import Supervisor

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(supervisor: Supervisor = Depends(get_supervisor)) -> dict:
    """Alive; and whether this replica is the one that launches and follows jobs (``leader``,
    holding the store's supervisor lease) or takes requests only (``standby``)."""
    return {"status": "ok", "supervisor": "leader" if supervisor.is_leader else "standby"}


@router.get("/readyz", responses={503: {"model": ErrorOut}})
def readyz(store: Store = Depends(get_store)):
    try:
        store.ping()
    except Exception as e:  # a broken store makes the service unready, not the request a 500
        return JSONResponse(error_body(503, f"store unavailable: {store_failure(e)}"), status_code=503)
    if not ray.is_initialized():
        return JSONResponse(error_body(503, "not connected to Ray"), status_code=503)
    return {"status": "ready"}


class _JobsCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        g = GaugeMetricFamily("hpservice_jobs", "jobs in the store by state", labels=["state"])
        for state, n in sorted(self.store.count_by_state().items()):
            g.add_metric([state], n)
        yield g


def make_registry(store) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_JobsCollector(store))
    return registry


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
