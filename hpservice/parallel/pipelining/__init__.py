"""Pipeline parallelism with torch's names (``torch.distributed.pipelining``), built in steps.

Built: the schedules as pure, inspectable per-rank action lists (``compute_order``: GPipe, 1F1B,
interleaved 1F1B, zero-bubble), their transfers (``with_communication``) and a simulator that
proves each runs and times its bubble (``simulate``); and the runtime that executes them on real
ranks, ``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
``ScheduleInterleavedZeroBubble`` and torch's ``step(*args, target=, losses=)`` (and ``eval``);
splitting a model into stages by its blocks (``split_model``), which the trainer runs for
``parallelism.pp`` (``docs/pipeline.md``).
"""

from ._actions import Action, ComputationType
from ._orders import SCHEDULES, check_schedule, compute_order, stage_rank
from ._runtime import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from ._simulate import ScheduleError, Timeline, simulate, with_communication
from ._split import split_layers, split_model

__all__ = [
    "SCHEDULES",
    "Action",
    "ComputationType",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "Timeline",
    "check_schedule",
    "compute_order",
    "simulate",
    "split_layers",
    "split_model",
    "stage_rank",
    "with_communication",
]
