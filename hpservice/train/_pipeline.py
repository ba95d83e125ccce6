"""Pipeline parallelism in the trainer: this rank's stages of the meta model, the schedule over
them (``parallelism.pp_schedule``), and sequence-parallel activations between stages."""

from __future__ import annotations

import torch
import torch.nn as nn

from hpservice.dtensor import DeviceMesh, DTensor, Shard
from hpservice.parallel.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    split_model,
)
from hpservice.spec import JobSpec

from ._errors import TrainingError

__all__ = ["PIPELINE_SCHEDULES", "apply_pp", "build_pipeline_schedule", "pass_local_shards_between_stages"]


PIPELINE_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


def apply_pp(model: nn.Module, pp_rank: int, spec: JobSpec, bundle) -> list[tuple[int, nn.Module]]:
    """This pp rank's stages of the (meta) model: ``(stage_index, module)``, split by blocks
    (``hpservice.parallel.pipelining.split_model``) with the bundle's ``pipeline_stage``, each
    still on the meta device."""
    p = spec.parallelism
    if bundle.pipeline_stage is None:
        raise TrainingError(
            f"parallelism.pp > 1: the model {bundle.name} declares no pipeline split (a ModelSpec's "
            "pipeline_stage, or a custom model's keep_stage(layers, first=, last=) method over blocks in .layers)"
        )
    try:
        return split_model(model, pp_rank, p.pp, p.pp_virtual_stages, p.pp_layers_per_stage, bundle.pipeline_stage)
    except ValueError as e:
        raise TrainingError(str(e)) from e


def pass_local_shards_between_stages(model: nn.Module, tp_mesh: DeviceMesh, *, first: bool, last: bool) -> None:
    """Sequence parallelism under pp: inside a stage the hidden states are DTensors sharded on the
    sequence over tp (``Shard(1)``); between stages each tp rank sends its own piece to the same tp
    rank of the next stage, a plain tensor, and the next stage wraps it again. Both conversions are
    differentiable, so the gradients go back the same way."""
    if not first:
        model.register_forward_pre_hook(
            lambda _module, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)]), *args[1:])
        )
    if not last:
        model.register_forward_hook(lambda _module, _args, out: out.to_local() if isinstance(out, DTensor) else out)


def build_pipeline_schedule(stages: list[tuple[int, nn.Module]], spec: JobSpec, device: torch.device, group, loss_fn):
    """The schedule (``parallelism.pp_schedule``) over this rank's ``(stage_index, module)``
    stages, with ``loss_fn`` on the last; its micro-batches are ``pp_microbatches x
    training.grad_accum``."""
    p, accum = spec.parallelism, spec.training.grad_accum
    pipeline_stages = [PipelineStage(part, s, p.pp * p.pp_virtual_stages, device, group=group) for s, part in stages]
    try:
        return PIPELINE_SCHEDULES[p.pp_schedule](pipeline_stages, p.microbatches(accum), loss_fn=loss_fn)
    except ValueError as e:
        raise TrainingError(
            f"parallelism.pp_schedule {p.pp_schedule} with pp_microbatches x training.grad_accum = "
            f"{p.microbatches(accum)}: {e}"
        ) from e
