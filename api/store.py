"""The job store: SQLAlchemy over an embedded SQLite file by default, any database URL by setting.

Five tables: ``jobs`` (one row per job: spec, state, progress, history), ``metrics`` (one row
per (job, step); a step re-run after a restart replaces its row), ``events`` (the ordered event
log that Server-Sent Events replay, log lines included: a per-job sequence number is the SSE id),
``leases`` (which replica leads the supervisor, and until when) and ``heartbeat`` (the row the
readiness probe rewrites).

Several server replicas may share one database (PostgreSQL). Every write that reads before it
writes (an event's sequence number, a job's history) first locks the job's row (``SELECT ... FOR
UPDATE``), so two replicas writing to one job at the same moment take turns instead of one
failing or losing the other's entry. On SQLite a write transaction starts with ``BEGIN
IMMEDIATE`` (the database-wide write lock) for the same reason, and writes in one process also
go through one lock, which avoids "database is locked" under bursts of concurrent submissions.

The schema is Alembic's (``api/migrations``): opening a store upgrades it to the newest revision.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    delete,
    event,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from hpservice.jobs import WAITING_STATES, JobRecord, JobState

from .migrations import upgrade


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("owner", "idempotency_key"),)

    id: Mapped[str] = mapped_column(String(80), primary_key=True)
    name: Mapped[str] = mapped_column(String(80), index=True)
    owner: Mapped[str] = mapped_column(String(80), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    message: Mapped[str] = mapped_column(Text, default="")
    spec_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[float] = mapped_column(Float)
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    total_steps: Mapped[int] = mapped_column(BigInteger)
    restarts: Mapped[int] = mapped_column(BigInteger, default=0)
    restart_reasons_json: Mapped[str] = mapped_column(Text, default="[]")
    history_json: Mapped[str] = mapped_column(Text, default="[]")
    checkpoints_json: Mapped[str] = mapped_column(Text, default="[]")
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)  # of the spec as submitted
    submitted_json: Mapped[str | None] = mapped_column(Text, nullable=True)  # the spec before admission (resubmit)
    started: Mapped[int] = mapped_column(Integer, default=0)  # the coordinator was launched
    log_time: Mapped[float] = mapped_column(Float, default=0.0)  # newest log line stored (stores before log_seq)
    log_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # the coordinator's cursor: last line stored
    placement_json: Mapped[str | None] = mapped_column(Text, nullable=True)  # rank -> node of the current attempt
    # a cancel that found the job launched: the leading replica stops its coordinator
    cancel_requested: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    def to_record(self) -> JobRecord:
        """The row as the job record every layer carries (``hpservice.jobs.JobRecord``)."""
        return JobRecord(
            id=self.id, name=self.name, owner=self.owner, state=self.state, message=self.message, step=self.step,
            total_steps=self.total_steps, restarts=self.restarts,
            restart_reasons=json.loads(self.restart_reasons_json), created_at=self.created_at,
            updated_at=self.updated_at, history=json.loads(self.history_json),
            checkpoints=json.loads(self.checkpoints_json), placement=json.loads(self.placement_json or "[]"),
            spec=json.loads(self.spec_json),
        )  # fmt: skip

    @classmethod
    def from_record(cls, record: JobRecord, **store_only: Any) -> JobRow:
        """A new row holding ``record``; ``store_only``: the columns no other layer sees
        (idempotency key, request hash, the submitted spec)."""
        return cls(
            id=record.id, name=record.name, owner=record.owner, state=record.state, message=record.message,
            step=record.step, total_steps=record.total_steps, restarts=record.restarts,
            restart_reasons_json=json.dumps(record.restart_reasons), created_at=record.created_at,
            updated_at=record.updated_at, history_json=json.dumps(record.history),
            checkpoints_json=json.dumps(record.checkpoints), placement_json=json.dumps(record.placement),
            spec_json=json.dumps(record.spec), **store_only,
        )  # fmt: skip

    def to_active(self) -> ActiveJob:
        """The row as the supervisor follows it: the record and the store's launch bookkeeping."""
        record = self.to_record()
        return ActiveJob(
            **{f.name: getattr(record, f.name) for f in dataclasses.fields(record)},
            started=bool(self.started), log_time=self.log_time, log_seq=self.log_seq,
            cancel_requested=bool(self.cancel_requested),
        )  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class ActiveJob(JobRecord):
    """A live job as the supervisor follows it (``Store.jobs_in``): its record, and the store's own
    bookkeeping of its launch, which no other layer sees."""

    started: bool = False  # its coordinator was launched
    log_time: float = 0.0  # the newest log line stored (stores from before log_seq)
    log_seq: int | None = None  # the coordinator's log cursor: the last line stored
    cancel_requested: bool = False  # a cancel that found it launched: the leader stops its coordinator


class MetricRow(Base):
    __tablename__ = "metrics"
    job_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    record_json: Mapped[str] = mapped_column(Text)


class EventRow(Base):
    __tablename__ = "events"
    job_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    data_json: Mapped[str] = mapped_column(Text)


class LeaseRow(Base):
    """Who holds a lease (the supervisor's: one replica of the server launches and follows jobs)
    and until when."""

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    holder: Mapped[str] = mapped_column(String(120))
    expires_at: Mapped[float] = mapped_column(Float)


class HeartbeatRow(Base):
    """One row the readiness probe rewrites: a store that cannot write is not ready."""

    __tablename__ = "heartbeat"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[float] = mapped_column(Float)


class Store:
    def __init__(self, url: str):
        sqlite = self._sqlite = url.startswith("sqlite")
        self.engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30} if sqlite else {})
        if sqlite:

            @event.listens_for(self.engine, "connect")
            def _pragmas(conn, _record):
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()

        upgrade(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write = threading.Lock()

    def session(self) -> Session:
        return self._sessions()

    def close(self) -> None:
        """Close the pooled connections (a server that stops: PostgreSQL counts its clients)."""
        self.engine.dispose()

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """A session for one write transaction (see the module doc for the locks it takes)."""
        with self._write, self.session() as s:
            if self._sqlite:
                s.connection().exec_driver_sql("BEGIN IMMEDIATE")
            yield s

    @staticmethod
    def _locked(s: Session, job_id: str) -> JobRow | None:
        """The job's row, locked until the transaction ends (a no-op on SQLite, where the
        transaction holds the database's write lock)."""
        return s.scalar(
            select(JobRow).where(JobRow.id == job_id).with_for_update().execution_options(populate_existing=True)
        )

    def ping(self) -> None:
        """Raise unless the store can be read and written (disk full, read-only data dir)."""
        with self.session() as s:
            s.execute(select(1))
        with self._writing() as s:
            s.merge(HeartbeatRow(id=1, at=time.time()))
            s.commit()

    # ---- jobs -------------------------------------------------------------------------------
    def create_job(
        self,
        job_id: str,
        name: str,
        owner: str,
        spec: dict,
        total_steps: int,
        idempotency_key: str | None,
        request_hash: str | None = None,
        submitted: dict | None = None,
    ):
        """Insert a QUEUED job; returns (its record, created). An idempotency key seen before for the
        same owner returns the existing job instead, or (None, False) when that job was submitted
        with a different request (``request_hash``); also when another replica stores the same
        key at the same moment (the database's unique constraint decides which one)."""
        if idempotency_key is not None and (existing := self._by_key(owner, idempotency_key, request_hash)):
            return existing
        now = time.time()
        with self._writing() as s:
            record = JobRecord(
                id=job_id, name=name, owner=owner, state=JobState.QUEUED, message="submitted", created_at=now,
                updated_at=now, total_steps=total_steps, spec=spec,
                history=[{"state": JobState.QUEUED, "time": now, "message": "submitted"}],
            )  # fmt: skip
            row = JobRow.from_record(
                record, idempotency_key=idempotency_key, request_hash=request_hash,
                submitted_json=json.dumps(submitted) if submitted is not None else None,
            )  # fmt: skip
            try:  # the INSERT happens at the event's flush or at the commit
                s.add(row)
                self._add_event(s, job_id, "state", {"state": JobState.QUEUED, "message": "submitted", "restarts": 0, "time": now})
                s.commit()
                return row.to_record(), True
            except IntegrityError:
                s.rollback()
                existing = self._by_key(owner, idempotency_key, request_hash) if idempotency_key is not None else None
                if existing is None:
                    raise
                return existing

    def _by_key(self, owner: str, key: str, request_hash: str | None) -> tuple[JobRecord | None, bool] | None:
        """The job ``owner`` submitted with idempotency key ``key``: (its record, False), or
        (None, False) when it was submitted with another request; None when there is none."""
        with self.session() as s:
            existing = s.scalar(select(JobRow).where(JobRow.owner == owner, JobRow.idempotency_key == key))
            if existing is None:
                return None
            if request_hash is not None and existing.request_hash not in (None, request_hash):
                return None, False
            return existing.to_record(), False

    def submitted_spec(self, job_id: str) -> dict | None:
        """The job's spec as its owner submitted it, before admission resolved its paths (None for
        jobs stored before this was kept)."""
        with self.session() as s:
            row = s.get(JobRow, job_id)
            return json.loads(row.submitted_json) if row is not None and row.submitted_json else None

    def get_job(self, job_id: str) -> JobRecord | None:
        with self.session() as s:
            row = s.get(JobRow, job_id)
            return row.to_record() if row else None

    def list_jobs(
        self, *, owner: str | None, state: str | None, name: str | None, limit: int, cursor: tuple[float, str] | None
    ) -> list[JobRecord]:
        """Newest first; ``cursor`` is the (created_at, id) of the last item of the previous page."""
        q = select(JobRow)
        if owner is not None:
            q = q.where(JobRow.owner == owner)
        if state is not None:
            q = q.where(JobRow.state == state)
        if name is not None:
            q = q.where(JobRow.name == name)
        if cursor is not None:
            created, last_id = cursor
            q = q.where((JobRow.created_at < created) | ((JobRow.created_at == created) & (JobRow.id < last_id)))
        q = q.order_by(JobRow.created_at.desc(), JobRow.id.desc()).limit(limit)
        with self.session() as s:
            return [r.to_record() for r in s.scalars(q)]

    def jobs_in(self, states: tuple[str, ...]) -> list[ActiveJob]:
        with self.session() as s:
            rows = s.scalars(select(JobRow).where(JobRow.state.in_(states)).order_by(JobRow.created_at, JobRow.id))
            return [r.to_active() for r in rows]

    def set_message(self, job_id: str, message: str) -> None:
        """A new message for the job's current state (no state change, no history entry)."""
        with self._writing() as s:
            row = self._locked(s, job_id)
            if row is not None and row.message != message:
                row.message, row.updated_at = message, time.time()
                s.commit()

    def is_started(self, job_id: str) -> bool:
        with self.session() as s:
            row = s.get(JobRow, job_id)
            return bool(row is not None and row.started)

    def requeue(self, job_id: str, message: str) -> None:
        """Back to QUEUED, not launched: its coordinator is gone but its checkpoints are not."""
        self.set_state(job_id, JobState.QUEUED, message)
        self.mark_not_started(job_id)

    def mark_not_started(self, job_id: str) -> None:
        """The job's coordinator has ended without ending the job (requeued, preempted): the
        queue launches a new one, unless a cancel came meanwhile: then the job is CANCELLED."""
        with self._writing() as s:
            row = self._locked(s, job_id)
            if row is None:
                return
            row.started = 0
            if row.cancel_requested and not JobState(row.state).is_terminal:
                self._apply(s, row, _entry(JobState.CANCELLED, "cancelled while its coordinator was stopping"))
            s.commit()

    def mark_started(self, job_id: str) -> None:
        with self._writing() as s:
            row = self._locked(s, job_id)
            row.started = 1
            s.commit()

    def claim_launch(self, job_id: str) -> bool:
        """Mark the job launched if nobody has and it still waits, uncancelled (one atomic
        UPDATE): True for the one caller that may start its coordinator, whichever replica or
        thread asks at the same time, and never after ``request_cancel`` cancelled it."""
        with self._writing() as s:
            result = s.execute(
                update(JobRow)
                .where(
                    JobRow.id == job_id, JobRow.started == 0, JobRow.cancel_requested == 0,
                    JobRow.state.in_(WAITING_STATES),
                )
                .values(started=1)
            )  # fmt: skip
            s.commit()
            return result.rowcount == 1

    def request_cancel(self, job_id: str) -> str:
        """Cancel the job, atomically against ``claim_launch`` on any replica: ``"cancelled"``
        when it was not launched (it is CANCELLED now and never runs), ``"requested"`` when it was
        (the request is stored; the leading replica stops its coordinator, which reports the
        end), ``"ended"`` when it had already ended."""
        with self._writing() as s:
            row = self._locked(s, job_id)
            if row is None or JobState(row.state).is_terminal:
                return "ended"
            if not row.started:
                self._apply(s, row, _entry(JobState.CANCELLED, "cancelled before it started"))
                s.commit()
                return "cancelled"
            row.cancel_requested = 1
            row.message, row.updated_at = "cancel requested: its coordinator is asked to stop", time.time()
            s.commit()
            return "requested"

    def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew lease ``name`` for ``holder`` for ``ttl_s`` seconds: True while
        ``holder`` has it. One atomic UPDATE (held by ``holder``, or expired), else the first
        INSERT; the database orders competing replicas."""
        now = time.time()
        with self._writing() as s:
            taken = s.execute(
                update(LeaseRow)
                .where(LeaseRow.name == name, or_(LeaseRow.holder == holder, LeaseRow.expires_at < now))
                .values(holder=holder, expires_at=now + ttl_s)
            )
            if taken.rowcount == 1:
                s.commit()
                return True
            if s.get(LeaseRow, name) is not None:
                return False
            s.add(LeaseRow(name=name, holder=holder, expires_at=now + ttl_s))
            try:
                s.commit()
            except IntegrityError:  # another replica inserted it first
                s.rollback()
                return False
            return True

    def release_lease(self, name: str, holder: str) -> None:
        with self._writing() as s:
            s.execute(delete(LeaseRow).where(LeaseRow.name == name, LeaseRow.holder == holder))
            s.commit()

    def update_status(self, job_id: str, status: dict) -> None:
        """Apply a coordinator status (state, message, step, restarts, history, checkpoints)."""
        with self._writing() as s:
            row = self._locked(s, job_id)
            if row is not None:
                self._apply(s, row, status)
                s.commit()

    def _apply(self, s: Session, row: JobRow, status: dict) -> None:
        """``update_status`` on the locked ``row``, in the caller's transaction."""
        job_id = row.id
        old_state, old_restarts = row.state, row.restarts
        if JobState(old_state).is_terminal and status["state"] != old_state:
            return  # an ended job never moves again (a late status from a coordinator it outlived)
        old_checkpoints = {c["step"] for c in json.loads(row.checkpoints_json)}
        history = json.loads(row.history_json)
        seen = {(h["state"], h["time"]) for h in history}
        new_entries = [h for h in status.get("history", []) if (h["state"], h["time"]) not in seen]
        history += new_entries
        row.state = status["state"]
        row.message = status.get("message", row.message)
        row.step = max(row.step, status.get("step", 0))
        row.restarts = status.get("restarts", row.restarts)
        row.restart_reasons_json = json.dumps(status.get("restart_reasons", []))
        row.history_json = json.dumps(history)
        checkpoints = status.get("checkpoints", json.loads(row.checkpoints_json))
        row.checkpoints_json = json.dumps(checkpoints)
        if "placement" in status:
            row.placement_json = json.dumps(status["placement"])
        row.updated_at = time.time()
        kept = [c["step"] for c in checkpoints]  # the committed ones still on storage: older ones were pruned
        for c in checkpoints:
            if c["step"] not in old_checkpoints:
                self._add_event(s, job_id, "checkpoint", {**c, "kept": kept})
        for h in new_entries:  # an elastic resize is an event even when the state stays
            if "resize" in h:
                data = {"state": h["state"], "message": h["message"], "restarts": row.restarts, "time": h["time"]}
                self._add_event(s, job_id, "state", {**data, "resize": h["resize"]})
        if row.state != old_state or row.restarts != old_restarts:
            data = {"state": row.state, "message": row.message, "restarts": row.restarts, "time": row.updated_at}
            self._add_event(s, job_id, "state", data)

    def set_state(self, job_id: str, state: str, message: str) -> None:
        self.update_status(job_id, _entry(state, message))

    def delete_job(self, job_id: str) -> None:
        with self._writing() as s:
            s.execute(delete(MetricRow).where(MetricRow.job_id == job_id))
            s.execute(delete(EventRow).where(EventRow.job_id == job_id))
            s.execute(delete(JobRow).where(JobRow.id == job_id))
            s.commit()

    def count_by_state(self) -> dict[str, int]:
        with self.session() as s:
            return dict(s.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all())

    # ---- metrics, logs, events --------------------------------------------------------------
    def add_metrics(self, job_id: str, records: list[dict]) -> None:
        if not records:
            return
        with self._writing() as s:
            row = self._locked(s, job_id)
            if row is None:
                return
            for r in records:  # one row a step: a restart's replay of a stored step replaces it
                s.merge(MetricRow(job_id=job_id, step=r["step"], record_json=json.dumps(r)))
                self._add_event(s, job_id, "metrics", r)
            row.step = max(row.step, max(r["step"] for r in records))
            s.commit()

    def missing_metric_steps(self, job_id: str, steps: int) -> list[int]:
        """The steps up to ``steps`` without a stored metrics record, from the first one stored (a
        job that began from another run's checkpoint trained from there), or from 1 when none is."""
        with self.session() as s:
            have = set(s.scalars(select(MetricRow.step).where(MetricRow.job_id == job_id, MetricRow.step <= steps)))
        first = min(have, default=1)
        return [step for step in range(first, steps + 1) if step not in have]

    def last_metric_step(self, job_id: str) -> int:
        with self.session() as s:
            return s.scalar(select(func.max(MetricRow.step)).where(MetricRow.job_id == job_id)) or 0

    def metrics(self, job_id: str, since_step: int) -> list[dict]:
        with self.session() as s:
            q = (
                select(MetricRow)
                .where(MetricRow.job_id == job_id, MetricRow.step > since_step)
                .order_by(MetricRow.step)
            )
            return [json.loads(r.record_json) for r in s.scalars(q)]

    def add_logs(self, job_id: str, lines: list[dict]) -> None:
        if not lines:
            return
        with self._writing() as s:
            row = self._locked(s, job_id)
            if row is None:
                return
            # a line at or below the stored cursor is stored already (a late answer asked again, a
            # second replica): once per line, whoever sends it
            lines = [line for line in lines if "seq" not in line or line["seq"] > (row.log_seq or 0)]
            if not lines:
                return
            for line in lines:
                self._add_event(s, job_id, "log", {k: line[k] for k in ("rank", "step", "time", "line")})
            row.log_time = max(row.log_time, max(line["time"] for line in lines))
            seqs = [line["seq"] for line in lines if "seq" in line]
            if seqs:
                row.log_seq = max(row.log_seq or 0, *seqs)
            s.commit()

    def log_count(self, job_id: str) -> int:
        """How many log lines the store holds for the job."""
        with self.session() as s:
            q = select(func.count()).select_from(EventRow).where(EventRow.job_id == job_id, EventRow.kind == "log")
            return s.scalar(q) or 0

    def logs(
        self, job_id: str, rank: int | None, tail: int | None, since: int = 0, limit: int | None = None
    ) -> tuple[list[dict], int]:
        """Log lines after event ``since`` (of ``rank``; the last ``tail``, or the first ``limit``:
        a page), each with its ``seq`` (the job's event sequence number, the same as the SSE id),
        and the cursor to ask with next: the last log event looked at, whether or not its rank
        matched."""
        with self.session() as s:
            q = (
                select(EventRow)
                .where(EventRow.job_id == job_id, EventRow.kind == "log", EventRow.seq > since)
                .order_by(EventRow.seq)
            )
            if limit is not None and rank is None:
                q = q.limit(limit)
            rows = [(r.seq, json.loads(r.data_json)) for r in s.scalars(q)]
        lines = [{**line, "seq": seq} for seq, line in rows if rank is None or line["rank"] == rank]
        if limit is not None and len(lines) > limit:  # one rank's page: stop after its limit-th line
            lines = lines[:limit]
            return lines, lines[-1]["seq"]
        cursor = rows[-1][0] if rows else since
        return (lines[-tail:] if tail else lines), cursor

    def events(self, job_id: str, after_seq: int, limit: int = 1000) -> list[tuple[int, str, dict]]:
        with self.session() as s:
            q = (
                select(EventRow)
                .where(EventRow.job_id == job_id, EventRow.seq > after_seq)
                .order_by(EventRow.seq)
                .limit(limit)
            )
            return [(r.seq, r.kind, json.loads(r.data_json)) for r in s.scalars(q)]

    def _add_event(self, s: Session, job_id: str, kind: str, data: dict) -> None:
        """The job's next event; the caller holds the job's row lock (or created the row), so
        no other transaction takes the same sequence number."""
        last = s.scalar(select(func.max(EventRow.seq)).where(EventRow.job_id == job_id)) or 0
        s.add(EventRow(job_id=job_id, seq=last + 1, kind=kind, data_json=json.dumps(data)))
        s.flush()


def _entry(state: str, message: str) -> dict:
    """A status that moves a job to ``state`` with ``message``, one history entry."""
    return {"state": state, "message": message, "history": [{"state": state, "time": time.time(), "message": message}]}
