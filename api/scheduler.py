"""Which queued jobs start now, and why the others wait: a pure function of the queue, the running
jobs, the free resources and the operator's quotas (the supervisor calls it every tick; the
tests and ``bench scheduler`` call it directly).

The rules, in order:

1. **Priority**: a job's ``scheduling.priority``, else its owner's default (the operator's
   quotas file), else 0. Higher goes first. The owner's default is also the highest a job of
   theirs may ask for (``api/admission.admit``; admins excepted): a tenant cannot raise its own
   priority to preempt others.
2. **Quota**: an owner's running workers (and GPUs) plus the job's must stay within the
   operator's quota for that owner (or ``*``, everyone's); a job that would exceed it waits,
   saying so ("waiting: owner alice at quota 4/4 workers"), and blocks nobody else.
3. **Fair share** at equal priority: the next job is the one whose owner uses least now
   (running workers, counting the jobs this pass starts), then the oldest.
4. **Backfill**: the first job that does not fit the free resources becomes the *blocker*;
   jobs after it may still start if they fit what is free, but only while the blocker has waited
   less than ``backfill_bound_s``. After that nothing overtakes it: the cluster drains for it.
5. **Preemption**: when the blocker cannot fit, running jobs of lower priority are asked to
   checkpoint and stop (lowest priority first, then the most recently queued, until enough
   would be free, counting the jobs already stopping); they go back to the queue PREEMPTED and
   resume from that checkpoint. Nothing is preempted when even that would not make room.

Free resources are what the cluster has free minus what this pass starts; a job is the sum of
its workers' CPUs and GPUs (the coordinator's placement group then places it, or waits, by node).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EVERYONE = "*"


@dataclass(frozen=True)
class Quota:
    """The operator's limits for one owner (None: no limit) and its jobs' default (and highest)
    priority."""

    workers: int | None = None
    gpus: int | None = None
    priority: int = 0


@dataclass(frozen=True)
class Quotas:
    by_owner: dict[str, Quota] = field(default_factory=dict)

    def of(self, owner: str) -> Quota:
        return self.by_owner.get(owner) or self.by_owner.get(EVERYONE) or Quota()


@dataclass(frozen=True)
class JobDemand:
    """A job as the scheduler sees it: who, how urgent, how big (per worker), since when."""

    id: str
    owner: str
    priority: int | None  # the spec's; None: the owner's default
    workers: int
    cpus: float  # per worker
    gpus: int  # per worker
    queued_at: float


@dataclass(frozen=True)
class Decision:
    start: tuple[str, ...]  # in this order
    waiting: dict[str, str]  # job id -> why it waits
    preempt: dict[str, str] = field(default_factory=dict)  # running job id -> why it is stopped


def effective_priority(job: JobDemand, quotas: Quotas) -> int:
    return job.priority if job.priority is not None else quotas.of(job.owner).priority


def decide(
    queued: list[JobDemand],
    running: list[JobDemand],
    free: dict[str, float],
    quotas: Quotas,
    now: float,
    backfill_bound_s: float = 600.0,
    preempting: frozenset[str] = frozenset(),
) -> Decision:
    """The jobs of ``queued`` to start now, a reason for every other one, and the running jobs
    to preempt (module doc); ``preempting``: running jobs already asked to stop for one."""
    free = {"CPU": free.get("CPU", 0.0), "GPU": free.get("GPU", 0.0)}
    workers_of: dict[str, int] = {}
    gpus_of: dict[str, int] = {}
    for j in running:
        workers_of[j.owner] = workers_of.get(j.owner, 0) + j.workers
        gpus_of[j.owner] = gpus_of.get(j.owner, 0) + j.workers * j.gpus
    remaining = sorted(queued, key=lambda j: (-effective_priority(j, quotas), j.queued_at, j.id))
    start: list[str] = []
    waiting: dict[str, str] = {}
    blocker: JobDemand | None = None  # the first job that did not fit
    while remaining:
        top = effective_priority(remaining[0], quotas)
        same = [j for j in remaining if effective_priority(j, quotas) == top]
        job = min(same, key=lambda j: (workers_of.get(j.owner, 0), j.queued_at, j.id))  # fair share
        remaining.remove(job)
        quota = quotas.of(job.owner)
        used_w, used_g = workers_of.get(job.owner, 0), gpus_of.get(job.owner, 0)
        if quota.workers is not None and used_w + job.workers > quota.workers:
            waiting[job.id] = (
                f"waiting: owner {job.owner} at quota {used_w}/{quota.workers} workers (this job needs {job.workers})"
            )
            continue
        if quota.gpus is not None and used_g + job.workers * job.gpus > quota.gpus:
            waiting[job.id] = (
                f"waiting: owner {job.owner} at quota {used_g}/{quota.gpus} GPUs (this job needs {job.workers * job.gpus})"
            )
            continue
        cpus, gpus = job.workers * job.cpus, job.workers * job.gpus
        fits = cpus <= free["CPU"] + 1e-9 and gpus <= free["GPU"] + 1e-9
        if blocker is not None and now - blocker.queued_at >= backfill_bound_s:
            waiting[job.id] = (
                f"waiting behind job {blocker.id} (priority {effective_priority(blocker, quotas)}): it has waited past "
                f"the backfill bound of {backfill_bound_s:g} s, so nothing overtakes it"
            )
            continue
        if not fits:
            need = f"{job.workers} x {job.cpus:g} CPU" + (f" + {job.gpus} GPU" if job.gpus else "")
            waiting[job.id] = f"waiting for resources: needs {need}"  # stable: a new reason is a history entry
            if blocker is None:
                blocker = job
                waiting[job.id] += f" (smaller jobs may start ahead of it until it has waited {backfill_bound_s:g} s)"
            continue
        start.append(job.id)
        free["CPU"] -= cpus
        free["GPU"] -= gpus
        workers_of[job.owner] = used_w + job.workers
        gpus_of[job.owner] = used_g + job.workers * job.gpus
    preempt: dict[str, str] = {}
    if blocker is not None:
        preempt = _victims(blocker, running, free, quotas, preempting)
        if preempt:
            waiting[blocker.id] = f"waiting for {', '.join(sorted(preempt))} to checkpoint and stop (preempted for it)"
    return Decision(tuple(start), waiting, preempt)


def _victims(
    job: JobDemand, running: list[JobDemand], free: dict[str, float], quotas: Quotas, preempting: frozenset[str]
) -> dict[str, str]:
    """The running jobs to stop so that ``job`` fits (none if it would fit once the ones already
    stopping are gone, or if stopping every lower-priority one would not be enough)."""
    need = {"CPU": job.workers * job.cpus, "GPU": job.workers * job.gpus}
    soon = dict(free)
    for r in running:
        if r.id in preempting:
            soon["CPU"] += r.workers * r.cpus
            soon["GPU"] += r.workers * r.gpus
    if all(soon[k] + 1e-9 >= v for k, v in need.items()):
        return {}
    priority = effective_priority(job, quotas)
    candidates = [r for r in running if r.id not in preempting and effective_priority(r, quotas) < priority]
    candidates.sort(key=lambda r: (effective_priority(r, quotas), -r.queued_at, r.id))
    chosen = {}
    for r in candidates:
        chosen[r.id] = f"preempted by job {job.id} (priority {priority} > {effective_priority(r, quotas)})"
        soon["CPU"] += r.workers * r.cpus
        soon["GPU"] += r.workers * r.gpus
        if all(soon[k] + 1e-9 >= v for k, v in need.items()):
            return chosen
    return {}
