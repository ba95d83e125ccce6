"""Ray actor groups for jobs: a Coordinator per job, a TrainWorker per GPU (or CPU slot).

Client side::

    handle = start_job(spec)             # detached, named hp:<job>:coordinator
    handle.poll(after=cursor)            # metrics records + status, and the next cursor
    handle.wait()                        # terminal state
    handle.stop(graceful=True)
    handle.shutdown()                    # ends the coordinator once its final status was read
"""

from __future__ import annotations

import contextlib
import os
import time

import ray

from hpservice.jobs import COORDINATOR_ENDS

from .coordinator import Continuation, Coordinator, coordinator_name, worker_name
from .nodes import HEAD_RESOURCE

NAMESPACE = "hpservice"
COORDINATOR_RESOURCE_ENV = "HPSERVICE_COORDINATOR_RESOURCE"

__all__ = [
    "COORDINATOR_RESOURCE_ENV",
    "NAMESPACE",
    "Continuation",
    "JobHandle",
    "connect",
    "connect_ray",
    "coordinator_name",
    "coordinator_resource",
    "init_local_ray",
    "start_job",
    "worker_name",
]


def connect_ray(address: str, runtime_env: dict | None = None):
    """Join the Ray cluster at ``address``."""
    return ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, runtime_env=runtime_env)


def init_local_ray(*, num_cpus: int | None = None, dashboard: bool = True, **kwargs):
    """Start an embedded single-node Ray with its dashboard on loopback. (Ray itself always uses
    this machine's own address for its node, even when asked for 127.0.0.1; nothing leaves the
    machine.)

    Ray's raylet starts worker processes at niceness 15, below its own services, the driver and
    the dashboard; on a machine whose cores the training ranks fill, every wake-up of those then
    preempts a rank (``bench overhead``: hpservice run 1.046x torchrun's step time at 15). Here
    the workers are the job, so they run at the default priority, as torchrun's ranks do, unless
    the operator set ``RAY_worker_niceness``."""
    os.environ.setdefault("RAY_worker_niceness", "0")  # read by the raylet this call starts
    return ray.init(
        address="local",  # always a new instance, never a cluster some `ray start` left recorded
        num_cpus=num_cpus,
        namespace=NAMESPACE,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        log_to_driver=False,
        **kwargs,
    )


def connect(address: str | None = None, *, num_cpus: int | None = None, runtime_env: dict | None = None) -> str | None:
    """The one way this project joins Ray: ``address`` (else ``RAY_ADDRESS``), or else a new
    embedded local Ray with ``num_cpus`` CPUs (default: the machine's cores) and its dashboard on
    loopback. ``runtime_env``: this driver's jobs' code (``JobSpec.runtime``; Ray uploads local
    directories only at this level, and every actor the driver starts, detached ones too, gets it).
    Returns the dashboard URL when it is known; None if this process was connected."""
    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS")
    ctx = connect_ray(address, runtime_env) if address else init_local_ray(num_cpus=num_cpus, runtime_env=runtime_env)
    url = getattr(ctx, "dashboard_url", None)
    return f"http://{url}" if url and not url.startswith("http") else url


class JobHandle:
    """A client's handle on one job's coordinator."""

    def __init__(self, job_id: str, coordinator):
        self.job_id = job_id
        self.coordinator = coordinator

    @classmethod
    def attach(cls, job_id: str) -> JobHandle:
        return cls(job_id, ray.get_actor(coordinator_name(job_id), namespace=NAMESPACE))

    def status(self) -> dict:
        return ray.get(self.coordinator.status.remote())

    def poll(self, since_step: int = 0, after: int = 0) -> dict:
        """Metrics records and the status (``Coordinator.poll``): keep the answer's ``cursor`` and
        pass it as ``after`` to get each record once."""
        return ray.get(self.coordinator.poll.remote(since_step, after))

    def logs(self, rank: int | None = None, tail: int | None = None, since: int = 0, since_seq: int = 0) -> list[dict]:
        return ray.get(self.coordinator.logs.remote(rank, tail, since, since_seq))

    def checkpoints(self) -> list[dict]:
        return ray.get(self.coordinator.checkpoints.remote())

    def stop(
        self,
        graceful: bool = True,
        deadline_s: float = 60.0,
        wait: bool = True,
        preempted_by: str | None = None,
        failed_by: str | None = None,
    ) -> None:
        """Ask the coordinator to stop (``preempted_by``: the reason, for a preemption, which ends
        the run PREEMPTED; ``failed_by``: a bound the job went past, which ends it FAILED);
        ``wait=False`` does not wait for it to take the request (a frozen coordinator must not
        block the caller)."""
        ref = self.coordinator.stop.remote(graceful, deadline_s, preempted_by, failed_by)
        if wait:
            ray.get(ref)

    def wait(self, timeout: float | None = None, poll_s: float = 0.5) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            if status["state"] in COORDINATOR_ENDS:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {status['state']} after {timeout:.0f} s")
            time.sleep(poll_s)

    def shutdown(self) -> None:
        with contextlib.suppress(ray.exceptions.RayActorError):  # exit_actor ends the call with the actor
            ray.get(self.coordinator.shutdown.remote())


def coordinator_resource() -> str | None:
    """The Ray resource a job's coordinator needs (a tiny share of it), which pins it to the
    nodes that have it: the head node by default (``node:__internal_head__``), never a worker
    node whose loss would take the job's supervision with it. The operator names another one
    (a custom resource given to the nodes coordinators may run on) in
    ``HPSERVICE_COORDINATOR_RESOURCE``; ``none`` lets it run anywhere."""
    value = os.environ.get(COORDINATOR_RESOURCE_ENV, HEAD_RESOURCE).strip()
    return None if value.lower() in ("", "none") else value


def start_job(spec, job_id: str | None = None, continuation: Continuation | None = None) -> JobHandle:
    """Start ``spec`` (a JobSpec) on the connected Ray cluster; returns at once. The job id is the
    run id (``spec.run_id``, else ``job_id``, else a new one): restarts of the job share its
    outputs, other jobs never do. ``continuation``: what earlier coordinators of the job left
    (the service's relaunch of a requeued job)."""
    spec = spec.with_run(job_id)
    job_id = spec.run_id
    pin = coordinator_resource()
    coordinator = Coordinator.options(
        name=coordinator_name(job_id),
        namespace=NAMESPACE,
        lifetime="detached",
        resources={pin: 0.001} if pin else None,
    ).remote(job_id, spec, continuation)  # the parsed spec itself: Ray pickles it, nothing parses it again
    coordinator.run.remote()
    return JobHandle(job_id, coordinator)
