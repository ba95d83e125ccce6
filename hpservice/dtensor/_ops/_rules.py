"""The sharding rules: ``rule(func, args, kwargs) -> Decision`` per aten op, per mesh dim.

``args``/``kwargs`` are frozen (hashable): every DTensor is replaced by its ``DTensorSpec``,
lists by tuples. A rule returns the spec each DTensor operand must have (in positional order,
the elements of a tensor-list argument such as ``cat``'s in place;
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
    targets: tuple[DTensorSpec, ...]  # one per DTensor operand, in flattened positional order
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
    specs = flat_specs(args)
    mesh = specs[0].mesh
    if any(s.mesh != mesh for s in specs):
        raise RuleError("all DTensor operands must share one mesh")
    decision = RULES[func](func, args, dict(kwargs))
    if func.is_view:
        decision = _with_view_strides(func, args, kwargs, decision)
    return decision


def _with_view_strides(func, args: tuple, kwargs: tuple, decision: Decision) -> Decision:
    """A view's global strides are torch's for the same view of the global tensor (``x.t()`` has
    stride (1, n), so ``x.t().reshape(-1)`` copies as in torch): run the op on meta tensors."""

    def meta(a):
        if isinstance(a, DTensorSpec):
            return torch.empty_strided(a.shape, a.stride, device="meta")
        if isinstance(a, tuple):
            return [meta(x) for x in a]
        return a

    try:
        out = func(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs})
    except Exception:  # meta cannot run it: keep the rule's contiguous strides
        return decision

    def restride(spec, t):
        if spec is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.shape:
            return spec
        stride = tuple(t.stride())
        return spec if stride == spec.stride else DTensorSpec(spec.mesh, spec.placements, spec.shape, stride)

    if isinstance(decision.out, tuple):
        outs = tuple(restride(s, t) for s, t in zip(decision.out, out, strict=True))
    else:
        outs = restride(decision.out, out)
    return decision._replace(out=outs)


def flat_specs(args: tuple) -> list[DTensorSpec]:
    """The DTensor operands in flattened positional order: a list argument (``cat``'s tensors)
    contributes its elements in place. ``Decision.targets`` follows this order."""
    out = []
    for a in args:
        if isinstance(a, DTensorSpec):
            out.append(a)
        elif isinstance(a, tuple):
            out.extend(x for x in a if isinstance(x, DTensorSpec))
    return out


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
    """Operands with different layouts. In-place ops keep ``self``'s layout. Otherwise, per mesh
    dim, the output is sharded where any operand is sharded on a dim of the output's size
    (redistributing a Replicate operand to it is a local slice, so ``R * S(0)`` is ``S(0)`` with
    no communication, as in torch); the dim most operands shard wins, then the lowest, so the
    layout does not depend on operand order. Partial stays only for add/sub of operands Partial
    with the same op; otherwise Partials are reduced (to the shard, or to Replicate)."""
    mesh = specs[0].mesh
    if any(s.mesh != mesh for s in specs):
        raise RuleError("all DTensor operands must share one mesh")
    try:
        out_shape = tuple(torch.broadcast_shapes(*(s.shape for s in specs)))
    except RuntimeError as e:
        raise RuleError(str(e)) from None
    ref = specs[0] if mutable else max(specs, key=lambda s: (s.ndim, s.shape == out_shape))
    if mutable and ref.shape != out_shape:
        raise RuleError("in-place op: self cannot be broadcast")
    linear_add = func.overloadpacket.__name__ in _PARTIAL_ADD
    out = []
    for i in range(mesh.ndim):
        if mutable:
            p = ref.placements[i]
            if p.is_partial():  # self stays Partial only under add/sub of the same Partial
                keep = linear_add and _is_linear_partial(p) and all(s.placements[i] == p for s in specs)
                p = p if keep else _R
            out.append(p)
            continue
        votes: dict[int, int] = {}
        for s in specs:
            p = s.placements[i]
            if p.is_shard():
                d = p.dim + len(out_shape) - s.ndim
                if s.shape[p.dim] == out_shape[d] and out_shape[d] > 1:
                    votes[d] = votes.get(d, 0) + 1
        if votes:
            out.append(Shard(min(votes, key=lambda d: (-votes[d], d))))
            continue
        partials = {s.placements[i] for s in specs if s.placements[i].is_partial()}
        if len(partials) == 1:
            p = partials.pop()
            keep = linear_add and _is_linear_partial(p) and all(s.placements[i] == p for s in specs)
            out.append(p if keep else _R)
        else:
            out.append(_R)
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


def _reduction(x: DTensorSpec, dims: tuple[int, ...], keepdim: bool, reduce_op: str | None = "sum"):
    """Reducing over a sharded dim -> Partial(reduce_op) on that mesh dim (``reduce_op`` None:
    the dim is gathered first, for ops returning indices); other shard dims shift. An input
    Partial stays only when the reduction commutes with it (sum of sum/avg, max of max)."""
    target, out = [], []
    for p in x.placements:
        if p.is_shard():
            if p.dim in dims:
                target.append(p if reduce_op else _R)
                out.append(Partial(reduce_op) if reduce_op else _R)
            else:
                target.append(p)
                out.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))
        elif p.is_partial() and not (
            (reduce_op == "sum" and _is_linear_partial(p)) or (reduce_op in ("max", "min") and p.reduce_op == reduce_op)
        ):
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


def _reduce_args(x: DTensorSpec, args, kwargs, *, whole: bool) -> tuple[tuple[int, ...], bool]:
    """(dims, keepdim) of a reduction: all dims for the whole-tensor overloads, else ``dim``/``keepdim``."""
    if whole:
        return tuple(range(x.ndim)), False
    dims = _reduce_dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
    return dims, bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))


@register(aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim)
def _sum_rule(func, args, kwargs) -> Decision:
    x = args[0]
    dims, keepdim = _reduce_args(x, args, kwargs, whole=func in (aten.sum.default, aten.mean.default))
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


@register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _amax_rule(func, args, kwargs) -> Decision:
    """max/min over a sharded dim: each rank reduces its piece -> Partial(max/min)."""
    x = args[0]
    dims, keepdim = _reduce_args(x, args, kwargs, whole=func in (aten.max.default, aten.min.default))
    op = "max" if func in (aten.amax.default, aten.max.default) else "min"
    if any(p.is_shard() and p.dim in dims and x.shape[p.dim] == 0 for p in x.placements):
        raise RuleError(f"{op} over an empty dim has no identity")
    target, placements, out, shape = _reduction(x, dims, keepdim, op)
    local_fn = None
    if any(p.is_shard() and p.dim in dims for p in placements):
        # An empty local piece (uneven torch.chunk shards) has no max: give it the identity.
        local_fn = functools.partial(_local_minmax, op=op, dims=dims, keepdim=keepdim, shape=_spec(x, out, shape))
    return Decision((target,), _spec(x, out, shape), local_fn=local_fn)


def _local_minmax(func, args, kwargs, *, op, dims, keepdim, shape):
    x = args[0]
    if x.numel() == 0:
        if x.dtype.is_floating_point:
            fill = float("-inf") if op == "max" else float("inf")
        elif x.dtype == torch.bool:
            fill = op == "min"
        else:
            info = torch.iinfo(x.dtype)
            fill = info.min if op == "max" else info.max
        return x.new_full(shape.local_shape, fill)
    return func(*args, **kwargs)


@register(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def _argmax_rule(func, args, kwargs) -> Decision:
    """Ops returning indices: a sharded reduced dim is gathered first (indices cannot be reduced
    across ranks); the other shard dims stay. ``argmax(dim=None)`` gathers everything."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if dim is None:  # argmax over the flattened tensor
        dims = tuple(range(x.ndim))
        target = _spec(x, [_R] * len(x.placements), x.shape)
        shape = (1,) * x.ndim if keepdim else ()
        return Decision((target,), DTensorSpec(x.mesh, target.placements, shape))
    dims = _reduce_dims(x, dim) if x.ndim else ()
    target, _, out, shape = _reduction(x, dims, keepdim, None)
    out_spec = _spec(x, out, shape)
    if func in (aten.max.dim, aten.min.dim):
        return Decision((target,), (out_spec, out_spec))
    return Decision((target,), out_spec)


# ---- concatenation, splitting, slicing ------------------------------------------------------------


def _shift(p: Placement, dim: int, delta: int) -> Placement:
    return Shard(p.dim + delta) if p.is_shard() and p.dim >= dim else p


@register(aten.cat.default)
def _cat_rule(func, args, kwargs) -> Decision:
    """Concatenation along ``dim``: a mesh dim keeps a Shard of another dim (all operands move
    to the first operand's such Shard) or a Partial(sum/avg) every operand has; a Shard of
    ``dim`` itself and anything else become Replicate."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    specs = [t for t in tensors if isinstance(t, DTensorSpec)]
    if len(specs) != len(tensors):
        raise RuleError("every tensor in the list must be a DTensor")
    specs = [s for s in specs if s.shape != (0,)] or specs[:1]  # torch.cat skips legacy 1-d empties
    ndim = specs[0].ndim
    if any(s.ndim != ndim for s in specs):
        raise RuleError(f"tensors of different ranks: {[list(s.shape) for s in specs]}")
    dim %= max(ndim, 1)
    placements = _list_placements(specs, joined_dim=dim)
    targets = [_spec(t, placements, t.shape) if t in specs else t for t in tensors]
    shape = list(specs[0].shape)
    shape[dim] = sum(s.shape[dim] for s in specs)
    return Decision(tuple(targets), DTensorSpec(specs[0].mesh, tuple(placements), tuple(shape)))


def _list_placements(specs, joined_dim: int | None = None) -> list[Placement]:
    """The common placements of cat/stack operands, per mesh dim: the first Shard of a dim other
    than ``joined_dim``, else a Partial(sum/avg) all share, else Replicate."""
    placements = []
    for i in range(len(specs[0].placements)):
        ps = [s.placements[i] for s in specs]
        shard = next((p for p in ps if p.is_shard() and p.dim != joined_dim), None)
        if shard is not None:
            placements.append(shard)
        elif _is_linear_partial(ps[0]) and all(p == ps[0] for p in ps):
            placements.append(ps[0])
        else:
            placements.append(_R)
    return placements


@register(aten.stack.default)
def _stack_rule(func, args, kwargs) -> Decision:
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(isinstance(t, DTensorSpec) for t in tensors):
        raise RuleError("every tensor in the list must be a DTensor")
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors):
        raise RuleError(f"stack needs equal shapes, got {[list(t.shape) for t in tensors]}")
    dim %= len(shape) + 1
    placements = _list_placements(tensors)
    out = [_shift(p, dim, 1) for p in placements]
    targets = tuple(_spec(t, placements, t.shape) for t in tensors)
    return Decision(targets, DTensorSpec(tensors[0].mesh, tuple(out), (*shape[:dim], len(tensors), *shape[dim:])))


def _split_target(x: DTensorSpec, dim: int) -> list[Placement]:
    """Views along ``dim``: a Shard of ``dim`` is gathered; other placements (Partials too) stay."""
    return [_R if p.is_shard(dim) else p for p in x.placements]


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def _split_rule(func, args, kwargs) -> Decision:
    x = args[0]
    if func is aten.unbind.int:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    else:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    dim %= max(x.ndim, 1)
    placements = _split_target(x, dim)
    target = _spec(x, placements, x.shape)
    n = x.shape[dim]
    if func is aten.unbind.int:
        out = [Shard(p.dim - (p.dim > dim)) if p.is_shard() else p for p in placements]
        spec = DTensorSpec(x.mesh, tuple(out), x.shape[:dim] + x.shape[dim + 1 :])
        return Decision((target,), (spec,) * n)
    if func is aten.split.Tensor:
        size = args[1]
        sizes = [min(size, n - i) for i in range(0, n, size)] if size > 0 else [n]
        sizes = sizes or [0]
    else:
        sizes = list(args[1])
    outs = tuple(DTensorSpec(x.mesh, tuple(placements), (*x.shape[:dim], s, *x.shape[dim + 1 :])) for s in sizes)
    return Decision((target,), outs)


@register(aten.slice.Tensor)
def _slice_rule(func, args, kwargs) -> Decision:
    """``x[..., a:b:c, ...]`` / ``narrow``: a sliced dim that is sharded is gathered first (a
    whole-range slice keeps it); other placements stay."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    dim %= max(x.ndim, 1)
    n = x.shape[dim]
    lo, hi, st = slice(start, end, step).indices(n)
    length = len(range(lo, hi, st))
    whole = length == n
    placements = x.placements if whole else _split_target(x, dim)
    out_shape = (*x.shape[:dim], length, *x.shape[dim + 1 :])
    if whole:
        return Decision((x,), _spec(x, x.placements, out_shape), local_fn=_identity)
    return Decision((_spec(x, placements, x.shape),), DTensorSpec(x.mesh, tuple(placements), out_shape))


def _identity(func, args, kwargs):
    return aten.alias.default(args[0])


@register(aten.select.int)
def _select_rule(func, args, kwargs) -> Decision:
    x, dim = args[0], args[1] % max(args[0].ndim, 1)
    placements = _split_target(x, dim)
    out = [Shard(p.dim - (p.dim > dim)) if p.is_shard() else p for p in placements]
    return Decision(
        (_spec(x, placements, x.shape),), DTensorSpec(x.mesh, tuple(out), x.shape[:dim] + x.shape[dim + 1 :])
    )


@register(aten.slice_backward.default, aten.select_backward.default)
def _slice_backward_rule(func, args, kwargs) -> Decision:
    """The gradient of a slice / select: zeros of the input's shape with the grad written in.
    Shards of other dims and Partials (linear) stay; the sliced dim is whole on every rank."""
    grad, sizes, dim = args[0], tuple(args[1]), args[2] % len(args[1])
    if func is aten.select_backward.default:
        keep = [p for p in grad.placements]
        target = grad
        out = [Shard(p.dim + (p.dim >= dim)) if p.is_shard() else p for p in keep]
    else:
        keep = _split_target(grad, dim)
        target = _spec(grad, keep, grad.shape)
        out = keep
    return Decision((target,), DTensorSpec(grad.mesh, tuple(out), sizes), local_shape_arg=1)


# ---- factories from a DTensor and scatter ---------------------------------------------------------


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
@register(aten.new_empty_strided.default)
def _new_factory_rule(func, args, kwargs) -> Decision:
    """``x.new_zeros(size)``: a constant (or uninitialised) tensor. It keeps a Shard of ``x``
    where that dim has the same size in ``size``; everything else is Replicate."""
    x, size = args[0], tuple(args[1])
    out = [p if p.is_shard() and len(size) == x.ndim and size[p.dim] == x.shape[p.dim] else _R for p in x.placements]
    local_fn = _local_new_empty_strided if func is aten.new_empty_strided.default else None
    return Decision((x,), DTensorSpec(x.mesh, tuple(out), size), local_shape_arg=1, local_fn=local_fn)


def _local_new_empty_strided(func, args, kwargs):
    return aten.new_empty.default(args[0], args[1], **kwargs)


@register(aten.scatter.src, aten.scatter.value, aten.gather.default)
def _scatter_rule(func, args, kwargs) -> Decision:
    """scatter(self, dim, index, src) / gather(self, dim, index): shards of a dim other than
    ``dim`` where every operand has the same size stay (the first one found; the others move to
    it); ``dim`` itself, Partials and everything else are Replicate."""
    x, dim = args[0], args[1] % max(args[0].ndim, 1)
    specs = [a for a in (x, *args[2:4]) if isinstance(a, DTensorSpec)]
    if len(specs) != len([a for a in (x, *args[2:4]) if not isinstance(a, int | float | bool)]):
        raise RuleError("self, index and src must all be DTensors")
    if any(s.ndim != x.ndim for s in specs):
        raise RuleError("operands of different ranks")
    placements = []
    for i in range(len(x.placements)):
        ok = [
            s.placements[i]
            for s in specs
            if s.placements[i].is_shard()
            and s.placements[i].dim != dim
            and len({t.shape[s.placements[i].dim] for t in specs}) == 1
        ]
        placements.append(ok[0] if ok else _R)
    targets = tuple(_spec(s, placements, s.shape) for s in specs)
    shape = args[2].shape if func is aten.gather.default else x.shape
    return Decision(targets, DTensorSpec(x.mesh, tuple(placements), shape))
