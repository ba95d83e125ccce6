"""``hpservice serve``: the REST control plane under uvicorn."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def stop_ray(data_dir: str | None) -> int:
    """``hpservice serve --stop-ray``: end the server's local Ray head (and every job on it)."""
    from hpservice.actors.head import stop_head
    from hpservice.api import Settings

    settings = Settings()
    if data_dir:
        settings.data_dir = Path(data_dir).expanduser()
    stopped = stop_head(settings.data_dir)
    print("stopped the local Ray head" if stopped else f"no local Ray head of {settings.data_dir} is running")
    return 0


def serve(
    host: str,
    port: int,
    data_dir: str | None,
    ray_address: str | None,
    tokens_file: str | None,
    *,
    allow_models: list[str] = (),
    data_roots: list[str] = (),
    docs: bool = True,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    quotas_file: str | None = None,
    backfill_bound_s: float = 600.0,
    lease_ttl_s: float | None = None,
    max_workers_per_job: int | None = None,
    min_cpus_per_worker: float | None = None,
    jobs_dir: str | None = None,
    bounds: dict | None = None,
) -> int:
    if not ray_address:
        # Our own Ray head runs with Ray's token auth; Ray reads the mode once, at import.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import uvicorn

    from hpservice.api import Settings, create_app
    from hpservice.api.logs import redact_tokens
    from hpservice.api.settings import bounds_from_options, load_quotas, load_tokens

    try:
        settings = Settings(host=host, port=port, docs=docs)
    except ValueError as e:  # a limit from the environment that is not a number
        print(f"hpservice serve: HPSERVICE_MAX_WORKERS_PER_JOB / HPSERVICE_MIN_CPUS_PER_WORKER: {e}", file=sys.stderr)
        return 2
    settings.model_factories = (*settings.model_factories, *allow_models)
    settings.data_roots = (*settings.data_roots, *(Path(p).expanduser() for p in data_roots))
    if data_dir:
        settings.data_dir = Path(data_dir).expanduser()
    if jobs_dir:
        settings.jobs_dir = Path(jobs_dir).expanduser()
    if ray_address:
        settings.ray_address = ray_address
    settings.backfill_bound_s = backfill_bound_s
    if lease_ttl_s is not None:
        from hpservice.api.settings import MIN_LEASE_TTL_S

        if not MIN_LEASE_TTL_S <= lease_ttl_s < float("inf"):  # inf: a killed leader would never be replaced
            print(f"hpservice serve: --lease-ttl-s must be a number of seconds >= {MIN_LEASE_TTL_S:g}, got {lease_ttl_s:g}", file=sys.stderr)
            return 2
        settings.lease_ttl_s = lease_ttl_s
    try:
        settings.bounds = bounds_from_options(**(bounds or {}))
    except ValueError as e:
        print(f"hpservice serve: {e}", file=sys.stderr)
        return 2
    if max_workers_per_job is not None:
        settings.max_workers_per_job = max_workers_per_job
    if min_cpus_per_worker is not None:
        settings.min_cpus_per_worker = min_cpus_per_worker
    if not (settings.max_workers_per_job >= 1 and 0 < settings.min_cpus_per_worker < float("inf")):  # nan too
        print(
            "hpservice serve: --max-workers-per-job must be >= 1 and --min-cpus-per-worker a number > 0, got "
            f"{settings.max_workers_per_job} and {settings.min_cpus_per_worker:g}",
            file=sys.stderr,
        )
        return 2
    from hpservice.preflight import check_factories_import

    # every factory a job may name imports here too (the workers share this environment, or the
    # image): a typo or a missing package stops the server now, not every job that names it later
    if broken := check_factories_import(settings.model_factories):
        for _, message in broken:
            print(f"hpservice serve: --allow-model / HPSERVICE_MODEL_FACTORIES: {message}", file=sys.stderr)
        return 2
    try:
        settings.tokens = load_tokens(tokens_file)
        settings.quotas = load_quotas(quotas_file or os.environ.get("HPSERVICE_QUOTAS_FILE"))
        settings.check_bind()
    except (ValueError, OSError) as e:
        print(f"hpservice serve: {e}", file=sys.stderr)
        return 2
    if not settings.auth_enabled:
        print(
            f"hpservice serve: no API tokens configured: open API, listening on loopback only ({host})", file=sys.stderr
        )
    if not settings.ray_address:
        # Our own long-lived Ray head, so running jobs outlive a restart of this process.
        from hpservice.actors.head import ensure_head

        try:
            head = ensure_head(settings.data_dir, num_cpus=num_cpus, num_gpus=num_gpus)
        except (RuntimeError, OSError) as e:
            print(f"hpservice serve: cannot start the local Ray head: {e}", file=sys.stderr)
            return 1
        settings.ray_address, settings.dashboard_url = head["address"], head["dashboard_url"]
        print(
            f"hpservice serve: local Ray head {head['address']} (pid {head['pid']}, dashboard {head['dashboard_url']}, which asks "
            "for Ray's token: `ray get-auth-token` prints it); "
            "it keeps running jobs across restarts of the server; `hpservice serve --stop-ray` ends it",
            file=sys.stderr,
        )
    app = create_app(settings)
    redact_tokens()
    from hpservice.api.limits import BoundedH11Protocol

    # h11 with a deadline on each request's head (api/limits.py); uvicorn's keep-alive timeout
    # drops connections idle between requests
    uvicorn.run(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5, http=BoundedH11Protocol,
        timeout_keep_alive=5,
    )  # fmt: skip
    return 0
