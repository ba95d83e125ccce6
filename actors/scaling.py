"""Elastic scaling of one job (Ray Train v2's ``ScalingPolicy``): how many workers it runs now,
the sizes it may shrink to when a node is lost and the cluster has no room for every worker, and
when it may grow back.

It decides sizes; the coordinator acts on them (reserves, restarts, says so in the history).
Sizes come from the spec (``resources.min_workers``, ``JobSpec.elastic_sizes``: sizes the
layout and the global batch still divide into); a resize keeps the global batch, changing
``grad_accum`` (``JobSpec.resized``).
"""

from __future__ import annotations

import time

import ray

from . import nodes, placement

__all__ = ["ElasticScaling"]


class ElasticScaling:
    ROOM_CHECK_S = 2.0  # how often a shrunk job looks for room to grow back

    def __init__(self, spec):
        self.spec = spec
        self.size = spec.resources.workers  # workers now (fewer after a shrink)
        self.resizes: list[dict] = []
        self._room_seen_at: float | None = None  # when room for every worker was first seen while shrunk
        self._room_checked_at = 0.0

    @property
    def shrunk(self) -> bool:
        return self.size < self.spec.resources.workers

    def smaller_sizes(self) -> list[int]:
        """The sizes below the current one a job may shrink to, largest first."""
        return [n for n in self.spec.elastic_sizes() if n < self.size]

    def resize(self, workers: int, reason: str) -> tuple[dict, str]:
        """Take ``workers`` as the size: the history entry's ``resize`` details and its message."""
        old, self.size = self.size, workers
        self._room_seen_at = None
        spec = self.spec.resized(workers)
        resize = {"from": old, "to": workers, "reason": reason, "grad_accum": spec.training.grad_accum}
        self.resizes.append({"time": time.time(), **resize})
        message = (
            f"resized {old} -> {workers} workers: {reason} (global batch {spec.data.global_batch}, "
            f"grad_accum {spec.training.grad_accum})"
        )
        return resize, message

    def attempt_started(self) -> None:
        """Room seen before an attempt started does not count for growing it back."""
        self._room_seen_at = None

    def grow_ready(self, gpus: int, checkpoint_times: list[float]) -> bool:
        """While shrunk: True once room for every worker has come back and a checkpoint was
        committed after that (the grow resumes from it). Looks every ``ROOM_CHECK_S``."""
        if not self.shrunk or time.monotonic() - self._room_checked_at < self.ROOM_CHECK_S:
            return False
        self._room_checked_at = time.monotonic()
        if self._room_seen_at is None:
            missing = self.spec.resources.workers - self.size
            one = placement.worker_resources(self.spec, gpus)
            free = ray.available_resources()
            full = placement.plan_placement(self.spec, gpus)
            room = all(free.get(k, 0) + 1e-9 >= v * missing for k, v in one.items())
            if room and placement.infeasible(full, nodes.alive_resources(), self.spec) is None:
                self._room_seen_at = time.time()
            return False
        return any(t > self._room_seen_at for t in checkpoint_times)
