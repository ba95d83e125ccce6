"""Pure communication functions of fully_shard: one flat collective per parameter group.

Layouts (S = shard group size, C = per-rank flat shard size of the group, padded):
- all-gather: input is this rank's flat shard (C); output is rank-major (S * C): rank r's shard
  occupies [r*C, (r+1)*C). Copy-out turns it into per-parameter unsharded tensors.
- reduce-scatter: input is rank-major (S * C): block r holds, for every parameter, the gradient
  piece that rank r owns; output is this rank's block (C), summed over the shard group.
Each function issues the collective asynchronously and returns the work handle; the caller
decides when to wait, which is what lets communication overlap compute.

On gloo (CPU) two collectives are issued in the form gloo runs fastest, measured with
``bench fsdp`` on 2 ranks: its ``reduce_scatter_tensor`` took 2.3x as long as an all-reduce of
the same input (5.5 ms vs 2.4 ms for 4.7 MB), so the reduce-scatter is an all-reduce of the
rank-major input followed by a copy of this rank's block; its ``all_gather_into_tensor`` is slower
than the list form writing into the output's rank-major blocks (2.0-2.4 ms vs 1.6 ms). Values are
the same (the sum over ranks of each block); NCCL keeps the native collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpservice.dtensor._collectives import _all_gather_single, _reduce_scatter_single

__all__ = ["all_gather_flat", "all_reduce_flat", "reduce_scatter_flat"]


def _is_gloo(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


class _ThenCopy:
    """A work handle whose ``wait`` also copies the collective's result where the caller wants it."""

    def __init__(self, work, src: torch.Tensor, dst: torch.Tensor):
        self.work, self.src, self.dst = work, src, dst

    def wait(self) -> bool:
        self.work.wait()
        self.dst.copy_(self.src)
        return True


def all_gather_flat(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup):
    size = dist.get_world_size(group)
    if size == 1:
        out.copy_(shard)
        return None
    if _is_gloo(group):
        return dist.all_gather(list(out.chunk(size)), shard, group=group, async_op=True)
    return _all_gather_single(out, shard, group=group, async_op=True)


def reduce_scatter_flat(flat: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup):
    """SUM reduce-scatter (averaging is done by pre/post division, which every backend has).
    On gloo ``flat`` is summed in place (it is scratch the caller refills every step)."""
    size = dist.get_world_size(group)
    if size == 1:
        out.copy_(flat)
        return None
    if _is_gloo(group):
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return _ThenCopy(work, flat.view(size, -1)[dist.get_rank(group)], out)
    return _reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_reduce_flat(flat: torch.Tensor, group: dist.ProcessGroup):
    """SUM all-reduce over the replicate dim of HSDP."""
    if dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
