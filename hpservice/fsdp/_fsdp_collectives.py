"""Pure communication functions of fully_shard: one flat collective per parameter group.

Layouts (S = shard group size, C = per-rank flat shard size of the group, padded):
- all-gather: input is this rank's flat shard (C); output is rank-major (S * C): rank r's shard
  occupies [r*C, (r+1)*C). Copy-out turns it into per-parameter unsharded tensors.
- reduce-scatter: input is rank-major (S * C): block r holds, for every parameter, the gradient
  piece that rank r owns; output is this rank's block (C), summed over the shard group.
Each function issues the collective asynchronously and returns the work handle; the caller
decides when to wait, which is what lets communication overlap compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpservice.dtensor._collectives import _all_gather_single, _reduce_scatter_single

__all__ = ["all_gather_flat", "all_reduce_flat", "reduce_scatter_flat"]


def all_gather_flat(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup):
    if dist.get_world_size(group) == 1:
        out.copy_(shard)
        return None
    return _all_gather_single(out, shard, group=group, async_op=True)


def reduce_scatter_flat(flat: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup):
    """SUM reduce-scatter (averaging is done by pre/post division, which every backend has)."""
    if dist.get_world_size(group) == 1:
        out.copy_(flat)
        return None
    return _reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_reduce_flat(flat: torch.Tensor, group: dist.ProcessGroup):
    """SUM all-reduce over the replicate dim of HSDP."""
    if dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
