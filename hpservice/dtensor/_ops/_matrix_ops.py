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


@register(aten.baddbmm.default)
def _baddbmm_rule(func, args, kwargs) -> Decision:
    """``beta * self + alpha * (batch1 @ batch2)``: batches sharded alike (``Shard(0)`` on all three,
    ``self`` of the full output shape) stay and multiply locally; anything else is replicated
    (the sum of a Partial product with ``self`` is not its sum of pieces)."""
    bias, a, b = args[0], args[1], args[2]
    if not all(isinstance(t, DTensorSpec) for t in (bias, a, b)):
        raise RuleError("self, batch1 and batch2 must all be DTensors")
    shape = (a.shape[0], a.shape[1], b.shape[2])
    placements = [
        p if p == Shard(0) and tuple(bias.shape) == shape and pa == p and pb == p else _R
        for p, pa, pb in zip(bias.placements, a.placements, b.placements, strict=True)
    ]
    targets = tuple(_spec(t, placements, t.shape) for t in (bias, a, b))
    return Decision(targets, DTensorSpec(a.mesh, tuple(placements), shape))


@register(aten.dot.default, aten.vdot.default)
def _dot_rule(func, args, kwargs) -> Decision:
    """``dot(a, b)`` of 1-D tensors: sharded alike, each rank's dot of its pieces is a Partial(sum)
    of the result; otherwise both are replicated."""
    a, b = args[0], args[1]
    if not (isinstance(a, DTensorSpec) and isinstance(b, DTensorSpec)):
        raise RuleError("both operands must be DTensors")
    targets, out = [], []
    for pa, pb in zip(a.placements, b.placements, strict=True):
        if pa.is_shard() and pa == pb and a.shape == b.shape:
            targets.append(pa)
            out.append(Partial("sum"))
        else:
            targets.append(_R)
            out.append(_R)
    return Decision((_spec(a, targets, a.shape), _spec(b, targets, b.shape)), DTensorSpec(a.mesh, tuple(out), ()))


@register(aten.mv.default)
def _mv_rule(func, args, kwargs) -> Decision:
    """``A @ v`` (``A [n, m]``, ``v [m]``): rows of ``A`` sharded give rows of the result (``v``
    replicated); ``A``'s columns sharded with ``v`` give a Partial(sum); else both replicated."""
    a, v = args[0], args[1]
    if not (isinstance(a, DTensorSpec) and isinstance(v, DTensorSpec)):
        raise RuleError("both operands must be DTensors")
    ta, tv, out = [], [], []
    for pa, pv in zip(a.placements, v.placements, strict=True):
        if pa == Shard(0):
            ta.append(pa), tv.append(_R), out.append(pa)
        elif pa == Shard(1) and pv == Shard(0):
            ta.append(pa), tv.append(pv), out.append(Partial("sum"))
        else:
            ta.append(_R), tv.append(_R), out.append(_R)
    return Decision((_spec(a, ta, a.shape), _spec(v, tv, v.shape)), DTensorSpec(a.mesh, tuple(out), (a.shape[0],)))


def _batch_placements(specs, batched: bool) -> tuple[list, list]:
    """Per mesh dim: the batch shard (``Shard(0)`` on every one of ``specs``) stays, else every
    operand is replicated. Returns (placements of the batch operands, whether each dim stayed)."""
    kept = [batched and all(s.placements[i] == Shard(0) for s in specs) for i in range(len(specs[0].placements))]
    return [Shard(0) if k else _R for k in kept], kept


@register(aten.convolution.default)
def _convolution_rule(func, args, kwargs) -> Decision:
    """A convolution of a batch sharded on dim 0 (the weight and bias replicated) is one per
    piece: the output keeps ``Shard(0)``. Any other layout is replicated (a sharded channel or
    spatial dim would need halos)."""
    x, w, bias = args[0], args[1], args[2]
    if not isinstance(x, DTensorSpec) or not isinstance(w, DTensorSpec):
        raise RuleError("input and weight must be DTensors")
    placements, _ = _batch_placements([x], x.ndim == w.ndim)
    meta = [torch.empty(a.shape, device="meta") if isinstance(a, DTensorSpec) else a for a in args[:3]]
    shape = tuple(func(*meta, *args[3:]).shape)
    targets = [_spec(x, placements, x.shape), _spec(w, [_R] * len(w.placements), w.shape)]
    if isinstance(bias, DTensorSpec):
        targets.append(_spec(bias, [_R] * len(bias.placements), bias.shape))
    return Decision(tuple(targets), DTensorSpec(x.mesh, tuple(placements), shape))


@register(aten.convolution_backward.default)
def _convolution_backward_rule(func, args, kwargs) -> Decision:
    """The backward of ``_convolution_rule``'s layouts: with the batch sharded, the input's gradient
    keeps ``Shard(0)`` and the weight's and bias's (sums over the batch) are Partial(sum)."""
    grad, x, w, bias_sizes, *_, output_mask = args
    if not all(isinstance(a, DTensorSpec) for a in (grad, x, w)):
        raise RuleError("grad_output, input and weight must be DTensors")
    placements, kept = _batch_placements([grad, x], x.ndim == w.ndim)
    summed = tuple(Partial("sum") if k else _R for k in kept)
    targets = (_spec(grad, placements, grad.shape), _spec(x, placements, x.shape), _spec(w, [_R] * len(kept), w.shape))
    outs = (
        DTensorSpec(x.mesh, tuple(placements), x.shape) if output_mask[0] else None,
        DTensorSpec(x.mesh, summed, w.shape) if output_mask[1] else None,
        DTensorSpec(x.mesh, summed, tuple(bias_sizes)) if output_mask[2] and bias_sizes is not None else None,
    )
    return Decision(targets, outs)
