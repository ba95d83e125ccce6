"""Bearer-token auth as a FastAPI dependency: who is asking, and which jobs they may see."""

from __future__ import annotations

from fastapi import Depends, Request

from hpservice.jobs import JobRecord

from .errors import APIError
from .settings import Principal, Settings

LOCAL = Principal("local", admin=True)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def current_principal(request: Request, settings: Settings = Depends(get_settings)) -> Principal:
    if not settings.auth_enabled:
        return LOCAL
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        # EventSource cannot send headers: the events route also takes ?token=.
        token = request.query_params.get("token", "") if request.url.path.endswith("/events") else ""
    principal = settings.principal_for(token.strip()) if token else None
    if principal is None:
        raise APIError(401, "missing or invalid bearer token")
    return principal


def visible(principal: Principal, job: JobRecord | None) -> bool:
    return job is not None and (principal.admin or job.owner == principal.owner)
