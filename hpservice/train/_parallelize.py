"""Laying a (meta) model or pipeline stage out on this rank's mesh, as torchtitan's
``parallelize`` does, in its order: tensor parallelism (the family's plan), expert parallelism,
activation checkpointing and compile, then fully_shard over the data-parallel dims (the experts
first, over their own groups). Every decision reads ``ParallelDims`` and the spec; nothing here
allocates but the final ``to_empty`` of a layout without fully_shard.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hpservice.dtensor import DeviceMesh
from hpservice.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from hpservice.models import ModelSpec
from hpservice.models.lora import LoRALinear
from hpservice.models.moe import moe_layers
from hpservice.parallel import ParallelDims
from hpservice.parallel.expert_parallel import apply_ep
from hpservice.spec import JobSpec
from hpservice.spec.composition import refusal

from ._activation_checkpointing import apply_activation_checkpointing
from ._compile import apply_compile
from ._errors import TrainingError
from ._pipeline import pass_local_shards_between_stages

__all__ = ["apply_expert_fsdp", "apply_fsdp", "apply_tp", "parallelize"]


def _fsdp_policies(spec: JobSpec) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    p = spec.parallelism
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[p.mixed_precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    return mp, CPUOffloadPolicy() if p.cpu_offload else OffloadPolicy()


def apply_expert_fsdp(model: nn.Module, dims: ParallelDims, spec: JobSpec) -> None:
    """fully_shard each expert-parallel ``GroupedExperts`` over the ranks that hold the same
    experts (``dp_shard_mod_ep``, with ``dp_replicate``: HSDP), torchtitan's ``dp_shard_mod_ep``:
    their ``Shard(0)`` pieces on the ep mesh are sharded again on a dim ep leaves whole. Their
    gradients hold the ep group's tokens' contributions: the reduce divides by the whole
    data-parallel size (``set_gradient_divide_factor``), the mean every other parameter gets."""
    from hpservice.models.moe import GroupedExperts

    names = ("dp_replicate", "dp_shard_mod_ep") if dims.dp_replicate > 1 else ("dp_shard_mod_ep",)
    mesh = dims.expert_mesh[names]
    mp, offload = _fsdp_policies(spec)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
            module.set_gradient_divide_factor(dims.dp_size)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, spec: JobSpec) -> None:
    """fully_shard each block (``model.layers``, where the model has them), then the root
    (embeddings, final norm, head: everything not in a block). With ``reshard_after_forward`` the
    last block still keeps its parameters after forward, as torchtitan does: backward starts with
    it, so freeing them would only gather them again. A model without ``layers`` is one group:
    correct, but its whole unsharded size is gathered at once."""
    p = spec.parallelism
    mp, offload = _fsdp_policies(spec)
    # QLoRA: the adapted layers' frozen weights are left to the model build, which quantises them to
    # NF4 (~0.52 bytes a weight) and keeps each rank's rows (models/lora.py: shard_base_nf4).
    ignored = None
    if spec.model.lora is not None and spec.model.lora.quantize_base == "nf4":
        ignored = {m.weight for m in model.modules() if isinstance(m, LoRALinear)}
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers) if layers is not None else []
    for i, block in enumerate(blocks):
        reshard = p.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)


def apply_tp(model: nn.Module, mesh: DeviceMesh, spec: JobSpec, bundle: ModelSpec) -> None:
    """Tensor parallelism on the 1-d "tp" mesh: the plan the family's bundle declares
    (``ModelSpec.parallelize``; the decoders': ``apply_llama_tp``). On a meta-device model it only
    records layouts: each rank later allocates its pieces."""
    if bundle.parallelize is None:
        raise TrainingError(
            f"parallelism.tp > 1 needs a tensor-parallel plan, and {bundle.name} has none (a built-in family declares "
            "it in its ModelSpec; a custom model brings a parallelize(tp_mesh, sequence_parallel=...) method)"
        )
    try:
        bundle.parallelize(model, mesh, spec.parallelism.sequence_parallel)
    except ValueError as e:
        raise TrainingError(str(e)) from e


def parallelize(
    model: nn.Module,
    bundle: ModelSpec,
    dims: ParallelDims,
    spec: JobSpec,
    device: torch.device,
    *,
    first: bool,
    last: bool,
) -> nn.Module:
    """``model`` (the whole model or a pipeline stage, on the meta device) laid out on this
    rank's mesh: tp (the plan of the family's ``bundle``), ep, activation checkpointing and compile, fully_shard (or, with tp alone,
    allocated as it is). ``first`` / ``last``: whether it is the pipeline's first / last stage."""
    if dims.tp > 1:
        apply_tp(model, dims.tp_mesh, spec, bundle)
        if spec.parallelism.sequence_parallel and not (first and last):
            pass_local_shards_between_stages(model, dims.tp_mesh, first=first, last=last)
    if dims.ep > 1:  # each layer's experts split over the ep ranks
        try:
            apply_ep(model, dims.expert_mesh["ep"])
        except ValueError as e:
            raise TrainingError(f"parallelism.ep {dims.ep}: {e}") from e
    try:  # after tp, before fully_shard (torchtitan's order)
        apply_activation_checkpointing(model, spec)
        if spec.training.compile:
            # ring attention, mixture-of-experts layers and tensor-parallel boundaries (DTensor
            # from_local / redistribute / to_local) run eagerly between compiled parts
            eager_parts = dims.cp > 1 or moe_layers(model) or dims.tp > 1
            apply_compile(model, fullgraph=not eager_parts)
    except ValueError as e:
        raise TrainingError(str(e)) from e
    if dims.dp_mesh is not None:
        if dims.ep > 1:  # first: the blocks' fully_shard then leaves the experts to these groups
            apply_expert_fsdp(model, dims, spec)
        apply_fsdp(model, dims.dp_mesh, spec)
        for module in model.modules():  # what fully_shard left alone (QLoRA's base weights): allocated whole
            for name, param in list(module.named_parameters(recurse=False)):
                if param.is_meta:
                    module.register_parameter(
                        name, nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                    )
    else:  # tp alone: allocate each rank's pieces (the styles re-install their gradient hooks)
        if spec.parallelism.mixed_precision != "none" or spec.parallelism.cpu_offload:
            raise TrainingError(refusal("fsdp_options_without_dp"))
        model.to_empty(device=device)
    return model
