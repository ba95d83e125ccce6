"""The coordinator's failure policy, as an object (Ray Train v2's ``FailurePolicy``): what a failed
attempt is, and whether the job restarts from its latest checkpoint or fails.

A failure is classified when it happens:

- ``config``: the job's own spec cannot run (the trainer refused it while it was being built: a
  missing data file, a freeze pattern that matches nothing, no C++ compiler for compile, a model
  without a tensor-parallel plan). The same spec would fail the same way: the job fails at once,
  whatever ``failure.max_restarts`` says.
- ``worker``: a rank raised while training, died, stopped answering, or made no progress for the
  watchdog's limit. The job restarts from its latest checkpoint while restarts are left, after a
  back-off of 1, 2, 4, ... seconds (at most 30).
- ``node``: a node the job's workers ran on was lost (its raylet is gone). That is the cluster's
  failure, not the job's: the job waits for room on the live nodes (``failure.capacity_wait_s``)
  and resumes from its latest checkpoint without spending a restart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class FailureKind(enum.Enum):
    CONFIG = "config"
    WORKER = "worker"
    NODE = "node"


@dataclass(frozen=True)
class WorkerAddress:
    """Where one rank runs: rank 0's ip and port are the rendezvous address."""

    rank: int
    ip: str  # the node's address, the one other nodes reach
    port: int  # free on that node now
    pid: int
    node_id: str


@dataclass(frozen=True)
class WorkerPoll:
    """What one rank answers the coordinator's poll with."""

    rank: int
    step: int
    done: bool
    last_progress: float  # wall clock of the last step change
    error: str | None = None  # the traceback, if the rank's trainer raised
    config_error: bool = False  # it raised while the trainer was being built from the spec


@dataclass(frozen=True)
class AttemptFailure:
    kind: FailureKind
    reason: str
    lost_nodes: tuple[str, ...] = ()  # node ids, for a NODE failure


def failure_from_polls(polls: list[WorkerPoll]) -> AttemptFailure | None:
    """The failure the ranks' answers show, naming every rank that raised, grouped by message
    (``ranks 0, 1 raised: X; rank 2 raised: Y``); None if no rank raised."""
    failed = [p for p in polls if p.error]
    if not failed:
        return None
    by_message: dict[str, list[int]] = {}
    for p in failed:
        by_message.setdefault(p.error.strip().splitlines()[-1], []).append(p.rank)
    parts = [
        f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))} raised: {message}"
        for message, ranks in by_message.items()
    ]
    kind = FailureKind.CONFIG if any(p.config_error for p in failed) else FailureKind.WORKER
    return AttemptFailure(kind, "; ".join(parts))


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    max_backoff_s: float = 30.0

    def should_restart(self, failure: AttemptFailure, restarts_so_far: int) -> bool:
        return failure.kind is FailureKind.WORKER and restarts_so_far < self.max_restarts

    def backoff_s(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1-based)."""
        return min(self.max_backoff_s, 2.0 ** (restart - 1))

    def failed_message(self, failure: AttemptFailure) -> str:
        if failure.kind is FailureKind.CONFIG:
            return f"the job's spec cannot run (not retried): {failure.reason}"
        return failure.reason


def preemption_after_stop(already_stopping: bool, preempted_by: str | None, asked: str | None) -> str | None:
    """Whether a run asked to stop ends PREEMPTED (the reason) or CANCELLED (None), after one
    more stop request ``asked`` (a preemption's reason, or None for a cancel): a cancel always
    wins, and a preemption asked after a cancel never turns it into a requeue."""
    if asked is None:
        return None
    return preempted_by if already_stopping else asked


class AttemptEnd(NamedTuple):
    """How an attempt whose ranks are all done ends: ``finished`` (it trained every step) or
    ``stopped`` (a stop request ended it earlier)."""

    finished: bool
    step: int


def attempt_end(polls: list[WorkerPoll], steps: int) -> AttemptEnd | None:
    """None while any rank still trains. A run that reached its last step *finished*, whether or
    not a stop (cancel, preemption) was asked meanwhile: the stop came too late to take effect,
    and a finished job is not resumed or cancelled. Only an attempt that stopped short of
    ``steps`` was stopped."""
    if not all(p.done for p in polls):
        return None
    step = max(p.step for p in polls)
    return AttemptEnd(step >= steps, step)
