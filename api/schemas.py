"""Response schemas at the edge (the request body is hpservice.spec.JobSpec)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, create_model

from hpservice.jobs import JobRecord


def _job_out() -> type[BaseModel]:
    """``JobOut``: the fields of ``hpservice.jobs.JobRecord`` (one declaration of a job), every one
    present in each answer (``placement`` is empty until the workers start), and the link to the
    Ray dashboard the routes add."""
    fields: dict[str, Any] = {
        name: (kind, [] if name == "placement" else ...) for name, kind in JobRecord.field_types().items()
    }
    return create_model("JobOut", **fields, ray_dashboard_url=(str | None, None))


JobOut = _job_out()


class JobList(BaseModel):
    items: list[JobOut]
    next_cursor: str | None


class MetricsPage(BaseModel):
    records: list[dict[str, Any]]
    next_since_step: int


class LogLine(BaseModel):
    seq: int  # the job's event sequence number (the SSE id): ?since= resumes after it
    rank: int
    step: int
    time: float
    line: str


class LogList(BaseModel):
    lines: list[LogLine]
    next_since: int  # pass as ?since= to get only the lines after these


class CheckpointList(BaseModel):
    checkpoints: list[dict[str, Any]]


class Artifact(BaseModel):
    """A file a run wrote for download (profiler trace, memory snapshot)."""

    name: str
    size: int
    rank: int | None
    url: str


class ArtifactList(BaseModel):
    artifacts: list[Artifact]


class ExportOut(BaseModel):
    """A job checkpoint exported in Hugging Face format, on the server's storage."""

    step: int
    format: str
    path: str
    files: list[str]
    tensors: int


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: list[Any] = []


class ErrorOut(BaseModel):
    error: ErrorDetail


ERRORS = {status: {"model": ErrorOut} for status in (400, 401, 404, 409, 413, 415, 422)}
