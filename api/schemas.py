"""Response schemas at the edge (the request body is hpservice.spec.JobSpec)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Resize(BaseModel):
    """An elastic resize of the worker group."""

    to: int
    from_: int = Field(alias="from")
    reason: str
    grad_accum: int  # the attempt's gradient accumulation (the global batch stays)


class HistoryEntry(BaseModel):
    state: str
    time: float
    message: str = ""
    resize: Resize | None = None


class RankPlacement(BaseModel):
    """Where one rank of the current attempt runs."""

    rank: int
    node_id: str
    node_ip: str
    node: str  # short id and address, for people
    bundle: int  # its placement-group bundle (one per shard group under placement shard_group)
    pid: int


class JobOut(BaseModel):
    id: str
    name: str
    owner: str
    state: str
    message: str
    step: int
    total_steps: int
    restarts: int
    restart_reasons: list[str]
    created_at: float
    updated_at: float
    history: list[HistoryEntry]
    checkpoints: list[dict[str, Any]]
    placement: list[RankPlacement] = []  # rank -> node; empty until the workers start
    spec: dict[str, Any]
    ray_dashboard_url: str | None = None


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
