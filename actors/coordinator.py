"""Coordinator: the Ray actor that owns one job.

It reserves a placement group (one bundle per worker, PACK so shard groups stay in a node),
starts one TrainWorker per bundle with ranks in bundle order (consecutive ranks share a node, so
the innermost mesh dim, dp_shard, is node-local and dp_replicate spans nodes), gives them rank 0's
address for the rendezvous, and then supervises:

- every ``POLL_S`` it polls the workers (``policy.WorkerPoll``); a dead worker (process lost, node
  lost) or a raised exception tears the group down, and the restart policy (``policy``) decides:
  restart from the latest committed checkpoint, up to ``failure.max_restarts`` times with
  back-off, or fail at once when the spec itself cannot run (a config error);
- a watchdog: no rank makes progress for ``failure.step_timeout_s`` (``startup_timeout_s`` until
  the first step of an attempt: rendezvous, model build, checkpoint load) -> the stacks of every
  rank go to the log, then restart or fail;
- ``stop()`` asks the workers to finish their step and checkpoint, kills them after a deadline.

Metrics reach it from rank 0 (``report``) into a bounded buffer that clients read with
``poll(since_step)``; they are also exported with ``ray.util.metrics`` for the dashboard and
Prometheus. Log lines of every rank are kept per rank. Every end state removes the workers and
the placement group; ``shutdown()`` ends the coordinator itself.

It runs as a threaded actor: ``run()`` holds one thread for the supervision loop while the other
methods answer clients.

The coordinator is the job's states and their handlers; what they act on is in classes of its
own (Ray Train v2's split): the placement group and workers (``worker_group.WorkerGroup``), the
metric and log buffers (``buffers``), the elastic size (``scaling.ElasticScaling``), where workers
may go (``placement``), and what a failure leads to (``failure_policy``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import traceback
from typing import NamedTuple

import ray

from hpservice.jobs import COORDINATOR_ENDS, JobRecord, JobState

from . import _drill, nodes, placement
from .buffers import LogBuffer, MetricsBuffer
from .failure_policy import (
    AttemptFailure,
    FailureKind,
    RestartPolicy,
    attempt_end,
    failure_from_polls,
    preemption_after_stop,
)
from .gauges import JobGauges
from .scaling import ElasticScaling
from .worker_group import WorkerGroup, worker_name

__all__ = ["Continuation", "Coordinator", "coordinator_name", "worker_name"]

POLL_S = 0.5


def coordinator_name(job_id: str) -> str:
    return f"hp:{job_id}:coordinator"


class _Failure(Exception):
    """An attempt failed; ``failure`` says how (``policy``): the restart policy decides what next."""

    def __init__(self, reason: str, kind: FailureKind = FailureKind.WORKER, lost_nodes: tuple[str, ...] = ()):
        super().__init__(reason)
        self.failure = AttemptFailure(kind, reason, lost_nodes)


def attempt_spec(spec, resume: bool, gpus: int):
    """What the workers of an attempt run, decided once, by the coordinator: GPUs or not (never
    ``auto``: ``gpus`` is ``ResourcesSpec.gpus_per_worker``'s answer for the cluster), and from the
    latest checkpoint after a restart. The workers and the trainer take it as it is."""
    spec = spec.resuming_from_latest() if resume else spec
    return spec.model_copy(update={"resources": spec.resources.model_copy(update={"use_gpu": bool(gpus)})})


@dataclasses.dataclass(frozen=True)
class RestartCause:
    """Why the job is RESTARTING, carried with that state to the handler that acts on it (Ray
    Train v2's ``RestartingState(training_failed_error)``): replace the workers of ``lost_nodes``
    (the cluster's failure, not counted as a restart), ``grow`` back to ``resources.workers``
    (room came back while shrunk), or neither: a worker failure, retried after the policy's
    back-off."""

    lost_nodes: tuple[str, ...] = ()
    grow: bool = False


class Transition(NamedTuple):
    """A handler's answer: the next state, its message, and for RESTARTING its cause."""

    state: JobState
    message: str
    cause: RestartCause | None = None


Next = Transition | tuple[JobState, str]  # what a state's handler returns (a pair: no cause)


@dataclasses.dataclass(frozen=True)
class Continuation:
    """What the store holds of a job's earlier coordinators, for the one that replaces them (after
    its node was lost, or a preemption): its lists and sequences continue instead of starting
    empty, which the store would take for the job's whole record.

    ``checkpoints``: the committed checkpoints known so far (the new attempt's commits and
    pruning apply to them); ``log_seq``: the last log sequence number stored (the new lines are
    numbered after it, so a follower's cursor never skips them); ``step``: the step the job
    resumes from; ``metrics_step``: the last step whose metrics the store has. The lost
    coordinator's workers may have trained (and checkpointed) past it before they were stopped,
    their reports going nowhere: the new attempt's rank 0 reports those steps from the run's
    ``metrics.jsonl`` (``Trainer(reported_up_to=...)``)."""

    checkpoints: tuple[dict, ...] = ()
    log_seq: int = 0
    step: int = 0
    metrics_step: int = 0


@ray.remote(num_cpus=0, max_concurrency=16)
class Coordinator:
    def __init__(self, job_id: str, spec, continuation: Continuation | None = None):
        continuation = continuation or Continuation()
        self.job_id = job_id
        self.spec = spec  # a JobSpec, parsed once at the edge (the CLI or the API)
        self._lock = threading.Lock()
        self._history: list[dict] = []
        self._set_state(JobState.QUEUED, "waiting to start")
        self._metrics = MetricsBuffer()
        self._logs = LogBuffer(start_seq=continuation.log_seq)
        self._checkpoints: list[dict] = [dict(c) for c in continuation.checkpoints]
        self._restarts: list[dict] = []
        self._stop_requested = False
        self._stop_deadline_s = 60.0
        self._preempted_by: str | None = None  # why the stop was asked, when it is a preemption
        self._failed_by: str | None = None  # why the stop was asked, when the job went past a server bound
        self._policy = RestartPolicy(self.spec.failure.max_restarts)
        self._attempt = 0
        self._node_losses: list[dict] = []
        self._stop_sent_at: float | None = None
        self._first_step: int | None = None  # the step this attempt started from
        self._scaling = ElasticScaling(self.spec)
        self._step = continuation.step
        self._reported_up_to = continuation.metrics_step  # the last step whose metrics reached the store or this actor
        # the workers report to this coordinator's handle: never a name another may hold
        self._group = WorkerGroup(job_id, ray.get_runtime_context().current_actor)
        self._gauges = JobGauges(self.job_id)
        self._node_id = ray.get_runtime_context().get_node_id()  # where supervision runs (the head by default)

    # ---- state ------------------------------------------------------------------------------
    def _set_state(self, state: str, message: str = "", **details) -> None:
        """Move to ``state`` (one of ``TRANSITIONS``' moves) with ``message``; ``details`` (e.g.
        ``resize``) go into the history entry as they are, for clients that act on them."""
        state = JobState(state)  # one of the vocabulary's, or ValueError
        with self._lock:
            current = getattr(self, "state", None)
            if current is not None and not current.can_become(state):
                raise RuntimeError(f"job {self.job_id}: no transition {current} -> {state} ({message})")
            self.state = state
            self._history.append({"state": state, "time": time.time(), "message": message, **details})

    def status(self) -> dict:
        """The run's side of the job record (``JobRecord``; the store adds the submission's side),
        and what only this coordinator knows: node losses, its size and resizes, its node, and
        how many metric records its buffer dropped."""
        with self._lock:
            record = JobRecord(
                id=self.job_id,
                name=self.spec.name,
                state=self.state,
                message=self._history[-1]["message"],
                history=list(self._history),
                step=self._step,
                total_steps=self.spec.training.steps,
                restarts=len(self._restarts),
                restart_reasons=[r["reason"] for r in self._restarts],
                placement=list(self._group.placement),
                checkpoints=list(self._checkpoints),
            )
            return {
                **record.run_side(),
                "node_losses": list(self._node_losses),
                "workers": self._scaling.size,
                "resizes": list(self._scaling.resizes),
                "coordinator_node": self._node_id,
                "metrics_dropped": self._metrics.dropped,
            }

    # ---- reports from workers --------------------------------------------------------------
    def report(self, record: dict) -> None:
        self._metrics.add(record)
        with self._lock:
            self._reported_up_to = max(self._reported_up_to, record["step"])
            # max: a threaded actor may run one caller's calls out of order (step 2's before step 1's)
            self._step = max(self._step, record["step"])
        self._gauges.record(record)

    def poll(self, since_step: int = 0, after: int = 0) -> dict:
        """Metrics records (every one still buffered) with step > ``since_step`` that arrived after
        the ``after``-th, in step order, plus the status and ``cursor``, the ``after`` to ask with
        next. A follower that keeps ``cursor`` gets every record once, even the ones of steps that
        arrived out of order (a step cursor would skip those)."""
        records, cursor = self._metrics.since(since_step, after)
        return {"records": records, "cursor": cursor, "status": self.status()}

    def add_log(self, rank: int, step: int, line: str) -> None:
        self._logs.add(rank, step, line)

    def logs(
        self, rank: int | None = None, tail: int | None = None, since: int = 0, since_seq: int = 0
    ) -> list[dict]:
        """Log lines of one rank (or all), from per-rank offset ``since`` and after sequence number
        ``since_seq`` (one sequence over all ranks: the cursor a follower keeps), the last
        ``tail`` of them, in sequence order."""
        return self._logs.lines(rank, tail, since, since_seq)

    def record_checkpoint(self, info: dict) -> None:
        """A committed checkpoint; ``info["kept"]`` (the steps still on storage) drops the ones
        pruning removed, so listings never offer a checkpoint that is gone. ``info["time"]``, when
        given, is when it was committed (an attempt reporting the checkpoint it resumed from, which
        an earlier attempt's workers may have written after their coordinator was lost); else now."""
        info = dict(info)
        kept = info.pop("kept", None)
        with self._lock:
            checkpoints = [c for c in self._checkpoints if c["step"] != info["step"]] + [{"time": time.time(), **info}]
            if kept is not None:
                checkpoints = [c for c in checkpoints if c["step"] in set(kept)]
            self._checkpoints = checkpoints

    def checkpoints(self) -> list[dict]:
        with self._lock:
            return list(self._checkpoints)

    # ---- control ----------------------------------------------------------------------------
    def stop(
        self,
        graceful: bool = True,
        deadline_s: float = 60.0,
        preempted_by: str | None = None,
        failed_by: str | None = None,
    ) -> None:
        """Cancel: graceful asks the workers to finish the step and checkpoint first. With
        ``preempted_by`` (the reason) the job ends this run PREEMPTED instead, to be resumed from
        that checkpoint by a later coordinator; with ``failed_by`` (a server bound it went past,
        e.g. its log volume) it ends FAILED with that reason, which no preemption overrides."""
        with self._lock:
            self._failed_by = self._failed_by or failed_by
            self._preempted_by = preemption_after_stop(self._stop_requested, self._preempted_by, preempted_by)
            self._stop_requested = True
            self._stop_deadline_s = deadline_s if graceful else 0.0
            if self.state not in COORDINATOR_ENDS:  # when the stop arrived, in the job's history (drills read it)
                message = f"stop asked at step {self._step}: {failed_by or preempted_by or 'cancel'}"
                self._history.append({"state": self.state, "time": time.time(), "message": message})

    def _stopped(self, how: str) -> tuple[JobState, str]:
        """The end of a run that was asked to stop: CANCELLED, FAILED past a server bound, or
        PREEMPTED, with its reason."""
        if self._failed_by is not None:
            return JobState.FAILED, f"{self._failed_by}; {how}"
        if self._preempted_by is not None:
            return JobState.PREEMPTED, f"{self._preempted_by}; {how}"
        return JobState.CANCELLED, how

    def shutdown(self) -> None:
        """End the coordinator (after a terminal state has been read)."""
        self._teardown()
        ray.actor.exit_actor()

    # ---- supervision: one handler per live state -------------------------------------------
    def run(self) -> str:
        """Run the job until this coordinator's part ends (a terminal state, or PREEMPTED: a later
        coordinator resumes it); returns that state. Each live state has a handler that does
        that state's work and returns the next state with its message, and RESTARTING its cause
        (``Transition``; ``TRANSITIONS`` says which moves exist; ``_set_state`` refuses any
        other)."""
        handlers = {
            JobState.QUEUED: self._queued,
            JobState.STARTING: self._starting,
            JobState.RUNNING: self._running,
            JobState.CANCELLING: self._running,  # the same supervision, the stop already sent
        }
        cause = None
        try:
            while self.state not in COORDINATOR_ENDS:
                _drill.fault_in(self.state)
                if self.state is JobState.RESTARTING:
                    state, message, cause = Transition(*self._restarting(cause or RestartCause()))
                else:
                    state, message, cause = Transition(*handlers[self.state]())
                self._set_state(state, message)
        except Exception as e:  # a bug in supervision: never a job that no one supervises
            self._supervision_failed(e)
        self._teardown()
        return self.state

    def _supervision_failed(self, e: Exception) -> None:
        """End the job FAILED with the error in its history and the traceback in its log (not
        restarted: the same supervision would meet the same error); ``run`` then releases its
        workers and placement group, and the server sees the end as any other."""
        self.add_log(0, self._step, f"coordinator: supervision raised\n{traceback.format_exc()}")
        with contextlib.suppress(Exception):
            self._kill_workers()
        if self.state not in COORDINATOR_ENDS:  # FAILED is a move from every live state
            self._set_state(JobState.FAILED, f"the job's supervision failed in {self.state}: {type(e).__name__}: {e}")

    def _queued(self) -> Next:
        """Reserve the placement group; wait (saying so once) until the cluster has room."""
        r = self.spec.resources
        self._group.gpus = r.gpus_per_worker(ray.cluster_resources().get("GPU", 0))
        why = placement.cluster_fit(self.spec, self._group.gpus)
        if why is not None:
            return JobState.FAILED, why
        if not self._reserve(r.workers, wait_s=None, waiting="waiting for resources"):
            return self._stopped("cancelled while queued")
        return JobState.STARTING, "attempt 1"

    def _starting(self) -> Next:
        return self._start_attempt(resume=False)

    def _restarting(self, cause: RestartCause) -> Next:
        """After a failure, by its cause: for a lost node, a new placement group on the live
        nodes (waiting up to ``failure.capacity_wait_s`` for room, then shrinking to an elastic
        size that fits); for a grow, the placement group of every worker; else the policy's
        back-off. Then the next attempt, from the latest checkpoint."""
        if cause.grow:
            ended = self._grow_back()
        elif cause.lost_nodes:
            ended = self._replace_lost(cause.lost_nodes)
        else:
            time.sleep(self._policy.backoff_s(len(self._restarts)))
            ended = None
        if ended is not None:
            return ended
        self._attempt += 1
        return self._start_attempt(resume=True)

    def _replace_lost(self, lost: tuple[str, ...]) -> tuple[JobState, str] | None:
        """Place the workers again without the lost nodes; a terminal (state, message) if not."""
        known = nodes.nodes()
        names = ", ".join(nodes.describe(n, known) for n in lost)
        nodes.wait_marked_dead(lost, timeout_s=self.NODE_DEATH_WAIT_S)
        self._release()
        wait_s = self.spec.failure.capacity_wait_s
        size = self._scaling.size
        if self._reserve(size, wait_s=wait_s, waiting=f"waiting for capacity: {names} lost; need"):
            return None
        if self._stop_requested:
            return self._stopped(f"cancelled while waiting for capacity ({names} lost)")
        for n in self._scaling.smaller_sizes():
            if self._reserve(n, wait_s=POLL_S * 4):  # room for n now, or try fewer
                self._resized(n, f"{names} lost and no room for {size} workers within {wait_s:g} s")
                return None
        need = f"{size} workers x {placement.worker_resources(self.spec, self._group.gpus)}"
        fewer = f" (nor for min_workers {self.spec.resources.min_workers})" if self.spec.resources.min_workers else ""
        return JobState.FAILED, f"{names} lost; no room for {need} on the live nodes within {wait_s:g} s{fewer}"

    def _grow_back(self) -> tuple[JobState, str] | None:
        """Stop the shrunk attempt (it has just checkpointed) and place every worker again; if
        the room is gone meanwhile, go on at the size it had."""
        old, full = self._scaling.size, self.spec.resources.workers
        self._kill_workers()
        self._release()
        wait_s = self.spec.failure.capacity_wait_s
        if self._reserve(full, wait_s=wait_s, waiting="growing back: waiting for room for"):
            self._resized(full, "room for every worker is back")
            return None
        if not self._stop_requested and self._reserve(old, wait_s=wait_s, waiting="the room went away: waiting for"):
            return None
        if self._stop_requested:
            return self._stopped("cancelled while growing back")
        return JobState.FAILED, f"no room for {full} workers, nor for {old} again, within {wait_s:g} s"

    def _resized(self, workers: int, reason: str) -> None:
        resize, message = self._scaling.resize(workers, reason)
        self._set_state(self.state, message, resize=resize)

    def _grow_ready(self) -> bool:
        with self._lock:
            times = [c["time"] for c in self._checkpoints]
        return self._scaling.grow_ready(self._group.gpus, times)

    def _start_attempt(self, resume: bool) -> Next:
        try:
            message = self._start_workers(resume)
        except _Failure as e:
            return self._after_failure(e.failure)
        return Transition(JobState.RUNNING, message)

    def _running(self) -> Next:
        """Supervise the attempt until it ends, fails, or a stop arrives (-> CANCELLING)."""
        try:
            return self._supervise()
        except _Failure as e:
            return self._after_failure(e.failure)

    def _after_failure(self, failure: AttemptFailure) -> Transition:
        """What a failed attempt leads to: cancelled, a replacement of a lost node (not counted
        as a restart), a restart, or the end (the policy decides)."""
        self._kill_workers()
        if self._stop_requested:
            return self._stopped(f"cancelled ({failure.reason})")
        if failure.kind is FailureKind.NODE:
            self._node_losses.append({"time": time.time(), "reason": failure.reason, "nodes": list(failure.lost_nodes)})
            message = f"{failure.reason}: replacing its workers (not counted as a restart)"
            return Transition(JobState.RESTARTING, message, RestartCause(lost_nodes=failure.lost_nodes))
        if not self._policy.should_restart(failure, len(self._restarts)):
            return JobState.FAILED, self._policy.failed_message(failure)
        self._restarts.append({"time": time.time(), "reason": failure.reason})
        self._gauges.restarts(len(self._restarts))
        message = f"restart {len(self._restarts)}/{self.spec.failure.max_restarts}: {failure.reason}"
        return Transition(JobState.RESTARTING, message, RestartCause())

    # ---- the work of the states ---------------------------------------------------------------
    NODE_DEATH_WAIT_S = 60.0  # for Ray to mark a lost node dead before placing anything again

    def _reserve(self, workers: int, wait_s: float | None, waiting: str | None = None) -> bool:
        """The placement group of ``workers`` workers, placed: waiting forever (``wait_s`` None)
        or ``wait_s`` seconds; False if a stop came first or the time ran out. ``waiting`` is
        said in the job's message once, if it has to wait."""

        def on_wait(what: str) -> None:
            if waiting is not None:
                self._set_state(self.state, f"{waiting} {what}")

        return self._group.reserve(self.spec.resized(workers), wait_s, lambda: self._stop_requested, on_wait)

    def _release(self) -> None:
        self._group.release()

    def _start_workers(self, resume: bool) -> str:
        """Start one worker per rank in its bundle, rendezvous at rank 0's address; returns the
        RUNNING message. Raises ``_Failure``."""
        attempt = attempt_spec(self.spec.resized(self._scaling.size), resume, self._group.gpus)
        try:
            message = self._group.start(attempt, self._reported_up_to)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise self._classify(f"workers failed to start: {type(e).__name__}: {_short(e)}") from None
        self._stop_sent_at = None
        self._first_step = None
        self._scaling.attempt_started()
        if resume:  # the step this attempt goes on from: its reports count up from there
            with self._lock:
                self._step = max((c["step"] for c in self._checkpoints), default=0)
        return message

    def _classify(self, reason: str) -> _Failure:
        """A worker died or stopped answering: a NODE failure if a node of the job was lost."""
        lost = self._group.lost_nodes()
        if lost:
            names = ", ".join(nodes.describe(n) for n in lost)
            return _Failure(f"{names} lost ({reason})", FailureKind.NODE, lost)
        return _Failure(reason)

    def _supervise(self) -> Next:
        """Poll the workers until the attempt ends; raises ``_Failure``."""
        spec = self.spec
        while True:
            time.sleep(POLL_S)
            try:
                polls = self._group.poll(timeout_s=60)
            except ray.exceptions.RayActorError as e:
                raise self._classify(f"a worker died: {_short(e)}") from None
            except ray.exceptions.GetTimeoutError:
                raise self._classify("workers stopped answering for 60 s") from None
            _drill.wait_while_held()
            failure = failure_from_polls(polls)
            if failure is not None:
                raise _Failure(failure.reason, failure.kind)
            end = attempt_end(polls, spec.training.steps)
            if end is not None:
                if end.finished or not self._stop_requested:
                    late = "; the stop asked meanwhile came after the last step" if self._stop_requested else ""
                    return JobState.SUCCEEDED, f"finished {spec.training.steps} steps{late}"
                return self._stopped(f"stopped gracefully at step {end.step}")
            if self._stop_requested:
                if self._stop_sent_at is None:
                    self._group.request_stop()
                    self._stop_sent_at = time.time()
                    why = self._failed_by or self._preempted_by
                    why = f"{why}: " if why else ""
                    return JobState.CANCELLING, f"{why}finishing the current step and checkpointing"
                if time.time() - self._stop_sent_at > self._stop_deadline_s:
                    self._kill_workers()
                    return self._stopped(f"killed after the {self._stop_deadline_s:g} s stop deadline")
                continue
            step = min(p.step for p in polls)
            self._first_step = step if self._first_step is None else self._first_step
            starting = step <= self._first_step  # the first step of an attempt also builds, loads and warms up
            limit = spec.failure.startup_timeout_s if starting else spec.failure.step_timeout_s
            stalled = time.time() - min(p.last_progress for p in polls)
            if stalled > limit:
                self._dump_stacks()
                what = f"before the first step of attempt (startup_timeout_s {limit:g})" if starting else f"after step {step}"
                raise _Failure(f"hang: no progress for {stalled:.0f} s {what} (stacks in the log)")
            if self._grow_ready():
                latest = max(c["step"] for c in self.checkpoints())
                size = self._scaling.size
                message = f"growing {size} -> {self.spec.resources.workers} workers: room is back; from step {latest}"
                return Transition(JobState.RESTARTING, message, RestartCause(grow=True))

    def _dump_stacks(self) -> None:
        for rank, text in enumerate(self._group.stacks()):
            self.add_log(rank, self._step, f"watchdog: stacks of rank {rank}\n{text}")

    def _kill_workers(self) -> None:
        self._group.kill()

    def _teardown(self) -> None:
        self._group.teardown()


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
