"""Which compute action each pp rank runs, in order: the schedules as pure functions.

``compute_order(schedule, pp, microbatches, virtual_stages)`` returns ``{rank: [Action, ...]}`` with
only compute actions (``F``, ``B``, or ``I``/``W``); ``_comm.with_communication`` adds the sends
and receives, and ``_comm.simulate`` checks and times the result. Stages: ``pp x virtual_stages``
of them, stage ``s`` on rank ``s % pp`` (the loop placement of interleaved schedules: a
micro-batch goes round the ranks ``virtual_stages`` times).

- ``gpipe``: every forward, then every backward. Holds all ``m`` micro-batches' activations.
- ``1f1b``: rank ``r`` runs ``pp - 1 - r`` forwards to fill the pipeline, then alternates one
  forward and one backward, then drains. Holds at most ``pp - r`` micro-batches' activations;
  the same bubble as GPipe, ``(pp - 1) / (m + pp - 1)`` of the step.
- ``interleaved_1f1b`` (Megatron's): ``virtual_stages`` stages per rank; forwards go through the
  rank's stages in groups of ``pp`` micro-batches, so the fill and drain are ``virtual_stages``
  times shorter: bubble ``(pp - 1) / (v x m + pp - 1)``. Needs ``m`` a multiple of ``pp``.
- ``zero_bubble`` (in the manner of ZB-H1, Qi et al. 2023): each backward split into the input
  gradient (``I``, on the critical path: the previous stage waits for it) and the weight gradient
  (``W``, which nobody waits for), list-scheduled so that ``I`` goes first and ``W`` fills what
  would be idle, never holding more micro-batches than 1F1B: at pp 4 and 8 micro-batches (F, I
  and W one unit each) the step is 30 units to 1F1B's 33, bubble 0.20 to 0.27. With
  ``virtual_stages`` > 1 (torch's ``ScheduleInterleavedZeroBubble`` takes several stages per
  rank): the interleaved 1F1B order with each backward split, its ``W`` deferred past the next
  forward (or run at once where an input gradient follows: in the drain, where the rank would wait
  for the next stage's gradient). The values are those of any other order.
"""

from __future__ import annotations

from ._actions import Action, B, F, I, W

__all__ = ["SCHEDULES", "check_schedule", "compute_order", "stage_rank"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def stage_rank(stage: int, pp: int) -> int:
    """The pp rank that holds ``stage`` (loop placement)."""
    return stage % pp


def check_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """``ValueError`` naming what cannot work, when ``schedule`` cannot run with these sizes:
    arithmetic only (a job's validation runs it; nothing is built)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pp {pp}, micro-batches {microbatches}, virtual stages {virtual_stages}: each must be >= 1")
    if schedule not in ("interleaved_1f1b", "zero_bubble") and virtual_stages != 1:
        raise ValueError(f"{schedule}: one stage per rank (virtual_stages 1), got {virtual_stages}")
    if schedule in ("1f1b", "zero_bubble", "interleaved_1f1b") and microbatches < pp:
        raise ValueError(f"{schedule}: micro-batches ({microbatches}) must be >= pp ({pp}) to fill the pipeline")
    interleaved = schedule == "interleaved_1f1b" or (schedule == "zero_bubble" and virtual_stages > 1)
    if interleaved and microbatches % pp:
        what = schedule if schedule == "interleaved_1f1b" else f"{schedule} with {virtual_stages} stages per rank"
        raise ValueError(f"{what}: micro-batches ({microbatches}) must be a multiple of pp ({pp})")


def compute_order(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> dict[int, list[Action]]:
    """Each rank's compute actions for one step; raises ``ValueError`` naming what cannot work."""
    check_schedule(schedule, pp, microbatches, virtual_stages)
    if schedule == "zero_bubble" and virtual_stages > 1:
        return {rank: _split_backwards(_interleaved(rank, pp, microbatches, virtual_stages)) for rank in range(pp)}
    if schedule == "zero_bubble":
        return _zero_bubble_orders(pp, microbatches)
    build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved_1f1b": _interleaved}
    return {rank: build[schedule](rank, pp, microbatches, virtual_stages) for rank in range(pp)}


def _gpipe(rank: int, pp: int, m: int, v: int) -> list[Action]:
    return [Action(rank, F, i) for i in range(m)] + [Action(rank, B, i) for i in range(m)]


def _one_f_one_b(rank: int, pp: int, m: int, v: int) -> list[Action]:
    warmup = min(m, pp - 1 - rank)
    order = [Action(rank, F, i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [Action(rank, F, warmup + i), Action(rank, B, i)]
    order += [Action(rank, B, i) for i in range(m - warmup, m)]
    return order


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: the k-th forward of a rank is micro-batch
    ``(k // (pp v)) pp + k % pp`` on its local stage ``(k // pp) % v``; backwards go through the
    local stages in reverse. Warm-up: ``2 (pp - 1 - rank) + (v - 1) pp`` forwards."""
    total = m * v

    def forward(k: int) -> Action:
        chunk = (k // pp) % v
        return Action(chunk * pp + rank, F, (k // (pp * v)) * pp + k % pp)

    def backward(k: int) -> Action:
        chunk = v - 1 - (k // pp) % v
        return Action(chunk * pp + rank, B, (k // (pp * v)) * pp + k % pp)

    warmup = min(total, 2 * (pp - 1 - rank) + (v - 1) * pp)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def _split_backwards(order: list[Action]) -> list[Action]:
    """``order`` with each ``B`` split into ``I`` then ``W``, the ``W`` run after the forward
    that follows (the next stage waits for that forward, nobody for the ``W``), or at once when
    none follows."""
    out: list[Action] = []
    pending: Action | None = None
    for k, a in enumerate(order):
        if a.kind is B:
            out.append(Action(a.stage, I, a.microbatch))
            w = Action(a.stage, W, a.microbatch)
            if k + 1 < len(order) and order[k + 1].kind is F:
                pending = w
            else:
                out.append(w)
        else:
            out.append(a)
            if pending is not None:
                out.append(pending)
                pending = None
    return out


def _zero_bubble_orders(pp: int, m: int) -> dict[int, list[Action]]:
    """ZB-H1 by list scheduling in unit time (F, I and W one unit each, transfers free): whenever
    a rank is free it runs, in this order of preference, an input gradient whose upstream one has
    arrived (the critical path), a forward if it holds fewer than 1F1B's ``pp - rank``
    micro-batches, else a pending weight gradient (filling what would be a bubble)."""
    orders: dict[int, list[Action]] = {r: [] for r in range(pp)}
    f_done: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> when its forward ends
    i_done: dict[tuple[int, int], int] = {}
    next_f = dict.fromkeys(range(pp), 0)
    next_i = dict.fromkeys(range(pp), 0)
    pending_w: dict[int, list[int]] = {r: [] for r in range(pp)}
    held = dict.fromkeys(range(pp), 0)
    free_at = dict.fromkeys(range(pp), 0)
    t = 0
    while any(len(orders[r]) < 3 * m for r in range(pp)):
        for r in range(pp):
            if free_at[r] > t:
                continue
            i, f = next_i[r], next_f[r]
            if i < m and (r, i) in f_done and f_done[(r, i)] <= t and (r == pp - 1 or i_done.get((r + 1, i), t + 1) <= t):
                action, next_i[r] = Action(r, I, i), i + 1
                i_done[(r, i)] = t + 1
                pending_w[r].append(i)
            elif f < m and held[r] < pp - r and (r == 0 or f_done.get((r - 1, f), t + 1) <= t):
                action, next_f[r] = Action(r, F, f), f + 1
                f_done[(r, f)] = t + 1
                held[r] += 1
            elif pending_w[r]:
                action = Action(r, W, pending_w[r].pop(0))
                held[r] -= 1
            else:
                continue
            orders[r].append(action)
            free_at[r] = t + 1
        t += 1
    return orders
