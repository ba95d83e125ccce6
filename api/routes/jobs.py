"""/v1/jobs: submit, list, inspect, cancel, delete; metrics, events (SSE), logs, checkpoints, artifacts."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import json
import math
import os
import re
import stat
import weakref
from pathlib import Path

import yaml
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from hpservice.jobs import TERMINAL_STATES, JobRecord, JobState
from hpservice.preflight import check_layout, raise_if
from hpservice.spec import (
    INT64,
    NAME_PATTERN,
    RUN_ID_PATTERN,
    JobSpec,
    SpecError,
    new_run_id,
    parse_job,
    yaml_error,
    yaml_load,
)

from ..admission import admit, check_admitted, job_dir
from ..auth import current_principal
from ..deps import get_settings, get_store, get_supervisor, visible_job
from ..errors import APIError
from ..limits import Exports, StreamSlots, read_body_within
from ..schemas import ERRORS, ArtifactList, CheckpointList, ExportOut, JobList, JobOut, LogList, MetricsPage
from ..settings import Principal, Settings
from ..store import Store
from ..supervisor import Supervisor

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERRORS)

MAX_BODY = 1 << 20
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
            "application/yaml": {"schema": {"type": "string"}},
        },
    }
}


def _out(settings: Settings, job: JobRecord) -> dict:
    """The wire form of a job record (``JobOut``): its fields and the dashboard's address."""
    base = settings.dashboard_url
    return {**job.to_dict(), "ray_dashboard_url": f"{base}/#/actors" if base else None}


async def _read_body(request: Request) -> bytes:
    """The body, read as it arrives and refused as soon as it passes ``MAX_BODY`` (413), or when it
    has not all come within ``BODY_TIMEOUT_S`` (408)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise APIError(413, f"job spec larger than {MAX_BODY} bytes")
    return await read_body_within(request.stream(), MAX_BODY)


def _decode(raw: bytes, ctype: str):
    """Text -> plain data (JSON or YAML, with the spec's limits); runs off the event loop."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(422, "body is not UTF-8 text") from None
    try:
        if ctype in YAML_TYPES:
            try:
                return yaml_load(text)
            except yaml.YAMLError as e:
                raise APIError(422, yaml_error(e)) from None
        if ctype in ("application/json", ""):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise APIError(422, f"JSON syntax error at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise APIError(422, "job spec nested too deeply") from None
    raise APIError(415, f"unsupported content type {ctype!r}; use application/json or application/yaml")


def _spec_error(e: SpecError) -> APIError:
    details = [{"path": path, "message": msg} for path, msg in e.errors]
    return APIError(422, str(e).splitlines()[0], details)


def _validate(data) -> JobSpec:
    """The spec, parsed, with the layout checks that read no file (before admission has said
    which files its tenant may read)."""
    try:
        spec = parse_job(data, source="job spec")
        raise_if(check_layout(spec, read_files=False), "job spec")
        return spec
    except SpecError as e:
        raise _spec_error(e) from None


def _admit(spec, principal, job_id, settings, node_memory, devices) -> JobSpec:
    """Admission (who may read and write what, the operator's bounds), then the checks that read
    the admitted files and the memory plan (``admission.check_admitted``): the spec the job runs with."""
    try:
        spec = admit(spec, principal, job_id, settings)
        return check_admitted(spec, settings, node_memory, devices)
    except SpecError as e:
        raise _spec_error(e) from None


def _request_hash(data) -> str:
    """What a retry with the same Idempotency-Key must send again (the spec as submitted)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@router.post("", status_code=201, response_model=JobOut, openapi_extra=SPEC_BODY, responses={200: {"model": JobOut}})
async def submit(
    request: Request,
    principal: Principal = Depends(current_principal),
    settings: Settings = Depends(get_settings),
    store: Store = Depends(get_store),
    supervisor: Supervisor = Depends(get_supervisor),
    idempotency_key: str | None = Header(None, max_length=200),
):
    raw = await _read_body(request)
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    data = await asyncio.to_thread(_decode, raw, ctype)
    spec = await request.app.state.validation.run(principal.owner, _validate, data)
    job, created = await _create(
        request, spec, principal, settings, store, supervisor, idempotency_key, _request_hash(data)
    )
    return JSONResponse(_out(settings, job), status_code=201 if created else 200)


async def _create(request, spec, principal, settings, store, supervisor, idempotency_key=None, request_hash=None):
    """Admit a validated spec as a new job of ``principal`` and store it: (job, created)."""
    job_id = new_run_id(spec.name)
    submitted = spec.model_dump(mode="json", by_alias=True)
    node_memory = await asyncio.to_thread(supervisor.node_memory)
    devices = await asyncio.to_thread(supervisor.devices)
    # it reads files and estimates memory: on the validation pool, within its deadline and the owner's slots
    spec = await request.app.state.validation.run(
        principal.owner, _admit, spec, principal, job_id, settings, node_memory, devices
    )
    why = await asyncio.to_thread(supervisor.infeasible, spec)
    if why is not None:  # it would fail at launch: say so now, and how to make it fit
        raise APIError(422, "job spec: cannot fit the cluster", [{"path": "resources", "message": why}])
    job, created = await asyncio.to_thread(
        store.create_job,
        job_id,
        spec.name,
        principal.owner,
        spec.model_dump(mode="json", by_alias=True),
        spec.training.steps,
        idempotency_key,
        request_hash,
        submitted,
    )
    if job is None:
        raise APIError(
            409, f"Idempotency-Key {idempotency_key!r} was used before with a different job spec; use a new key"
        )
    return job, created


@router.post("/{job_id}/resubmit", status_code=201, response_model=JobOut)
async def resubmit(
    request: Request,
    job: JobRecord = Depends(visible_job),
    principal: Principal = Depends(current_principal),
    settings: Settings = Depends(get_settings),
    store: Store = Depends(get_store),
    supervisor: Supervisor = Depends(get_supervisor),
):
    """A new job from this job's spec as it was submitted (validated and admitted again, for the
    caller: the new job writes into its own directory)."""
    submitted = await asyncio.to_thread(store.submitted_spec, job.id)
    if submitted is None:
        raise APIError(409, f"job {job.id} was stored before submitted specs were kept; submit its file again")
    spec = await request.app.state.validation.run(principal.owner, _validate, submitted)
    new, _ = await _create(request, spec, principal, settings, store, supervisor)
    return JSONResponse(_out(settings, new), status_code=201)


def _cursor(cursor: str | None) -> tuple[float, str] | None:
    if cursor is None:
        return None
    try:
        created, job_id = json.loads(base64.urlsafe_b64decode(cursor.encode()).decode())
        created = float(created)
    except Exception:
        raise APIError(400, "invalid cursor") from None
    # what the store will compare with: a time and a job id (a NUL byte would reach PostgreSQL)
    if not math.isfinite(created) or not isinstance(job_id, str) or not re.fullmatch(RUN_ID_PATTERN, job_id):
        raise APIError(400, "invalid cursor")
    return created, job_id


@router.get("", response_model=JobList)
def list_jobs(
    principal: Principal = Depends(current_principal),
    settings: Settings = Depends(get_settings),
    store: Store = Depends(get_store),
    state: JobState | None = Query(None, description="only jobs in this state"),
    name: str | None = Query(None, pattern=NAME_PATTERN, description="only jobs of this name"),
    owner: str | None = Query(None, pattern=NAME_PATTERN, description="only this owner's jobs (admins)"),
    limit: int = Query(50, ge=1, le=500),
    cursor: str | None = Query(None, max_length=400),
):
    if not principal.admin:
        if owner is not None and owner != principal.owner:
            return {"items": [], "next_cursor": None}
        owner = principal.owner
    items = store.list_jobs(owner=owner, state=state, name=name, limit=limit, cursor=_cursor(cursor))
    next_cursor = None
    if len(items) == limit:
        last = items[-1]
        next_cursor = base64.urlsafe_b64encode(json.dumps([last.created_at, last.id]).encode()).decode()
    return {"items": [_out(settings, j) for j in items], "next_cursor": next_cursor}


@router.get("/{job_id}", response_model=JobOut)
def get_job(job: JobRecord = Depends(visible_job), settings: Settings = Depends(get_settings)):
    return _out(settings, job)


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut)
def cancel(
    job: JobRecord = Depends(visible_job),
    settings: Settings = Depends(get_settings),
    store: Store = Depends(get_store),
    supervisor: Supervisor = Depends(get_supervisor),
):
    supervisor.cancel(job)
    return _out(settings, store.get_job(job.id))


@router.delete("/{job_id}", status_code=204)
def delete(job: JobRecord = Depends(visible_job), store: Store = Depends(get_store)):
    if job.state not in TERMINAL_STATES:
        raise APIError(409, f"job {job.id} is {job.state}; cancel it and wait for it to end first")
    store.delete_job(job.id)
    return Response(status_code=204)


@router.get("/{job_id}/metrics", response_model=MetricsPage)
def metrics(
    job: JobRecord = Depends(visible_job),
    store: Store = Depends(get_store),
    since_step: int = Query(0, ge=0, le=INT64[1]),
):
    records = store.metrics(job.id, since_step)
    return {"records": records, "next_since_step": records[-1]["step"] if records else since_step}


@router.get("/{job_id}/logs", response_model=LogList)
def logs(
    job: JobRecord = Depends(visible_job),
    store: Store = Depends(get_store),
    rank: int | None = Query(None, ge=0, le=1 << 20),
    tail: int | None = Query(None, ge=1, le=100_000),
    since: int = Query(0, ge=0, le=INT64[1], description="only lines after this event sequence number (next_since)"),
    limit: int | None = Query(None, ge=1, le=100_000, description="at most this many lines, the first after since: a page"),
):
    if tail is not None and limit is not None:
        raise APIError(422, "tail and limit exclude each other: tail is the last lines, limit a page from since")
    lines, cursor = store.logs(job.id, rank, tail, since, limit)
    return {"lines": lines, "next_since": cursor}


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
def checkpoints(job: JobRecord = Depends(visible_job)):
    return {"checkpoints": job.checkpoints}


ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")  # flat names only: no path can be built


def _artifacts_dir(job: dict) -> Path:
    """The run's artifacts folder, from the stored (admitted) spec: inside the job's own directory."""
    return Path(parse_job(job.spec).artifacts_dir(job.id))


def _list_artifacts(folder: Path) -> list[tuple[str, int]]:
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:  # regular files only, never through a link
        if ARTIFACT_NAME.match(e.name) and e.is_file(follow_symlinks=False):
            out.append((e.name, e.stat(follow_symlinks=False).st_size))
    return sorted(out)


@router.get("/{job_id}/artifacts", response_model=ArtifactList)
async def artifacts(job: JobRecord = Depends(visible_job)):
    """Files the run wrote for download: profiler traces (``*.trace.json``, Chrome/Perfetto) and
    CUDA memory snapshots (``*.memory.pickle``) from ``metrics.profile``, one per rank."""
    job_id = job.id
    found = await asyncio.to_thread(_list_artifacts, _artifacts_dir(job))
    rank = re.compile(r"^rank(\d+)-")
    return {
        "artifacts": [
            {
                "name": name,
                "size": size,
                "rank": int(m[1]) if (m := rank.match(name)) else None,
                "url": f"/v1/jobs/{job_id}/artifacts/{name}",
            }
            for name, size in found
        ]
    }


@router.get("/{job_id}/artifacts/{name}", response_class=FileResponse, responses={200: {"content": {"application/octet-stream": {}}}})
async def artifact(name: str, job: JobRecord = Depends(visible_job)):
    job_id = job.id
    if not ARTIFACT_NAME.match(name):
        raise APIError(404, f"job {job_id} has no artifact {name!r}")
    path = _artifacts_dir(job) / name
    try:
        st = await asyncio.to_thread(os.lstat, path)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):  # missing, a folder, or a link: not served
        raise APIError(404, f"job {job_id} has no artifact {name!r}")
    media = "application/json" if name.endswith(".json") else "application/octet-stream"
    return FileResponse(path, media_type=media, filename=name, stat_result=st)


@router.post("/{job_id}/checkpoints/{step}/export", response_model=ExportOut)
async def export_checkpoint(
    request: Request,
    step: int,
    job: JobRecord = Depends(visible_job),
    settings: Settings = Depends(get_settings),
    format: str = Query(
        "hf",
        pattern="^(hf|peft)$",
        description="hf: config.json + sharded safetensors + index (a LoRA run's adapters merged in); peft: a LoRA "
        "run's adapter (adapter_config.json + adapter_model.safetensors)",
    ),
):
    """Export one of the job's committed checkpoints in Hugging Face format (``transformers``'
    ``from_pretrained`` loads it) or, for a LoRA run, as a PEFT adapter (``peft``'s
    ``PeftModel.from_pretrained`` loads it onto the base), into ``<job dir>/exports/step-N-<format>``
    (replaced if it exists). Runs in an export worker process (``Exports``), waited on off the event loop."""
    from concurrent.futures.process import BrokenProcessPool

    from hpservice.checkpoint import CheckpointError, step_dir_name
    from hpservice.models.hf import HFFormatError, export_checkpoint_hf, export_checkpoint_peft

    job_id = job.id
    found = [c for c in job.checkpoints if c.get("step") == step]
    if not found:
        steps = [c.get("step") for c in job.checkpoints]
        raise APIError(404, f"job {job_id} has no committed checkpoint of step {step} (it has {steps})")
    home = job_dir(settings, job.owner, job_id)
    out = home / "exports" / f"{step_dir_name(step)}-{format}"
    export = export_checkpoint_peft if format == "peft" else export_checkpoint_hf
    exports: Exports = request.app.state.exports

    def run() -> dict:
        try:
            return exports.in_worker_process(export, found[-1]["path"], out)
        except BrokenProcessPool:
            raise APIError(500, f"export of step {step} failed: its worker process died (out of memory?)") from None
        except (HFFormatError, CheckpointError, ValueError) as e:
            raise APIError(422, f"checkpoint of step {step} cannot be exported: {e}") from None
        except OSError as e:  # the storage under the job: full, gone, not writable
            raise APIError(507 if e.errno == errno.ENOSPC else 500, f"export of step {step} failed writing {out}: {e}") from None
        except Exception as e:  # whatever else: a message, never an uncaught 500
            raise APIError(500, f"export of step {step} failed: {type(e).__name__}: {e}") from None

    done = await exports.run(job.owner, str(out), run)
    return {"step": step, "format": format, "path": str(out), "files": done["files"], "tensors": done["tensors"]}


@router.get(
    "/{job_id}/events", response_class=StreamingResponse, responses={200: {"content": {"text/event-stream": {}}}}
)
async def events(
    request: Request,
    job: JobRecord = Depends(visible_job),  # read in the thread pool, as every dependency here
    store: Store = Depends(get_store),
    last_event_id: str | None = Header(None, max_length=20),
    token: str | None = Query(None, max_length=400, description="bearer token, for EventSource clients"),
    principal: Principal = Depends(current_principal),
):
    job_id = job.id
    try:
        after = int(last_event_id) if last_event_id else 0
    except ValueError:
        raise APIError(400, "Last-Event-ID must be an integer") from None
    if not 0 <= after <= INT64[1]:
        raise APIError(400, "Last-Event-ID must be an integer from 0 to 2^63 - 1")

    slots: StreamSlots = request.app.state.stream_slots
    give_back = slots.take(principal.owner)  # 429 past the owner's open streams

    async def stream():
        try:
            async for event in follow():
                yield event
        finally:
            give_back()

    async def follow():
        nonlocal after
        idle = 0.0
        while True:
            batch = await asyncio.to_thread(store.events, job_id, after)
            for seq, kind, data in batch:
                after = seq
                yield f"id: {seq}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"
                if kind == "state" and data["state"] in TERMINAL_STATES:
                    return
            if batch:
                idle = 0.0
                continue
            if await request.is_disconnected():
                return
            job = await asyncio.to_thread(store.get_job, job_id)
            if job is None:
                return  # deleted
            if job.state in TERMINAL_STATES:
                # It may have ended between the read of events and this one: deliver what came
                # meanwhile (its terminal state event among it), else the stream is over.
                if await asyncio.to_thread(store.events, job_id, after, 1):
                    continue
                return
            await asyncio.sleep(0.25)
            idle += 0.25
            if idle >= 15:
                idle = 0.0
                yield ": keep-alive\n\n"

    events = stream()
    weakref.finalize(events, give_back)  # also when the response never starts it (a client gone at once)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
