"""Pipeline parallelism (torch's ``torch.distributed.pipelining`` names), built in steps.

Built: the schedules as pure, inspectable per-rank action lists (``compute_order``: GPipe, 1F1B,
interleaved 1F1B, zero-bubble ZB-H1), their transfers (``with_communication``) and a simulator
that proves each runs (every micro-batch forwarded and backwarded once per stage, every send
received, no deadlock) and times its bubble (``simulate``). Not built yet: ``PipelineStage`` and
the schedule classes that run these actions on real ranks, model splitting, and ``parallelism.pp``
in the job spec (refused there until then).
"""

from ._actions import Action, ComputationType
from ._orders import SCHEDULES, compute_order, stage_rank
from ._simulate import ScheduleError, Timeline, simulate, with_communication

__all__ = [
    "SCHEDULES",
    "Action",
    "ComputationType",
    "ScheduleError",
    "Timeline",
    "compute_order",
    "simulate",
    "stage_rank",
    "with_communication",
]
