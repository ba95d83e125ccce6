"""The sharding rules: ``rule(func, args, kwargs) -> Decision`` per aten op, per mesh dim.

``args``/``kwargs`` are frozen (hashable): every DTensor is replaced by its ``DTensorSpec``,
lists by tuples. A rule returns the spec each DTensor operand must have (in positional order;
the dispatcher redistributes the ones that differ, never in place) and the output spec. Rules
reason about placements and global shapes only; local shapes always come from the specs (uneven
``torch.chunk`` shards stay exact).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._layout import DTensorSpec
from ..placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten

_R = Replicate()
_LINEAR_PARTIAL = ("sum", "avg")


class RuleError(Exception):
    """The rule cannot handle these operands; the dispatcher turns it into NotImplementedError."""


class Decision(NamedTuple):
    targets: tuple[DTensorSpec, ...]  # one per DTensor operand, in positional order
    out: DTensorSpec | tuple[DTensorSpec | None, ...]  # a tuple for ops with several outputs
    local_shape_arg: int | None = None  # positional arg replaced by ``out.local_shape`` (view/expand)
    local_fn: Callable | None = None  # replaces ``func`` on the local tensors


RULES: dict = {}


def register(*ops):
    def deco(fn):
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


@functools.lru_cache(maxsize=4096)
def decide(func, args: tuple, kwargs: tuple) -> Decision:
    """Cached rule decision; ``args``/``kwargs`` frozen (specs instead of DTensors)."""
    if any(isinstance(v, DTensorSpec) for _, v in kwargs):
        raise RuleError("DTensor keyword arguments are not supported")
    for a in args:
        if isinstance(a, tuple) and any(isinstance(x, DTensorSpec) for x in a):
            raise RuleError("DTensors inside argument lists are not supported")
    specs = [a for a in args if isinstance(a, DTensorSpec)]
    mesh = specs[0].mesh
    if any(s.mesh != mesh for s in specs):
        raise RuleError("all DTensor operands must share one mesh")
    return RULES[func](func, args, dict(kwargs))


def _spec(like: DTensorSpec, placements, shape) -> DTensorSpec:
    placements = tuple(placements)
    if placements == like.placements and tuple(shape) == like.shape:
        return like
    return DTensorSpec(like.mesh, placements, tuple(shape))


def _is_linear_partial(p: Placement) -> bool:
    return p.is_partial() and p.reduce_op in _LINEAR_PARTIAL


# ---- views ----------------------------------------------------------------------------------------


@register(aten.t.default, aten.transpose.int, aten.permute.default)
def _permute_rule(func, args, kwargs) -> Decision:
    x = args[0]
    n = x.ndim
    if func is aten.permute.default:
        perm = [d % n for d in args[1]] if n else []
    else:
        d0, d1 = (0, 1) if func is aten.t.default else (args[1] % max(n, 1), args[2] % max(n, 1))
        perm = list(range(n))
        if n >= 2 or func is not aten.t.default:
            perm[d0], perm[d1] = perm[d1], perm[d0]
    inverse = {d: i for i, d in enumerate(perm)}
    out = [Shard(inverse[p.dim]) if p.is_shard() else p for p in x.placements]
    return Decision((x,), _spec(x, out, [x.shape[d] for d in perm]))


def _resolve_size(shape: tuple[int, ...], size) -> tuple[int, ...]:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = math.prod(shape) // known if known else 0
    return tuple(size)


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view_rule(func, args, kwargs) -> Decision:
    """A sharded dim stays sharded when it maps one-to-one onto an output dim of the same size at
    the same position in the flattened layout ([B,S,H] S(2) <-> [B*S,H] S(1)); other sharded dims
    are gathered first (correct, slower)."""
    x = args[0]
    out_shape = _resolve_size(x.shape, args[1])
    if math.prod(out_shape) != math.prod(x.shape):
        raise RuleError(f"shape {list(args[1])} is invalid for a tensor of shape {list(x.shape)}")
    target, out = [], []
    for p in x.placements:
        if p.is_shard():
            e = _view_map(x.shape, out_shape, p.dim)
            if e is None:
                target.append(_R)
                out.append(_R)
            else:
                target.append(p)
                out.append(Shard(e))
        else:
            target.append(p)
            out.append(p)
    return Decision((_spec(x, target, x.shape),), _spec(x, out, out_shape), local_shape_arg=1, local_fn=_local_view)


def _view_map(shape, out_shape, d: int) -> int | None:
    before = math.prod(shape[:d])
    for e, size in enumerate(out_shape):
        if size == shape[d] and math.prod(out_shape[:e]) == before:
            return e
    return None


def _local_view(func, args, kwargs):
    # Specs record contiguous strides while a local tensor may be a transposed view: reshape then.
    try:
        return func(*args, **kwargs)
    except RuntimeError:
        if func is aten.reshape.default:
            raise
        return aten._unsafe_view.default(args[0].contiguous(), args[1])


@register(aten.unsqueeze.default)
def _unsqueeze_rule(func, args, kwargs) -> Decision:
    x = args[0]
    dim = args[1] % (x.ndim + 1)
    out = [Shard(p.dim + (p.dim >= dim)) if p.is_shard() else p for p in x.placements]
    return Decision((x,), _spec(x, out, (*x.shape[:dim], 1, *x.shape[dim:])))


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze_rule(func, args, kwargs) -> Decision:
    x = args[0]
    if func is aten.squeeze.default:
        dims = tuple(range(x.ndim))
    else:
        dims = _reduce_dims(x, args[1]) if x.ndim else ()
    gone = {d for d in dims if x.shape[d] == 1}
    target, out = [], []
    for p in x.placements:
        if p.is_shard() and p.dim in gone:  # a size-1 dim held by one rank: gather it first
            target.append(_R)
            out.append(_R)
        else:
            target.append(p)
            out.append(Shard(p.dim - sum(d < p.dim for d in gone)) if p.is_shard() else p)
    shape = tuple(s for d, s in enumerate(x.shape) if d not in gone)
    return Decision((_spec(x, target, x.shape),), _spec(x, out, shape))


@register(aten.expand.default)
def _expand_rule(func, args, kwargs) -> Decision:
    x = args[0]
    size = list(args[1])
    lead = len(size) - x.ndim
    out_shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    target, out = [], []
    for p in x.placements:
        if p.is_shard() and x.shape[p.dim] != out_shape[p.dim + lead]:
            target.append(_R)
            out.append(_R)
        else:
            target.append(p)
            out.append(Shard(p.dim + lead) if p.is_shard() else p)
    return Decision((_spec(x, target, x.shape),), _spec(x, out, out_shape), local_shape_arg=1)


# ---- matrix products ------------------------------------------------------------------------------


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


# ---- pointwise with broadcasting ------------------------------------------------------------------


def _broadcast_placement(out_p: Placement, out_shape, shape) -> Placement:
    """The placement an operand of ``shape`` needs so that broadcasting its local piece against
    the output's local piece is right (right-aligned; a size-1 or missing dim -> Replicate)."""
    if out_p.is_shard():
        d = out_p.dim - (len(out_shape) - len(shape))
        if d < 0 or shape[d] != out_shape[out_p.dim]:
            return _R
        return Shard(d)
    return out_p


_PARTIAL_ADD = {"add", "add_", "sub", "sub_"}


@functools.lru_cache(maxsize=4096)
def pointwise_decision(func, specs: tuple[DTensorSpec, ...], mutable: bool) -> Decision:
    """Operands with different layouts: the output follows the highest-rank operand (``self`` for
    in-place ops); every other operand is redistributed to the matching placements. Partial stays
    only for add/sub of operands Partial with the same op; otherwise Partials are reduced first."""
    mesh = specs[0].mesh
    if any(s.mesh != mesh for s in specs):
        raise RuleError("all DTensor operands must share one mesh")
    try:
        out_shape = tuple(torch.broadcast_shapes(*(s.shape for s in specs)))
    except RuntimeError as e:
        raise RuleError(str(e)) from None
    if mutable:
        ref = specs[0]
        if ref.shape != out_shape:
            raise RuleError("in-place op: self cannot be broadcast")
    else:
        ref = max(specs, key=lambda s: (s.ndim, s.shape == out_shape))
    lead = len(out_shape) - ref.ndim
    linear_add = func.overloadpacket.__name__ in _PARTIAL_ADD
    out = []
    for i, p in enumerate(ref.placements):
        if p.is_shard():
            d = p.dim + lead
            out.append(Shard(d) if ref.shape[p.dim] == out_shape[d] else _R)
        elif p.is_partial():
            keep = linear_add and _is_linear_partial(p) and all(s.placements[i] == p for s in specs)
            out.append(p if keep else _R)
        else:
            out.append(p)
    targets = tuple(_spec(s, [_broadcast_placement(p, out_shape, s.shape) for p in out], s.shape) for s in specs)
    if mutable and targets[0] != specs[0]:
        raise RuleError("in-place op: self would need a redistribution; redistribute it first")
    return Decision(targets, _spec(ref, out, out_shape))


# ---- reductions -----------------------------------------------------------------------------------


def _reduce_dims(x: DTensorSpec, dims) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, tuple) and len(dims) == 0):
        return tuple(range(x.ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({d % max(x.ndim, 1) for d in dims}))


def _reduction(x: DTensorSpec, dims: tuple[int, ...], keepdim: bool):
    """Summing over a sharded dim -> Partial(sum) on that mesh dim; other shard dims shift."""
    target, out = [], []
    for p in x.placements:
        if p.is_shard():
            target.append(p)
            if p.dim in dims:
                out.append(Partial("sum"))
            else:
                out.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))
        elif p.is_partial() and not _is_linear_partial(p):
            target.append(_R)
            out.append(_R)
        else:
            target.append(p)
            out.append(p)
    shape = (
        tuple(1 if d in dims else s for d, s in enumerate(x.shape))
        if keepdim
        else tuple(s for d, s in enumerate(x.shape) if d not in dims)
    )
    return _spec(x, target, x.shape), target, out, shape


@register(aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim)
def _sum_rule(func, args, kwargs) -> Decision:
    x = args[0]
    if func in (aten.sum.default, aten.mean.default):
        dims, keepdim = tuple(range(x.ndim)), False
    else:
        dims = _reduce_dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    target, _, out, shape = _reduction(x, dims, keepdim)
    local_fn = None
    if func in (aten.mean.default, aten.mean.dim) and any(p.is_shard() and p.dim in dims for p in x.placements):
        # The local mean would divide by the local count: sum locally, divide by the global count.
        count = math.prod(x.shape[d] for d in dims)
        dtype_pos = 1 if func is aten.mean.default else 3
        local_fn = functools.partial(_local_mean, dims=dims, keepdim=keepdim, count=count, dtype_pos=dtype_pos)
    return Decision((target,), _spec(x, out, shape), local_fn=local_fn)


def _local_mean(func, args, kwargs, *, dims, keepdim, count, dtype_pos):
    dtype = kwargs.get("dtype", args[dtype_pos] if len(args) > dtype_pos else None)
    return torch.sum(args[0], dim=list(dims), keepdim=keepdim, dtype=dtype) / count
