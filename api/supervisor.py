"""The bridge between the store and Ray: starts queued jobs in order, follows running ones.

One background thread, every ``poll_interval_s``:

1. the oldest QUEUED job not yet launched starts (its Coordinator actor) when the cluster has
   room for it now; a job that can never fit fails at once with the reason; later jobs wait
   behind it (first in, first out);
2. every launched, unfinished job's coordinator is polled: new metrics, log lines, checkpoints
   and state changes go to the store (and so to SSE clients). A job that ended has its
   coordinator shut down.

On start it finds the launched, unfinished jobs in the store and re-attaches to their
coordinators by name, then back-fills the metrics that came in meanwhile (the coordinator keeps
them in its buffer). If the coordinator is gone (the Ray cluster restarted), the job fails with
that reason.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from actors import JobHandle, connect_ray, init_local_ray, start_job
from actors.coordinator import TERMINAL, cluster_fit
from hpservice.spec import parse_job

from .store import Store

log = logging.getLogger("hpservice.api.supervisor")

ACTIVE = ("QUEUED", "STARTING", "RUNNING", "RESTARTING", "CANCELLING")


class Supervisor:
    def __init__(self, store: Store, poll_interval_s: float = 0.5):
        self.store = store
        self.poll_interval_s = poll_interval_s
        self._handles: dict[str, JobHandle] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_launch = 0.0
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="hpservice-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- requests from routes --------------------------------------------------------------
    def cancel(self, job: dict) -> None:
        if job["state"] in TERMINAL:
            return
        handle = self._handle(job["id"])
        if handle is None:
            self.store.set_state(job["id"], "CANCELLED", "cancelled before it started")
        else:
            handle.stop(graceful=True, deadline_s=60)

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # keep supervising whatever one tick met
                log.exception("supervisor tick failed")
            self._stop.wait(self.poll_interval_s)

    def tick(self) -> None:
        jobs = self.store.jobs_in(ACTIVE)
        self._launch_next([j for j in jobs if not j["started"]])
        for job in jobs:
            if job["started"]:
                self._follow(job)

    def _launch_next(self, waiting: list[dict]) -> None:
        if not waiting or time.monotonic() - self._last_launch < 2.0:
            return  # give the last launch time to take its resources
        job = waiting[0]
        if (self.store.get_job(job["id"]) or {}).get("state") != "QUEUED":
            return  # cancelled meanwhile
        spec = parse_job(job["spec"])
        r = spec.resources
        gpus = 1 if r.use_gpu is True else 0
        why = cluster_fit(r.workers, r.cpus_per_worker, gpus)
        if why is not None:
            self.store.set_state(job["id"], "FAILED", why)
            return
        free = ray.available_resources()
        if free.get("CPU", 0) + 1e-9 < r.workers * r.cpus_per_worker or free.get("GPU", 0) < r.workers * gpus:
            if job["message"] == "submitted":
                self.store.set_state(
                    job["id"], "QUEUED", f"waiting for resources: {r.workers} x {r.cpus_per_worker:g} CPU"
                )
            return
        with self._lock:
            self._handles[job["id"]] = start_job(spec, job_id=job["id"])
        self.store.mark_started(job["id"])
        self._last_launch = time.monotonic()

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

    def _follow(self, job: dict) -> None:
        handle = self._handle(job["id"])
        if handle is None:
            self.store.set_state(job["id"], "FAILED", "coordinator lost (the Ray cluster was restarted?)")
            return
        try:
            update = handle.poll(since_step=self.store.last_metric_step(job["id"]))
            lines = [line for line in handle.logs() if line["time"] > job["log_time"]]
        except ray.exceptions.RayActorError:
            with self._lock:
                self._handles.pop(job["id"], None)
            self.store.set_state(job["id"], "FAILED", "coordinator died")
            return
        self.store.add_metrics(job["id"], update["records"])
        self.store.add_logs(job["id"], lines)
        status = update["status"]
        self.store.update_status(job["id"], status)
        if status["state"] in TERMINAL:
            with self._lock:
                self._handles.pop(job["id"], None)
            handle.shutdown()


def connect(address: str | None) -> str | None:
    """Connect this process to Ray: ``address``, or an embedded local Ray (dashboard on loopback).
    Returns the dashboard URL."""
    if ray.is_initialized():
        return None
    if address:
        ctx = connect_ray(address)
    else:
        ctx = init_local_ray()
    url = getattr(ctx, "dashboard_url", None)
    return f"http://{url}" if url and not url.startswith("http") else url
