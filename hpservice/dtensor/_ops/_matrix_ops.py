"""Sharding rules of matrix products: mm, bmm, addmm, per mesh dim.

For A[.., M, K] @ B[.., K, N]: A sharded on M or B on N keeps the output sharded alike; both
sharded on K gives Partial(sum); a linear Partial operand against a replicated one stays Partial.
Other combinations move the smaller operand (cost: elements that move) to the cheapest valid pair.
"""

from __future__ import annotations

import math

import torch

from .._layout import DTensorSpec
from ..placement_types import Partial, Placement, Shard
from ._pointwise_ops import _broadcast_placement
from ._registry import _R, Decision, RuleError, _is_linear_partial, _spec, register

aten = torch.ops.aten


def _mm_valid(pa: Placement, pb: Placement, batch: int) -> Placement | None:
    """Output placement of one mesh dim of (batched) A[.., M, K] @ B[.., K, N], or None."""
    if pa.is_replicate() and pb.is_replicate():
        return _R
    if batch and pa == Shard(0) and pb == Shard(0):
        return Shard(0)
    if pa == Shard(batch) and pb.is_replicate():
        return Shard(batch)
    if pa.is_replicate() and pb == Shard(batch + 1):
        return Shard(batch + 1)
    if pa == Shard(batch + 1) and pb == Shard(batch):
        return Partial("sum")
    if _is_linear_partial(pa) and pb.is_replicate():
        return pa
    if pa.is_replicate() and _is_linear_partial(pb):
        return pb
    return None


def _move_cost(src: Placement, dst: Placement) -> int:
    if src == dst or (src.is_replicate() and not dst.is_replicate()):
        return 0  # a slice or a partition: no communication
    return 1


def _mm_choose(pa: Placement, pb: Placement, batch: int, size_a: int, size_b: int):
    out = _mm_valid(pa, pb, batch)
    if out is not None:
        return pa, pb, out
    candidates = [(_R, _R), (Shard(batch), _R), (_R, Shard(batch + 1)), (Shard(batch + 1), Shard(batch))]
    if batch:
        candidates.append((Shard(0), Shard(0)))
    if _is_linear_partial(pa):
        candidates.append((pa, _R))
    if _is_linear_partial(pb):
        candidates.append((_R, pb))
    # Keep the larger operand where it is: cost = elements that move.
    ta, tb = min(candidates, key=lambda c: _move_cost(pa, c[0]) * size_a + _move_cost(pb, c[1]) * size_b)
    return ta, tb, _mm_valid(ta, tb, batch)


def _mm_placements(a: DTensorSpec, b: DTensorSpec, batch: int):
    ta, tb, out = [], [], []
    size_a, size_b = math.prod(a.shape), math.prod(b.shape)
    for pa, pb in zip(a.placements, b.placements, strict=True):
        x, y, o = _mm_choose(pa, pb, batch, size_a, size_b)
        ta.append(x)
        tb.append(y)
        out.append(o)
    return ta, tb, out


@register(aten.mm.default, aten.bmm.default)
def _mm_rule(func, args, kwargs) -> Decision:
    a, b = args[0], args[1]
    batch = 1 if func is aten.bmm.default else 0
    if a.ndim != 2 + batch or b.ndim != 2 + batch:
        raise RuleError("unexpected operand ranks")
    ta, tb, out = _mm_placements(a, b, batch)
    shape = (*a.shape[:-1], b.shape[-1])
    return Decision((_spec(a, ta, a.shape), _spec(b, tb, b.shape)), DTensorSpec(a.mesh, tuple(out), shape))


@register(aten.addmm.default)
def _addmm_rule(func, args, kwargs) -> Decision:
    """bias + A @ B: the bias is added once. With a Partial output it becomes Partial (exact:
    coordinate 0 keeps the value); with a sharded output it is sharded on its aligned dim."""
    bias, a, b = args[0], args[1], args[2]
    if not isinstance(bias, DTensorSpec):
        raise RuleError("the bias must be a DTensor")
    ta, tb, out = _mm_placements(a, b, 0)
    shape = (a.shape[0], b.shape[1])
    tbias = [_broadcast_placement(p, shape, bias.shape) for p in out]
    return Decision(
        (_spec(bias, tbias, bias.shape), _spec(a, ta, a.shape), _spec(b, tb, b.shape)),
        DTensorSpec(a.mesh, tuple(out), shape),
    )
