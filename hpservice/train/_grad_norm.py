"""Global gradient clipping over parameters that live on different meshes.

With tensor parallelism next to data parallelism, parameters come in several layouts: those
tensor parallelism shards live on the combined ``(dp..., tp)`` mesh, the rest (norms, a
replicated embedding) on the data-parallel mesh only, and with tp alone some are plain tensors.
``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms, which needs one mesh. Here the
gradients are grouped by mesh, each group's total norm is computed where its shards are (our
DTensor norm all-reduces local partial norms over the sharded mesh dims; plain tensors need no
communication), and the group totals, replicated scalars by then, are combined locally.
No full gradient is ever gathered.

With pipeline parallelism each pp rank holds only its stages' gradients: its total is combined
with the other stages' over the pp group (the sum of ``norm ** p``, or the max for the inf-norm),
so every stage clips by the norm of the whole model's gradient, as one process would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from hpservice.dtensor import DTensor
from hpservice.dtensor._collectives import all_reduce_


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *, pp_group=None
) -> torch.Tensor:
    """Clip gradients in place to a global ``norm_type``-norm of ``max_norm``; returns the norm
    before clipping (a plain 0-d tensor, equal on every rank). ``pp_group``: the pipeline ranks
    whose stages' gradients make up the whole model with these (None: these are all of it)."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads and pp_group is None:
        return torch.zeros(())
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g._spec.mesh if isinstance(g, DTensor) else None, []).append(g)
    totals = []
    for members in groups.values():
        total = torch.nn.utils.get_total_norm(members, norm_type)
        totals.append((total.to_local() if isinstance(total, DTensor) else total).detach().float().cpu())
    norm = torch.linalg.vector_norm(torch.stack(totals), norm_type) if totals else torch.zeros(())
    if pp_group is not None:
        norm = _across_stages(norm, norm_type, pp_group, grads[0].device if grads else torch.device("cpu"))
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _across_stages(norm: torch.Tensor, norm_type: float, group, device: torch.device) -> torch.Tensor:
    """The norm over every pp rank's gradients, from each rank's own ``norm``."""
    t = norm.to(device=device, dtype=torch.float64).reshape(1)  # on the device (nccl needs cuda)
    if math.isinf(norm_type):  # max (min for -inf) keeping a stage's NaN, as one process would
        all_reduce_(t, dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN, group)
        return t[0].float().cpu()
    t = t.pow(norm_type)
    dist.all_reduce(t, group=group)
    return t.pow(1.0 / norm_type)[0].float().cpu()
