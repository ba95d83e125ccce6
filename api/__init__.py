"""FastAPI control plane: REST jobs API, SSE events, store, and the bridge to Ray.

``create_app(settings)`` builds the app; ``hpservice serve`` runs it with uvicorn.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from hpservice.actors import connect
from hpservice.spec import JobSpec

from . import errors
from .limits import Exports, StreamSlots
from .routes import health, jobs, metric_registry, states
from .settings import Settings
from .store import Store
from .supervisor import Supervisor
from .validation import ValidationPool

STATIC = Path(__file__).parent / "static"

__all__ = ["Settings", "create_app"]


def _keeping_signal_handlers(fn, *args):
    """``fn(*args)`` with this process's SIGTERM / SIGINT handlers as they were before it.

    ``ray.init`` installs its own: a SIGTERM handler that raises ``SystemExit`` from wherever the
    event loop is, and its core worker's failure handler that dumps a stack. Under uvicorn the
    server's own handlers must stay, so SIGTERM (what every Kubernetes rollout sends) drains
    requests and runs this app's shutdown instead of printing a crash."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return fn(*args)
    finally:
        for sig, handler in before.items():
            if handler is not None:
                signal.signal(sig, handler)


def create_app(settings: Settings | None = None, *, connect_ray: bool = True, supervise: bool = True) -> FastAPI:
    """The app. ``connect_ray=False, supervise=False`` gives the REST layer alone (tests)."""
    settings = settings or Settings()
    store = Store(settings.db_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if connect_ray:
            url = _keeping_signal_handlers(connect, settings.ray_address)
            if url and settings.dashboard_url is None:
                settings.dashboard_url = url
        if supervise:
            supervisor.start()
        yield
        supervisor.stop()
        validation.shutdown()
        app.state.exports.shutdown()
        store.close()

    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="hpservice", version="0.1.0", lifespan=lifespan, **docs)
    supervisor = Supervisor(
        store,
        settings.poll_interval_s,
        quotas=settings.quotas,
        backfill_bound_s=settings.backfill_bound_s,
        lease_ttl_s=settings.lease_ttl_s,
        max_log_lines_per_job=settings.bounds.max_log_lines_per_job,
    )
    app.state.settings, app.state.store, app.state.supervisor = settings, store, supervisor
    app.state.registry = health.make_registry(store)
    app.state.stream_slots = StreamSlots(settings.max_streams_per_owner)
    b = settings.bounds
    validation = ValidationPool(per_owner=b.validations_per_owner, timeout_s=b.validation_timeout_s)
    app.state.validation = validation
    app.state.exports = Exports(b.exports_per_owner)
    errors.install(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(states.router)
    app.include_router(metric_registry.router)

    if (STATIC / "index.html").is_file():
        app.mount("/static", StaticFiles(directory=STATIC), name="static")

        @app.get("/", include_in_schema=False)
        def index():
            return FileResponse(STATIC / "index.html")

    original = app.openapi

    def openapi():
        schema = original()
        # The submit route reads its body itself (JSON or YAML): publish the JobSpec schema for it.
        defs = JobSpec.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.pop("$defs", {}))
        components["JobSpec"] = defs
        return schema

    app.openapi = openapi
    return app
