"""The workers of one job's attempt (Ray Train v2's ``WorkerGroup``): their placement group, the
``TrainWorker`` actors in it, where they run, and the calls the coordinator makes to all of them.

It knows nothing of job states: the coordinator decides when to reserve, start, poll, stop and
kill; this class does it. One bundle per worker (``placement.plan_placement``: PACK, so
consecutive ranks share a node and the innermost mesh dim stays node-local); rank ``i`` runs in
bundle ``plan.bundle_of_rank[i]`` and rank 0's address is everyone's rendezvous.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import nodes, placement
from .worker import TrainWorker

__all__ = ["WorkerGroup", "worker_name"]


def worker_name(job_id: str, rank: int) -> str:
    return f"hp:{job_id}:rank{rank}"


class WorkerGroup:
    """One job's placement group and workers; ``gpus`` per worker is decided by the coordinator
    once per job (``ResourcesSpec.gpus_per_worker``)."""

    READY_WAIT_S = 2.0  # one wait for the placement group, between checks of stop and deadline

    def __init__(self, job_id: str, coordinator):
        self.job_id = job_id
        self.coordinator = coordinator  # the handle the workers report to (never a name another may hold)
        self.gpus = 0
        self.workers: list = []
        self.placement: list[dict] = []  # rank -> node of the current attempt
        self._pg = None
        self._plan: placement.PlacementPlan | None = None

    # ---- the placement group -------------------------------------------------------------
    def reserve(self, spec, wait_s: float | None, give_up: Callable[[], bool], on_wait: Callable[[str], None]) -> bool:
        """The placement group of ``spec``'s workers, placed: waiting forever (``wait_s`` None) or
        ``wait_s`` seconds; False when ``give_up()`` (a stop) or the time ran out. ``on_wait``
        gets what it waits for (``"N x {resources}"``), once, if it has to wait."""
        plan = placement.plan_placement(spec, self.gpus)
        pg = placement_group([dict(b) for b in plan.bundles], strategy=plan.strategy, name=f"hp:{self.job_id}")
        deadline = None if wait_s is None else time.monotonic() + wait_s
        announced = False
        while not ray.wait([pg.ready()], timeout=self.READY_WAIT_S)[0]:
            if give_up() or (deadline is not None and time.monotonic() > deadline):
                remove_placement_group(pg)
                return False
            if not announced:
                announced = True
                groups = f" in groups of {plan.group_size} per node" if plan.group_size > 1 else ""
                on_wait(f"{spec.resources.workers} x {plan.worker}{groups}")
        self._pg, self._plan = pg, plan
        return True

    def release(self) -> None:
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    # ---- the workers -----------------------------------------------------------------------
    def start(self, attempt_spec, reported_up_to: int) -> str:
        """One worker per rank in its bundle, started on ``attempt_spec`` with rank 0's address
        as the rendezvous; returns what the RUNNING message says. Ray's errors propagate."""
        n = attempt_spec.resources.workers
        self.workers = [
            TrainWorker.options(
                name=worker_name(self.job_id, i),
                num_cpus=attempt_spec.resources.cpus_per_worker,
                num_gpus=self.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=self._plan.bundle_of_rank[i]
                ),
            ).remote(self.job_id, i, n, self.coordinator)
            for i in range(n)
        ]
        addresses = ray.get([w.address.remote() for w in self.workers], timeout=300)
        self._record_placement(addresses)
        master_addr, master_port = addresses[0].ip, addresses[0].port
        ray.get(
            [w.start.remote(attempt_spec, master_addr, master_port, reported_up_to) for w in self.workers], timeout=300
        )
        return f"{n} workers on {len({a.node_id for a in addresses})} node(s), rendezvous {master_addr}:{master_port}"

    def _record_placement(self, addresses) -> None:
        known = nodes.nodes()
        self.placement = [
            {
                "rank": a.rank,
                "node_id": a.node_id,
                "node_ip": a.ip,
                "node": nodes.describe(a.node_id, known),
                "bundle": self._plan.bundle_of_rank[a.rank],
                "pid": a.pid,
            }
            for a in addresses
        ]

    def poll(self, timeout_s: float) -> list:
        """Every worker's ``WorkerPoll``; Ray's errors propagate (a dead worker, a timeout)."""
        return ray.get([w.poll.remote() for w in self.workers], timeout=timeout_s)

    def request_stop(self) -> None:
        ray.get([w.request_stop.remote() for w in self.workers])

    def stacks(self) -> list[str]:
        """Each rank's Python stacks (the watchdog's log), or why a rank has none."""
        texts = []
        for w in self.workers:
            try:
                texts.append(ray.get(w.stacks.remote(), timeout=10))
            except Exception as e:  # a dead rank has no stacks to give
                texts.append(f"(no stacks: {type(e).__name__})")
        return texts

    def lost_nodes(self) -> tuple[str, ...]:
        """The nodes of this attempt's workers that the cluster has lost."""
        return tuple(nodes.lost([p["node_id"] for p in self.placement]))

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    def teardown(self) -> None:
        self.kill()
        self.release()
