"""Mixture-of-experts upkeep, a post-optimizer hook: after each optimizer step, the step's expert
loads, the routing biases moved toward balance (``bias_update_rate``), and the MoE metrics.

A model with MoE layers declares it by having them (``hpservice.models.moe.moe_layers``); the
trainer runs every post-optimizer hook after ``optimizer.step()`` and adds what it returns to the
step's record.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.models.moe import dropped_pairs, expert_loads, mean_aux_loss, moe_layers, update_expert_biases
from hpservice.parallel import ParallelDims

__all__ = ["MoEUpkeep", "PostOptimizerHook", "build_post_optimizer_hooks"]


class PostOptimizerHook:
    """Runs after each optimizer step; returns metrics for the step's record."""

    def __call__(self) -> dict:
        raise NotImplementedError


class MoEUpkeep(PostOptimizerHook):
    """``expert_load`` (layer -> tokens per expert, summed over the ranks that saw other tokens),
    ``expert_imbalance`` (the largest max / mean load of a layer), ``moe_aux_loss`` (this rank's)
    and ``moe_dropped`` (with a capacity factor: the (token, expert) pairs dropped, over all layers
    and data ranks). Under pipeline parallelism every stage's layers, gathered over the pp ranks
    (a stage of dense blocks contributes none)."""

    def __init__(self, layers: dict, dims: ParallelDims, bias_update_rate: float):
        self.layers, self.dims, self.bias_update_rate = layers, dims, bias_update_rate

    def _sum_over_token_ranks(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the ranks that see other tokens (data-parallel and context-
        parallel; tensor-parallel ranks see the same ones)."""
        if dist.get_world_size() == 1:
            return
        for name in self.dims.fsdp_dim_names:
            dist.all_reduce(t, group=self.dims.world_mesh[name].get_group())

    def __call__(self) -> dict:
        loads = expert_loads(self.layers, reduce=self._sum_over_token_ranks)
        if self.bias_update_rate:
            update_expert_biases(self.layers, loads, self.bias_update_rate)
        aux = mean_aux_loss(self.layers)
        dropped = dropped_pairs(self.layers, reduce=self._sum_over_token_ranks)
        if self.dims.pp > 1:
            stages = [None] * self.dims.pp
            dist.all_gather_object(stages, (loads, aux, dropped), group=self.dims.pp_mesh.get_group())
            loads = dict(sorted(((k, v) for stage in stages for k, v in stage[0].items()), key=lambda kv: int(kv[0])))
            auxes, drops = [s[1] for s in stages if s[1] is not None], [s[2] for s in stages if s[2] is not None]
            aux, dropped = (sum(auxes) if auxes else None), (sum(drops) if drops else None)
        record = {"expert_load": loads}
        if loads:
            record["expert_imbalance"] = max(max(row) / max(sum(row) / len(row), 1e-9) for row in loads.values())
        if aux is not None:
            record["moe_aux_loss"] = aux
        if dropped is not None:
            record["moe_dropped"] = dropped
        return record


def build_post_optimizer_hooks(
    model: nn.Module, model_parts: list[nn.Module], dims: ParallelDims, *, microbatches: int, bias_update_rate: float
) -> list[PostOptimizerHook]:
    """The hooks the model declares. ``model``: the whole (meta) model, which says whether any
    stage has MoE layers (every pp rank joins the gather); ``microbatches``: how many micro-batch
    backwards a step's aux loss gradient is spread over (1 in a pipeline, which divides its own)."""
    layers = {k: v for part in model_parts for k, v in moe_layers(part).items()}
    for layer in layers.values():
        layer.aux_loss_scale = 1.0 / microbatches
    if not layers and not moe_layers(model):
        return []
    return [MoEUpkeep(layers, dims, bias_update_rate)]
