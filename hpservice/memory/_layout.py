"""What one rank holds of a job's model, laid out as the trainer lays it out, on the meta device.

``rank_parts(spec, pp_rank)`` is the whole model built as the trainer builds it
(``train._model.build_meta_model``: the family's converters, LoRA, the frozen names), cut to the
pp rank's stages (``train._pipeline.apply_pp``) and narrowed to one tensor-parallel rank: every
weight the family's plan splits (``parallel.plans.llama_tp_plan``: colwise on dim 0, rowwise on
dim 1, a rowwise embedding on its vocabulary rows; a LoRA adapter as ``parallel/style.py`` places
it) replaced by a meta tensor of its local shape, and each attention's head counts divided, as
``apply_llama_tp`` does. Each routed-experts module keeps ``E / ep`` experts.

``fsdp_units(part, ...)`` groups the local parameters into fully_shard's units (each block, then
the root: ``train._parallelize.apply_fsdp``; routed experts under ep their own unit over the
``dp_shard x cp / ep`` ranks holding the same experts) with each unit's padded per-rank shard size
``C`` (every parameter's dim 0 split in ``ceil(n / S)`` rows), the buffers of
``fsdp/_fsdp_param_group.py`` are counted from.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

__all__ = ["Unit", "fsdp_units", "meta_model", "rank_parts"]


@dataclasses.dataclass
class Unit:
    """One fully_shard group on one rank: ``C`` padded shard elements over ``S`` ranks."""

    name: str
    shard: int  # C: padded elements of this rank's flat shard
    real: int  # of them, the parameters' own (not padding)
    trainable: int  # real elements of trainable parameters
    largest_trainable: int  # the largest trainable parameter's real local elements
    ranks: int  # S
    trainable_whole: int = 0  # elements of the trainable parameters unsharded: their gradients' before reduction
    nf4_bytes: int = 0  # QLoRA's base weights fully_shard leaves alone (models/lora.py: shard_base_nf4)

    @property
    def unsharded(self) -> int:
        return self.shard * self.ranks


def _replace(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    old = getattr(module, name)
    module.register_parameter(name, nn.Parameter(torch.empty(shape, device="meta", dtype=old.dtype), old.requires_grad))


def _split(module: nn.Module, name: str, dim: int, tp: int) -> None:
    p = getattr(module, name, None)
    if isinstance(p, nn.Parameter) and p.dim() > dim:
        shape = list(p.shape)
        shape[dim] = math.ceil(shape[dim] / tp)
        _replace(module, name, tuple(shape))


def narrow_tp(model: nn.Module, tp: int, sequence_parallel: bool) -> None:
    """``model`` (meta) narrowed to one tensor-parallel rank's pieces (module doc)."""
    from hpservice.models.lora import LoRALinear
    from hpservice.parallel.plans import llama_tp_plan
    from hpservice.parallel.style import ColwiseParallel, RowwiseParallel

    if tp == 1:
        return
    plan = llama_tp_plan(model, tp, sequence_parallel=sequence_parallel)
    for fqn, style in plan.items():
        try:
            module = model.get_submodule(fqn)
        except AttributeError:  # a pipeline stage without this module
            continue
        lora = isinstance(module, LoRALinear)
        if isinstance(style, ColwiseParallel):
            _split(module, "weight", 0, tp)
            _split(module, "bias", 0, tp)
            if lora:
                _split(module, "lora_B", 0, tp)
        elif isinstance(style, RowwiseParallel):
            _split(module, "weight", 0 if isinstance(module, nn.Embedding) else 1, tp)
            if lora:
                _split(module, "lora_A", 1, tp)
    layers = getattr(model, "layers", None)
    for block in layers.values() if layers is not None else []:
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp


def narrow_ep(model: nn.Module, ep: int) -> None:
    from hpservice.models.moe import GroupedExperts

    if ep == 1:
        return
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, p in list(module.named_parameters(recurse=False)):
                _replace(module, name, (p.shape[0] // ep, *p.shape[1:]))
            if hasattr(module, "num_experts"):
                module.num_experts //= ep


def meta_model(spec) -> tuple[object, nn.Module, set[str]]:
    """The trainer's whole meta model of ``spec`` (``build_meta_model``): (bundle, model, frozen)."""
    from hpservice.parallel import ParallelDims
    from hpservice.train._model import build_meta_model

    return build_meta_model(spec, ParallelDims.from_spec(spec.parallelism, spec.resources.workers))


def rank_parts(spec, pp_rank: int = 0, meta=None) -> tuple[object, list[tuple[int, nn.Module]], set[str]]:
    """(the family's bundle, this pp rank's ``(stage, part)`` narrowed to one tp/ep rank on the
    meta device, the frozen parameter names); from a copy of ``meta`` (``meta_model``'s) if given."""
    import copy

    from hpservice.train._pipeline import apply_pp

    p = spec.parallelism
    bundle, whole, frozen = meta if meta is not None else meta_model(spec)
    if meta is not None:
        whole = copy.deepcopy(whole)
    stages = apply_pp(whole, pp_rank, spec, bundle) if p.pp > 1 else [(0, whole)]
    for _, part in stages:
        narrow_tp(part, p.tp, p.sequence_parallel)
        narrow_ep(part, p.ep)
    return bundle, stages, frozen


def fsdp_units(part: nn.Module, frozen: set[str], shard_ranks: int, ep: int, nf4: bool) -> list[Unit]:
    """fully_shard's units of ``part`` on one rank (module doc); ``shard_ranks`` is dp_shard x cp."""
    from hpservice.models.lora import LoRALinear
    from hpservice.models.moe import GroupedExperts

    layers = getattr(part, "layers", None)
    blocks = {f"layers.{k}" for k in (layers.keys() if isinstance(layers, nn.ModuleDict) else range(len(layers)))} if layers is not None else set()
    experts = {n for n, m in part.named_modules() if isinstance(m, GroupedExperts)} if ep > 1 else set()
    ignored = {f"{n}.weight" for n, m in part.named_modules() if isinstance(m, LoRALinear)} if nf4 else set()
    units: dict[str, Unit] = {}
    seen: set[int] = set()
    for name, param in part.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        owner = next((e for e in experts if name.startswith(e + ".")), None)
        if owner is None:
            owner = ".".join(name.split(".")[:2]) if ".".join(name.split(".")[:2]) in blocks else "root"
        ranks = max(1, shard_ranks // ep) if owner in experts else shard_ranks
        u = units.setdefault(owner, Unit(owner, 0, 0, 0, 0, ranks))
        if name in ignored:  # NF4 codes: 4 bits a weight, an 8-bit scaler per 64, an fp32 factor per 256 scalers
            n = param.numel()
            split = ranks if param.shape[0] % ranks == 0 and (n // ranks) % (64 * 256) == 0 else 1
            u.nf4_bytes += math.ceil(n / split * (0.5 + 1 / 64 + 4 / (64 * 256)))
            continue
        rows = param.shape[0] if param.dim() else 1
        rest = param.numel() // max(rows, 1)
        chunk = math.ceil(rows / ranks)
        u.shard += chunk * rest
        u.real += min(chunk, rows) * rest  # rank 0's: the fullest
        if param.requires_grad and name not in frozen:
            u.trainable_whole += param.numel()
            u.trainable += min(chunk, rows) * rest
            u.largest_trainable = max(u.largest_trainable, min(chunk, rows) * rest)
    return list(units.values())
