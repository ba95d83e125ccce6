"""The job vocabulary, written once: a job's states, the CLI's exit codes, the end-of-run summary's numbers.

Every layer takes these from here: the coordinator actor (which moves a job between states),
the store and the supervisor, the client and the CLI, and the web page (through
``GET /v1/job-states``). States are ``StrEnum`` members, so they are stored, sent and compared
as the plain strings they have always been.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, NotRequired

from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12


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
    _S.CANCELLING: frozenset({_S.CANCELLING, _S.SUCCEEDED}),  # SUCCEEDED: the stop came after the last step
    _S.PREEMPTED: frozenset({_S.PREEMPTED, _S.STARTING}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}
for _state in ACTIVE_STATES:
    TRANSITIONS[_state] |= {_S.QUEUED, _S.FAILED, _S.CANCELLED}
    # a launched job may be preempted in any live state, its stop handled wherever it lands
    # (waiting for its placement group, starting, mid-restart, running): never a state with no way out
    TRANSITIONS[_state] |= {_S.PREEMPTED}


# ---- the job record: one declaration, from the coordinator through the store to the wire -------

# "from" is a keyword, so the functional form
Resize = TypedDict("Resize", {"from": int, "to": int, "reason": str, "grad_accum": int})
Resize.__doc__ = """An elastic resize of the worker group (``grad_accum``: the attempt's gradient
accumulation; the global batch stays)."""


class HistoryEntry(TypedDict):
    """One move of the job: its state, when, why; a resize carries what changed."""

    state: str
    time: float
    message: str
    resize: NotRequired[Resize]


class RankPlacement(TypedDict):
    """Where one rank of the current attempt runs."""

    rank: int
    node_id: str
    node_ip: str
    node: str  # short id and address, for people
    bundle: int  # its placement-group bundle (one per shard group under placement shard_group)
    pid: int


@dataclasses.dataclass(kw_only=True)
class JobRecord:
    """A job as every layer carries it, declared once (skypilot's API server carries one request
    record from its database to the wire the same way): the coordinator fills the run's side
    (``Coordinator.status``), the store adds the submission's side and maps the record to and
    from its row (``JobRow.from_record`` / ``to_record``), and the API's ``JobOut`` is made from
    these fields (``api/schemas.py``). A new field is added here, then given a column.

    Entries are plain dicts (``TypedDict``s) so that every layer reads them as it always has;
    ``to_dict`` is what crosses process boundaries and the wire."""

    id: str
    name: str
    owner: str = ""  # the submission's side: the store's
    state: str  # a JobState
    message: str = ""
    step: int = 0  # the latest step trained
    total_steps: int = 0
    restarts: int = 0
    restart_reasons: list[str] = dataclasses.field(default_factory=list)
    created_at: float = 0.0  # the store's
    updated_at: float = 0.0  # the store's
    history: list[HistoryEntry] = dataclasses.field(default_factory=list)
    checkpoints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    placement: list[RankPlacement] = dataclasses.field(default_factory=list)  # empty until the workers start
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)  # the store's: the spec it runs

    STORE_SIDE: typing.ClassVar[tuple[str, ...]] = ("owner", "created_at", "updated_at", "spec")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def run_side(self) -> dict[str, Any]:
        """What a coordinator reports: every field but the store's (``STORE_SIDE``)."""
        return {k: v for k, v in self.to_dict().items() if k not in self.STORE_SIDE}

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """Each field's type, resolved (the API builds ``JobOut`` from them)."""
        hints = typing.get_type_hints(cls, globalns=globals())
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


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
