"""Expert parallelism: each mixture-of-experts layer's experts split over the ep ranks, the routed
tokens exchanged with all-to-all (torchtitan's ``ExpertParallel``, applied to ``GroupedExperts``).

Layout: the experts' stacked weights (``w1``, ``w2``, ``w3``, ``[E, ...]``) become ``Shard(0)``
DTensors on the 1-d ep mesh: rank r holds experts ``r * E/ep .. (r+1) * E/ep - 1``. Everything
else in the layer (router, shared experts) is a data-parallel parameter like any other.

One forward of the experts on an ep rank, between the router (local) and the combine (local)::

    x [N, dim]: this rank's (token, expert) rows, sorted by expert; counts [E]
    all-to-all counts          -> how many rows each rank sends to each of my experts
    all-to-all rows            -> rows for my experts, grouped by source rank, then expert
    regroup by local expert    -> GroupedExperts on E/ep experts (its own weights, local)
    undo the regrouping, all-to-all back (split sizes swapped) -> x's rows, in x's order

The row exchanges are differentiable (``all_to_all``: the backward is the all-to-all with the
split sizes swapped). Each rank's expert gradients then hold the contributions of its ep group's
tokens. The trainer fully_shards the experts over the ranks holding the same ones (the expert
data-parallel ranks, ``dp_shard_mod_ep``; ``apply_expert_fsdp``), whose reduce sums those and
divides by the whole data-parallel size: the mean fully_shard takes for every other parameter,
so the step equals one process's on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..dtensor import DeviceMesh, Shard
from .style import ParallelStyle, _distribute_param, _grad_hooks_pre_forward

__all__ = ["ExpertParallel", "all_to_all", "apply_ep"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rank r sends rows ``x[sum(in_splits[:j]) : ...]`` to rank j and receives ``out_splits[j]``
    rows from each rank j, in rank order (``all_to_all_single`` with variable split sizes);
    differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallel(ParallelStyle):
    """Split a ``GroupedExperts`` over the 1-d ep mesh (see the module doc)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"ExpertParallel: expected a 1-d mesh, got {device_mesh}")
        ep = device_mesh.size()
        if module.num_experts % ep:
            raise ValueError(f"expert parallelism: ep ({ep}) must divide the layer's experts ({module.num_experts})")
        for name in ("w1", "w2", "w3"):
            _distribute_param(module, name, device_mesh, Shard(0))
        module.register_forward_pre_hook(_grad_hooks_pre_forward)
        group = device_mesh.get_group()
        state = {}
        module.register_forward_pre_hook(lambda m, args: _dispatch(args, ep, group, state))
        module.register_forward_hook(lambda m, args, out: _combine(out, group, state))
        return module


def _dispatch(args: tuple, ep: int, group, state: dict) -> tuple:
    x, counts = args
    local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)  # [source rank, my expert]
    send = counts.view(ep, local).sum(1).tolist()
    recv = received.view(ep, local).sum(1).tolist()
    rows = all_to_all(x, recv, send, group)
    expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received)
    order = expert_of_row.argsort(stable=True)  # (source, expert) blocks -> grouped by expert
    state.update(order=order, send=send, recv=recv)
    return rows[order], received.view(ep, local).sum(0)


def _combine(out: torch.Tensor, group, state: dict) -> torch.Tensor:
    rows = out.index_select(0, state["order"].argsort())  # back to (source, expert) order
    return all_to_all(rows, state["send"], state["recv"], group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """``ExpertParallel`` on every mixture-of-experts layer of ``model`` (on the meta device it
    only records the layout)."""
    from hpservice.models.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("parallelism.ep > 1 needs a model with mixture-of-experts layers (e.g. qwen3_moe)")
    for layer in layers:
        ExpertParallel()._apply(layer.experts, ep_mesh)
