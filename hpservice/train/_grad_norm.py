"""Global gradient clipping over parameters that live on different meshes.

With tensor parallelism next to data parallelism, parameters come in several layouts: those
tensor parallelism shards live on the combined ``(dp..., tp)`` mesh, the rest (norms, a
replicated embedding) on the data-parallel mesh only, and with tp alone some are plain tensors.
``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms, which needs one mesh. Here the
gradients are grouped by mesh, each group's total norm is computed where its shards are (our
DTensor norm all-reduces local partial norms over the sharded mesh dims; plain tensors need no
communication), and the group totals, replicated scalars by then, are combined locally.
No full gradient is ever gathered.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hpservice.dtensor import DTensor


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place to a global ``norm_type``-norm of ``max_norm``; returns the norm
    before clipping (a plain 0-d tensor, equal on every rank)."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g._spec.mesh if isinstance(g, DTensor) else None, []).append(g)
    totals = []
    for members in groups.values():
        total = torch.nn.utils.get_total_norm(members, norm_type)
        totals.append((total.to_local() if isinstance(total, DTensor) else total).detach().float().cpu())
    norm = torch.linalg.vector_norm(torch.stack(totals), norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
