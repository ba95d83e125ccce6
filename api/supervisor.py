"""The bridge between the store and Ray: starts queued jobs as the scheduler decides, follows
running ones.

One background thread, every ``poll_interval_s``:

1. the scheduler (``api/scheduler.py``: priority, the operator's per-owner quotas, fair share,
   backfill with a bound) picks the QUEUED jobs that start now (their Coordinator actors), from
   the free resources less those of jobs launched but not yet placed; every other queued job is
   told why it waits, each new reason once, in its history; a job that can never fit fails at
   once with the reason. A cancel, taken by any replica, is one atomic step in the store
   against the launch's claim (``Store.request_cancel``, ``Store.claim_launch``): it either finds
   the job unlaunched (CANCELLED, never launched) or launched (the request is stored, and this
   loop asks the coordinator to stop): a job the store calls CANCELLED never runs;
2. every launched, unfinished job's coordinator is asked for its news (metrics after the last
   stored step, log lines after the stored log cursor, its status) without waiting: the answers
   of every coordinator that has answered are stored (and so reach SSE clients), so one slow or
   frozen coordinator never delays another job. At most one request per job is in flight; a
   coordinator that has not answered for ``POLL_TIMEOUT_S`` is marked unhealthy in the job's
   message until it answers again. A job that ended has its coordinator shut down.

Replicas: several servers may share one database; only the one holding the ``supervisor`` lease
in the store (renewed every tick; it lapses ``--lease-ttl-s``, default 10 s, after the last
renewal) runs the loop above, and a job is launched only by the caller whose atomic claim
(``Store.claim_launch``) marked it started, so no job starts twice
even while a lease changes hands. A replica that stops releases the lease; one that is killed is
replaced when its lease expires, and the new leader re-attaches to every coordinator by name.

On start it finds the launched, unfinished jobs in the store and re-attaches to their
coordinators by name, then back-fills the metrics that came in meanwhile (the coordinator keeps
them in its buffer). If the coordinator is gone (the Ray cluster restarted), a job with a
checkpoint goes back to the queue and resumes from its latest one; a job without fails with
that reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import ray

from hpservice.actors import NAMESPACE, Continuation, JobHandle, start_job, worker_name
from hpservice.actors.nodes import alive_resources
from hpservice.actors.placement import cluster_fit
from hpservice.jobs import ACTIVE_STATES, COORDINATOR_ENDS, TERMINAL_STATES, WAITING_STATES, JobRecord, JobState
from hpservice.spec import parse_job

from .scheduler import JobDemand, Quotas, decide
from .settings import LEASE_TTL_S
from .store import ActiveJob, Store

log = logging.getLogger("hpservice.api.supervisor")

POLL_TIMEOUT_S = 30.0  # a coordinator that has not answered this long is unhealthy
SUPERVISOR_LEASE = "supervisor"  # held by the one replica that launches and follows jobs


@dataclass
class _Request:
    """One job's news request in flight: its status (with metrics) and its new log lines."""

    handle: JobHandle
    poll: ray.ObjectRef
    logs: ray.ObjectRef
    log_time: float  # stores without a log cursor: lines newer than this are new
    issued: float
    overdue: bool = False


class Supervisor:
    def __init__(
        self,
        store: Store,
        poll_interval_s: float = 0.5,
        poll_timeout_s: float = POLL_TIMEOUT_S,
        *,
        quotas: Quotas | None = None,
        backfill_bound_s: float = 600.0,
        lease_ttl_s: float = LEASE_TTL_S,
        max_log_lines_per_job: int | None = None,
    ):
        self.store = store
        self.max_log_lines_per_job = max_log_lines_per_job
        self.quotas = quotas or Quotas()
        self.backfill_bound_s = backfill_bound_s
        self.lease_ttl_s = lease_ttl_s
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.is_leader = False
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self._handles: dict[str, JobHandle] = {}
        self._metric_cursors: dict[str, tuple[JobHandle, int]] = {}  # job -> (its coordinator's handle, arrivals read)
        # job -> the last log line stored by this process: a tick's job rows are read before that
        # tick stores the answers in flight, so their log_seq may be behind
        self._log_cursors: dict[str, int] = {}
        self._log_counts: dict[str, int] = {}  # job -> log lines stored (counted once per leadership)
        self._over_log_bound: set[str] = set()  # jobs asked to stop for their log volume
        self._requests: dict[str, _Request] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reasons: dict[str, str] = {}  # queued job -> the reason it was last told it waits
        self._preempting: set[str] = set()  # running jobs asked to stop for a higher-priority one
        self._cancelling: set[str] = set()  # launched jobs whose coordinator was asked to stop for a cancel
        self._unlaunched: set[str] = set()  # jobs this tick sent back to the queue (no coordinator to ask)
        self._specs: dict[str, object] = {}  # job -> its parsed spec (a job's spec never changes)
        self._lock = threading.RLock()  # launch and the handle table

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="hpservice-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- requests from routes --------------------------------------------------------------
    def infeasible(self, spec) -> str | None:
        """Why ``spec`` can never fit the connected cluster (and how to make it fit), or None; None
        too when no cluster is connected yet (the launch checks again)."""
        if not ray.is_initialized():
            return None
        return cluster_fit(spec, spec.resources.gpus_per_worker(ray.cluster_resources().get("GPU", 0)))

    def node_memory(self) -> int | None:
        """The largest alive node's memory as Ray reports it (its ``memory`` resource), or None
        when no cluster is connected: the default of what one worker may hold."""
        if not ray.is_initialized():
            return None
        try:
            nodes = ray.nodes()
        except Exception:  # a cluster going away: the caller falls back to this host's memory
            return None
        sizes = [int(n.get("Resources", {}).get("memory", 0)) for n in nodes if n.get("Alive")]
        return max(sizes, default=0) or None

    def devices(self) -> tuple[float, int | None]:
        """(the cluster's GPUs, the memory of its smallest GPU where Ray names their type), for a
        job's memory estimate at submit; (0, None) when no cluster is connected."""
        if not ray.is_initialized():
            return 0.0, None
        from hpservice.memory.plan import gpu_memory

        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
        except Exception:  # a cluster going away: no figure to check against
            return 0.0, None
        gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in nodes)
        sizes = [gpu_memory(n.get("Resources", {})) for n in nodes if n.get("Resources", {}).get("GPU")]
        known = [m for m in sizes if m is not None]
        return gpus, (min(known) if known and len(known) == len(sizes) else None)

    def cancel(self, job: JobRecord) -> None:
        """Cancel ``job`` on whichever replica the request came to: one transition, whatever the
        launch is doing (see the module doc); a launched job's coordinator is asked to stop by
        the leader's next tick."""
        self.store.request_cancel(job.id)

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                leader = self.store.hold_lease(SUPERVISOR_LEASE, self.replica, self.lease_ttl_s)
                if leader:
                    self.tick()
                elif self.is_leader:
                    self._step_down()
                self.is_leader = leader
            except Exception:  # keep supervising whatever one tick met
                log.exception("supervisor tick failed")
            self._stop.wait(self.poll_interval_s)
        with contextlib.suppress(Exception):  # a stopped replica hands over at once, not after the ttl
            self.store.release_lease(SUPERVISOR_LEASE, self.replica)

    def _step_down(self) -> None:
        """Another replica holds the lease now: forget what this one was following."""
        with self._lock:
            self._handles.clear()
        self._requests.clear()
        self._log_cursors.clear()
        self._log_counts.clear()
        self._over_log_bound.clear()
        self._preempting.clear()
        self._cancelling.clear()
        self._reasons.clear()

    def tick(self) -> None:
        jobs = self.store.jobs_in(ACTIVE_STATES)
        self._unlaunched.clear()
        self._cancelling &= {j.id for j in jobs}
        self._schedule(jobs)
        self._collect()
        now = time.monotonic()
        for job in jobs:
            if not job.started:
                continue
            if job.cancel_requested and job.id not in self._cancelling:
                self._stop_cancelled(job.id)
            request = self._requests.get(job.id)
            if request is None:
                if job.id in self._unlaunched:
                    continue  # requeued or preempted by an answer collected in this tick
                self._ask(job)
            elif not request.overdue and now - request.issued > self.poll_timeout_s:
                request.overdue = True
                self.store.set_message(
                    job.id, f"unhealthy: its coordinator has not answered for {self.poll_timeout_s:g} s"
                )
        self._collect(wait_s=0.1)  # answers that come at once are stored in this tick

    def _stop_cancelled(self, job_id: str) -> None:
        """Ask the coordinator of a job whose cancel was stored to stop, once; it reports the end
        (CANCELLED) itself. Never waits: a frozen coordinator must not stall the loop."""
        handle = self._handle(job_id)
        if handle is not None:
            handle.stop(graceful=True, deadline_s=60, wait=False)
            self._cancelling.add(job_id)

    def _schedule(self, jobs: list[ActiveJob]) -> None:
        """Start the queued jobs the scheduler picks (``api/scheduler.py``: priority, quotas, fair
        share, backfill); tell every other queued job why it waits; fail the ones that can
        never fit."""
        queued = [j for j in jobs if not j.started]
        if not queued:
            return
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        alive = alive_resources()  # once per tick, however long the queue
        demands = {}
        for job in queued:
            spec = self._spec_of(job)
            why = cluster_fit(spec, spec.resources.gpus_per_worker(cluster_gpus), alive)
            if why is not None:
                with self._lock:
                    if not self.store.is_started(job.id):
                        self.store.set_state(job.id, JobState.FAILED, why)
                continue
            demands[job.id] = self._demand(job, spec, cluster_gpus)
        running = [self._demand(j, self._spec_of(j), cluster_gpus) for j in jobs if j.started]
        self._preempting &= {r.id for r in running}
        free = dict(ray.available_resources())
        for job, demand in zip([j for j in jobs if j.started], running, strict=True):
            if job.state == JobState.QUEUED:  # launched, its placement group maybe not placed yet
                free["CPU"] = free.get("CPU", 0) - demand.workers * demand.cpus
                free["GPU"] = free.get("GPU", 0) - demand.workers * demand.gpus
        decision = decide(
            list(demands.values()),
            running,
            free,
            self.quotas,
            now=time.time(),
            backfill_bound_s=self.backfill_bound_s,
            preempting=frozenset(self._preempting),
        )
        for job_id, reason in decision.preempt.items():
            handle = self._handle(job_id)
            if handle is not None:  # it checkpoints, stops, and comes back PREEMPTED (see _store_answer)
                handle.stop(graceful=True, deadline_s=60, wait=False, preempted_by=reason)
                self._preempting.add(job_id)
        by_id = {j.id: j for j in queued}
        for job_id in decision.start:
            self._launch(by_id[job_id])
        for job_id, reason in decision.waiting.items():
            if self._reasons.get(job_id) != reason:  # each new reason once, in the job's history
                self._reasons[job_id] = reason
                self.store.set_state(job_id, by_id[job_id].state, reason)  # QUEUED or PREEMPTED
        active = {j.id for j in jobs}
        for cache in (self._reasons, self._specs):
            for job_id in [k for k in cache if k not in active]:
                del cache[job_id]

    def _spec_of(self, job: JobRecord):
        spec = self._specs.get(job.id)
        if spec is None:
            spec = self._specs[job.id] = parse_job(job.spec)
        return spec

    @staticmethod
    def _demand(job: JobRecord, spec, cluster_gpus: float) -> JobDemand:
        r = spec.resources
        return JobDemand(
            job.id, job.owner, spec.scheduling.priority, r.workers, r.cpus_per_worker,
            r.gpus_per_worker(cluster_gpus), job.created_at,
        )  # fmt: skip

    def _launch(self, job: ActiveJob) -> None:
        spec = self._spec_of(job)
        continuation = None
        if job.checkpoints:  # requeued after its cluster was lost: go on from the latest one
            spec = spec.resuming_from_latest()
            # the new coordinator continues the store's record (checkpoints, log numbers), not from nothing
            continuation = Continuation(
                tuple(job.checkpoints), job.log_seq or 0, job.checkpoints[-1]["step"],
                self.store.last_metric_step(job.id),
            )  # fmt: skip
        with self._lock:
            current = self.store.get_job(job.id)
            if current is None or current.state not in WAITING_STATES:
                return  # cancelled meanwhile
            if not self.store.claim_launch(job.id):
                return  # launched meanwhile (by a replica whose lease this one took over)
            try:
                self._handles[job.id] = start_job(spec, job_id=job.id, continuation=continuation)
            except ValueError as e:  # the name is still held by a coordinator Ray has not yet marked dead
                self.store.mark_not_started(job.id)
                log.warning("job %s not launched yet: %s", job.id, e)
                return
            except BaseException:
                self.store.mark_not_started(job.id)
                raise
            self._reasons.pop(job.id, None)

    def _handle(self, job_id: str) -> JobHandle | None:
        if not ray.is_initialized():
            return None  # never start a Ray just to look a job up
        with self._lock:
            handle = self._handles.get(job_id)
            if handle is None:
                try:
                    handle = self._handles[job_id] = JobHandle.attach(job_id)
                except ValueError:
                    return None
            return handle

    def _ask(self, job: ActiveJob) -> None:
        """Send one news request to the job's coordinator; never waits for the answer."""
        handle = self._handle(job.id)
        if handle is None:  # the Ray cluster it ran on is gone
            self._coordinator_lost(job.id, "its coordinator is gone (the Ray cluster restarted?)")
            return
        coordinator = handle.coordinator
        self._requests[job.id] = _Request(
            handle=handle,
            poll=coordinator.poll.remote(*self._metric_cursor(job.id, handle)),
            logs=coordinator.logs.remote(None, None, 0, max(job.log_seq or 0, self._log_cursors.get(job.id, 0))),
            log_time=job.log_time if job.log_seq is None else -1.0,
            issued=time.monotonic(),
        )

    def _metric_cursor(self, job_id: str, handle: JobHandle) -> tuple[int, int]:
        """``(since_step, after)`` for ``Coordinator.poll``: for a coordinator this process reads
        already, its arrival count (steps may arrive out of order: a step cursor would skip
        some); for one it has not read yet (a relaunch, or a coordinator re-attached after a
        restart of the server), the steps after the last one stored, which it has not sent."""
        seen = self._metric_cursors.get(job_id)
        if seen is not None and seen[0] is handle:
            return 0, seen[1]
        return self.store.last_metric_step(job_id), 0

    def _coordinator_lost(self, job_id: str, why: str) -> None:
        """A launched job whose coordinator is gone (its node lost, the Ray cluster restarted):
        back to the queue to resume from its latest checkpoint, the store's record of which
        outlives the coordinator; without a checkpoint it fails, saying why. Whatever workers
        the dead coordinator left are killed first, so the relaunch gets their resources."""
        job = self.store.get_job(job_id)
        if job is None or job.state in TERMINAL_STATES:
            return
        _kill_orphans(job_id, job.spec.get("resources", {}).get("workers", 0))
        if job.checkpoints:
            step = job.checkpoints[-1]["step"]
            self.store.requeue(job_id, f"requeued: {why}; it resumes from its checkpoint of step {step}")
            self._unlaunched.add(job_id)
        else:
            self.store.set_state(job_id, JobState.FAILED, f"coordinator lost: {why}; no checkpoint to resume from")

    def _collect(self, wait_s: float = 0.0) -> None:
        """Store the answers that have arrived (within ``wait_s`` for all of them together);
        leave the others in flight."""
        if not self._requests:
            return
        refs = [ref for r in self._requests.values() for ref in (r.poll, r.logs)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        ready = set(ready)
        for job_id, request in list(self._requests.items()):
            if request.poll in ready and request.logs in ready:
                del self._requests[job_id]
                self._store_answer(job_id, request)

    def _store_answer(self, job_id: str, request: _Request) -> None:
        try:
            update = ray.get(request.poll)
            lines = [line for line in ray.get(request.logs) if line["time"] > request.log_time]
        except ray.exceptions.ActorUnavailableError:
            return  # maybe for a moment (its node unreachable): asked again next tick; dead is ActorDiedError
        except ray.exceptions.RayActorError as e:
            with self._lock:
                if self._handles.get(job_id) is not request.handle:
                    return  # the answer of a coordinator already replaced
                self._handles.pop(job_id, None)
            self._coordinator_lost(job_id, f"its coordinator died ({_first_line(e)})")
            return
        self.store.add_metrics(job_id, update["records"])
        self._metric_cursors[job_id] = (request.handle, update["cursor"])
        seqs = [line["seq"] for line in lines if "seq" in line]
        self.store.add_logs(job_id, self._within_log_bound(job_id, request.handle, lines))
        if seqs:
            self._log_cursors[job_id] = max(self._log_cursors.get(job_id, 0), *seqs)
        status = update["status"]
        if status["state"] == JobState.SUCCEEDED:
            status = self._check_metrics_complete(job_id, status)
        self.store.update_status(job_id, status)
        if status["state"] == JobState.PREEMPTED:  # checkpointed and stopped: back to the queue
            self.store.mark_not_started(job_id)
            self._preempting.discard(job_id)
            self._unlaunched.add(job_id)
        if status["state"] in COORDINATOR_ENDS:
            with self._lock:
                self._handles.pop(job_id, None)
                self._metric_cursors.pop(job_id, None)
                self._log_cursors.pop(job_id, None)
                self._log_counts.pop(job_id, None)
                self._over_log_bound.discard(job_id)
            request.handle.shutdown()

    def _within_log_bound(self, job_id: str, handle: JobHandle, lines: list[dict]) -> list[dict]:
        """The lines the job may still store under ``max_log_lines_per_job``; the first time it
        goes past the bound, its coordinator is asked to stop and the job ends FAILED saying so
        (the lines past it are dropped: the store's volume is the operator's, not the tenant's)."""
        bound = self.max_log_lines_per_job
        if bound is None or not lines:
            return lines
        if job_id not in self._log_counts:
            self._log_counts[job_id] = self.store.log_count(job_id)
        room = max(0, bound - self._log_counts[job_id])
        kept = lines[:room]
        self._log_counts[job_id] += len(kept)
        if len(kept) < len(lines) and job_id not in self._over_log_bound:
            why = (
                f"the job wrote more than {bound} log lines, the most this server stores for one job "
                "(--max-log-lines-per-job); the lines past it were dropped"
            )
            log.warning("job %s: %s; stopping it", job_id, why)
            handle.stop(graceful=True, deadline_s=60, wait=False, failed_by=why)
            self._over_log_bound.add(job_id)
            self.store.set_message(job_id, f"stopping: {why}")
        return kept

    def _check_metrics_complete(self, job_id: str, status: dict) -> dict:
        """A job that trained every step must have every step's metrics stored; where it does not
        (an attempt whose reports went astray), its final message says which are missing, and the
        supervisor logs it as an error: never a silent gap in a curve."""
        trained = status.get("step", 0)
        missing = self.store.missing_metric_steps(job_id, trained)
        if not missing:
            return status
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        why = f"the store lacks the metrics of {len(missing)} of the steps it trained (steps {shown})"
        log.error("job %s succeeded, but %s", job_id, why)
        return {**status, "message": f"{status.get('message', '')}; but {why}".lstrip("; ")}


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def _kill_orphans(job_id: str, workers: int) -> None:
    """Kill the workers a lost coordinator left behind (detached from it, they would hold their
    resources and their names)."""
    for rank in range(workers):
        with contextlib.suppress(ValueError):  # not there (never started, or died with its node)
            ray.kill(ray.get_actor(worker_name(job_id, rank), namespace=NAMESPACE), no_restart=True)
