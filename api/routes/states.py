"""/v1/job-states: the job vocabulary (``hpservice.jobs``), so clients such as the web page
take the states from the server instead of writing them again."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from hpservice.jobs import ACTIVE_STATES, TERMINAL_STATES, JobState

router = APIRouter(prefix="/v1", tags=["jobs"])


class JobStates(BaseModel):
    states: list[str]
    terminal: list[str]
    active: list[str]


@router.get("/job-states", response_model=JobStates)
def job_states() -> dict:
    """Every state a job can be in, in lifecycle order; which ones end a job; which ones are live."""
    return {
        "states": list(JobState),
        "terminal": [s for s in JobState if s in TERMINAL_STATES],
        "active": list(ACTIVE_STATES),
    }
