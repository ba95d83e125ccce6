"""A schedule's transfers, and a check that it runs: every rank's program executed against the
others' with blocking receives and buffered sends, in unit-free time.

``with_communication(order, pp)`` inserts, around each compute action, the receive of what it
needs from a stage on another rank (``RECV_F`` before a forward, ``RECV_B`` before a backward or
input gradient) and the send of what it produces (``SEND_F`` after a forward, ``SEND_B`` after a
backward or input gradient). Stages on the same rank hand over without a transfer.

``simulate(programs)`` runs the programs and raises ``ScheduleError`` when they cannot work: an
action whose inputs never arrive (a deadlock: each blocked rank and its action are named), a
compute action run twice or missing, a send with no matching receive. It returns the timeline:
the step's length, each rank's busy time, the bubble (idle share of ``pp x length``) and the most
micro-batches whose activations each rank holds at once (a forward holds them until its
backward, or until its weight gradient when the backward is split).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._actions import COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, W
from ._orders import stage_rank

__all__ = ["ScheduleError", "Timeline", "simulate", "with_communication"]

# Relative costs: a backward is two forwards (input and weight gradient, one each).
DEFAULT_DURATIONS = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


class ScheduleError(ValueError):
    """A pipeline schedule that cannot run as written."""


@dataclass(frozen=True)
class Timeline:
    length: float  # the step, from the first action to the last
    busy: dict[int, float]  # per rank: time spent computing
    bubble: float  # idle share of all ranks' time
    peak_activations: dict[int, int]  # per rank: most micro-batches held at once


def with_communication(order: dict[int, list[Action]], pp: int) -> dict[int, list[Action]]:
    """Each rank's program: its compute actions with the transfers they need."""
    n_stages = 1 + max((a.stage for actions in order.values() for a in actions), default=0)
    programs: dict[int, list[Action]] = {}
    for rank, actions in order.items():
        program: list[Action] = []
        for a in actions:
            s, m = a.stage, a.microbatch
            if a.kind is F:
                if s > 0 and stage_rank(s - 1, pp) != rank:
                    program.append(Action(s, RECV_F, m))
                program.append(a)
                if s < n_stages - 1 and stage_rank(s + 1, pp) != rank:
                    program.append(Action(s, SEND_F, m))
            elif a.kind in (B, I):
                if s < n_stages - 1 and stage_rank(s + 1, pp) != rank:
                    program.append(Action(s, RECV_B, m))
                program.append(a)
                if s > 0 and stage_rank(s - 1, pp) != rank:
                    program.append(Action(s, SEND_B, m))
            else:
                program.append(a)
        programs[rank] = program
    return programs


def simulate(programs: dict[int, list[Action]], pp: int, durations: dict | None = None) -> Timeline:
    """Run the programs (see the module doc); raises ``ScheduleError``."""
    cost = {**DEFAULT_DURATIONS, **(durations or {})}
    n_stages = 1 + max((a.stage for p in programs.values() for a in p), default=0)
    clock = {r: 0.0 for r in programs}
    busy = {r: 0.0 for r in programs}
    pc = {r: 0 for r in programs}
    done: dict[tuple, float] = {}  # (kind, stage, microbatch) -> when it finished
    sent: dict[tuple, float] = {}  # (direction, receiving stage, microbatch) -> when it was sent
    received: set[tuple] = set()
    held = {r: 0 for r in programs}
    peak = {r: 0 for r in programs}

    def key(kind, a: Action) -> tuple:
        return (kind, a.stage, a.microbatch)

    def grad_done(stage: int, m: int) -> float | None:
        """When the gradient of ``stage``'s input for micro-batch ``m`` exists (B or I ran)."""
        return done.get((B, stage, m), done.get((I, stage, m)))

    def ready(rank: int, a: Action) -> float | None:
        """When ``a`` can start on ``rank`` (None: not yet)."""
        s, m = a.stage, a.microbatch
        if a.kind is RECV_F:
            return sent.get(("F", s, m))
        if a.kind is RECV_B:
            return sent.get(("B", s, m))
        if a.kind is SEND_F:
            return done.get((F, s, m))
        if a.kind is SEND_B:
            return grad_done(s, m)
        if a.kind is F:
            if s == 0:
                return 0.0
            if stage_rank(s - 1, pp) == rank:
                return done.get((F, s - 1, m))
            return 0.0 if ("F", s, m) in received else None
        if a.kind in (B, I):
            if (F, s, m) not in done:
                return None
            if s == n_stages - 1:
                return done[(F, s, m)]
            if stage_rank(s + 1, pp) == rank:
                return grad_done(s + 1, m)
            return done[(F, s, m)] if ("B", s, m) in received else None
        if a.kind is W:
            return done.get((I, s, m))
        raise ScheduleError(f"unknown action {a}")

    remaining = sum(len(p) for p in programs.values())
    while remaining:
        progressed = False
        for rank, program in programs.items():
            while pc[rank] < len(program):
                a = program[pc[rank]]
                at = ready(rank, a)
                if at is None:
                    break
                start = max(clock[rank], at)
                if a.kind in COMPUTE:
                    if key(a.kind, a) in done:
                        raise ScheduleError(f"rank {rank}: {a} runs twice")
                    end = start + cost[a.kind]
                    busy[rank] += cost[a.kind]
                    done[key(a.kind, a)] = end
                    if a.kind is F:
                        held[rank] += 1
                        peak[rank] = max(peak[rank], held[rank])
                    elif a.kind in (B, W):
                        held[rank] -= 1
                    clock[rank] = end
                elif a.kind in (SEND_F, SEND_B):
                    direction = "F" if a.kind is SEND_F else "B"
                    to = a.stage + 1 if a.kind is SEND_F else a.stage - 1
                    if (direction, to, a.microbatch) in sent:
                        raise ScheduleError(f"rank {rank}: {a} sent twice")
                    sent[(direction, to, a.microbatch)] = start
                    clock[rank] = start
                else:
                    direction = "F" if a.kind is RECV_F else "B"
                    received.add((direction, a.stage, a.microbatch))
                    clock[rank] = start
                pc[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = ", ".join(f"rank {r} at {programs[r][pc[r]]}" for r in programs if pc[r] < len(programs[r]))
            raise ScheduleError(f"deadlock: {blocked} wait for what never comes")

    microbatches = {a.microbatch for p in programs.values() for a in p}
    for s in range(n_stages):
        for m in microbatches:
            if (F, s, m) not in done:
                raise ScheduleError(f"stage {s}: no forward of micro-batch {m}")
            if ((B, s, m) in done) == ((I, s, m) in done) or ((I, s, m) in done) != ((W, s, m) in done):
                raise ScheduleError(f"stage {s}: micro-batch {m} needs one backward (B, or I and W)")
    unmatched = set(sent) - received
    if unmatched:
        raise ScheduleError(f"sends nobody receives: {sorted(unmatched)}")
    length = max(clock.values(), default=0.0)
    bubble = 1.0 - sum(busy.values()) / (len(programs) * length) if length else 0.0
    return Timeline(length, busy, bubble, peak)
