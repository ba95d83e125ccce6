"""What routes depend on, as FastAPI dependencies: the settings, the store, the supervisor and the
job a request names (visible to its caller, else 404). ``create_app`` puts the objects on
``app.state``; only these functions read them there.

Dependencies are plain functions, so FastAPI runs them in its thread pool: the database read of
``visible_job`` never blocks the event loop, also for ``async def`` routes.
"""

from __future__ import annotations

import re

from fastapi import Depends, Request

from hpservice.jobs import JobRecord
from hpservice.spec import RUN_ID_PATTERN

from .auth import current_principal, get_settings, visible
from .errors import APIError
from .settings import Principal
from .store import Store
from .supervisor import Supervisor

__all__ = ["current_principal", "get_settings", "get_store", "get_supervisor", "visible_job"]


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_supervisor(request: Request) -> Supervisor:
    return request.app.state.supervisor


def visible_job(job_id: str, store: Store = Depends(get_store), principal: Principal = Depends(current_principal)) -> JobRecord:
    """The job ``job_id`` names, if its caller may see it (its owner, or an admin); 404 otherwise,
    the same as for a job that does not exist (an id no job can have is not looked up: a NUL
    byte, say, would reach PostgreSQL)."""
    job = store.get_job(job_id) if re.fullmatch(RUN_ID_PATTERN, job_id) else None
    if not visible(principal, job):
        raise APIError(404, f"job {job_id} not found")
    return job
