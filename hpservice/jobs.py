"""The job vocabulary, written once: a job's states, the CLI's exit codes, the end-of-run summary's numbers.

Every layer takes these from here: the coordinator actor (which moves a job between states),
the store and the supervisor, the client and the CLI, and the web page (through
``GET /v1/job-states``). States are ``StrEnum`` members, so they are stored, sent and compared
as the plain strings they have always been.
"""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    QUEUED = "QUEUED"  # accepted, waiting for its turn or for resources
    STARTING = "STARTING"  # placement group ready, the first attempt's workers starting
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"  # an attempt failed; the next one starts from the latest checkpoint
    CANCELLING = "CANCELLING"  # asked to stop: finishing the step, checkpointing
    PREEMPTED = "PREEMPTED"  # stopped after a checkpoint for a higher-priority job; queued to resume from it
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES

    def can_become(self, other: JobState) -> bool:
        """Whether a job in this state may move to ``other`` (``TRANSITIONS``); staying in a
        live state with a new message is a move too."""
        return JobState(other) in TRANSITIONS[self]


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = tuple(s for s in JobState if s not in TERMINAL_STATES)
WAITING_STATES = (JobState.QUEUED, JobState.PREEMPTED)  # not launched: the queue decides when they start
# where one coordinator's run ends: the job's end, or a preemption (a new coordinator resumes it)
COORDINATOR_ENDS = TERMINAL_STATES | {JobState.PREEMPTED}

_S = JobState
# Every move a job can make. A live job may always fail or be cancelled (its coordinator or its
# cluster can be lost at any moment), and be requeued (QUEUED) by the server when its cluster went
# away; an ended job never moves again.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.QUEUED: frozenset({_S.QUEUED, _S.STARTING}),
    _S.STARTING: frozenset({_S.STARTING, _S.RUNNING, _S.RESTARTING}),
    _S.RUNNING: frozenset({_S.RUNNING, _S.RESTARTING, _S.CANCELLING, _S.SUCCEEDED}),
    _S.RESTARTING: frozenset({_S.RESTARTING, _S.RUNNING}),
    _S.CANCELLING: frozenset({_S.CANCELLING, _S.PREEMPTED}),
    _S.PREEMPTED: frozenset({_S.PREEMPTED, _S.STARTING}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}
for _state in ACTIVE_STATES:
    TRANSITIONS[_state] |= {_S.QUEUED, _S.FAILED, _S.CANCELLED}


class ExitCode(enum.IntEnum):
    """Exit codes of ``hpservice run``, ``python -m hpservice.train`` and of the service commands
    (``watch``, ``submit --watch``, ...); what each means is ``EXIT_CODE_TEXT``."""

    OK = 0
    FAILED = 1
    USAGE = 2
    NOT_FOUND = 3
    AUTH = 4
    SERVER = 5
    CANCELLED = 130


EXIT_CODE_TEXT = {
    ExitCode.OK: "success (run, watch, submit --watch: the job SUCCEEDED)",
    ExitCode.FAILED: "the job FAILED",
    ExitCode.USAGE: "usage or spec error (bad job file or --url; a 4xx such as 409/422 from the server)",
    ExitCode.NOT_FOUND: "not found (404)",
    ExitCode.AUTH: "authentication or permission error (401/403)",
    ExitCode.SERVER: "server or connection error (5xx, timeout, unreachable URL)",
    ExitCode.CANCELLED: "the job was CANCELLED (or watch / logs -f was interrupted with Ctrl-C)",
}

EXIT_FOR_STATE = {JobState.SUCCEEDED: ExitCode.OK, JobState.FAILED: ExitCode.FAILED, JobState.CANCELLED: ExitCode.CANCELLED}

EXIT_CODES_HELP = "exit codes:\n" + "\n".join(f"  {code.value:<4} {text}" for code, text in EXIT_CODE_TEXT.items())


def steady_state(records: list[dict]) -> dict:
    """Averages over the run's steady state: the records after the first tenth of the steps (at
    least the first one, whose time includes warm-up: allocation, compile, first collectives).
    ``tokens_per_s`` is total tokens over total step time, not a mean of per-step rates."""
    timed = [r for r in records if isinstance(r.get("step_time_s"), int | float) and r["step_time_s"] > 0]
    if len(timed) > 1:
        timed = timed[max(1, len(timed) // 10) :]
    if not timed:
        return {}
    seconds = sum(r["step_time_s"] for r in timed)
    tokens = sum(r.get("tokens_per_s", 0) * r["step_time_s"] for r in timed)
    out = {"steps": len(timed), "tokens_per_s": tokens / seconds, "step_time_s": seconds / len(timed)}
    mfu = [r["mfu"] for r in timed if isinstance(r.get("mfu"), int | float)]
    if mfu:
        out["mfu"] = sum(mfu) / len(mfu)
    return out
