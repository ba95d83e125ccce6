"""The actions a pipeline schedule is made of, with torch's names (``torch.distributed.pipelining``'s
``_ComputationType`` and ``_Action``).

A schedule is, for each pp rank, a list of ``Action(stage, kind, microbatch)``: run the forward
of micro-batch ``m`` on stage ``s`` (``F``), its whole backward (``B``), or a backward split in two
as zero-bubble schedules do, the input gradient (``I``: what the previous stage waits for) and the
weight gradient (``W``: nobody waits for it, so it can fill a bubble); and the point-to-point
transfers between stages (``SEND_F``/``RECV_F`` carry activations forward, ``SEND_B``/``RECV_B``
gradients backward). ``str(action)`` is torch's compact form: ``0F1``, ``1I0``, ``2SEND_F3``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["COMPUTE", "Action", "ComputationType"]


class ComputationType(enum.Enum):
    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


F, B, I, W = (  # noqa: E741 (torch's one-letter names)
    ComputationType.FORWARD,
    ComputationType.FULL_BACKWARD,
    ComputationType.BACKWARD_INPUT,
    ComputationType.BACKWARD_WEIGHT,
)
SEND_F, RECV_F, SEND_B, RECV_B = (
    ComputationType.SEND_F,
    ComputationType.RECV_F,
    ComputationType.SEND_B,
    ComputationType.RECV_B,
)
COMPUTE = (F, B, I, W)


@dataclass(frozen=True)
class Action:
    stage: int
    kind: ComputationType
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__
