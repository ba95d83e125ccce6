"""Sharding rules of view ops: transpose/permute, view/reshape, (un)squeeze, expand, alias.

A view keeps a Shard when the sharded dim survives whole (renumbered); a dim that is split,
merged with its neighbours in a way that breaks the shard, squeezed away or expanded is gathered
first (correct, slower). Global strides are torch's for the same view (``_registry``).
"""

from __future__ import annotations

import functools
import math

import torch

from ..placement_types import Shard
from ._registry import _R, Decision, RuleError, _reduce_dims, _spec, register

aten = torch.ops.aten


@register(aten.alias.default, aten.detach.default)
def _alias_rule(func, args, kwargs) -> Decision:
    return Decision((args[0],), args[0])


@register(aten.t.default, aten.transpose.int, aten.permute.default)
def _permute_rule(func, args, kwargs) -> Decision:
    x = args[0]
    n = x.ndim
    if func is aten.permute.default:
        perm = [d % n for d in args[1]] if n else []
    else:
        d0, d1 = (0, 1) if func is aten.t.default else (_wrap_dim(args[1], n), _wrap_dim(args[2], n))
        perm = list(range(n))
        if n >= 2 or (n == 1 and func is not aten.t.default):  # a 0-d tensor transposes to itself
            perm[d0], perm[d1] = perm[d1], perm[d0]
    inverse = {d: i for i, d in enumerate(perm)}
    out = [Shard(inverse[p.dim]) if p.is_shard() else p for p in x.placements]
    return Decision((x,), _spec(x, out, [x.shape[d] for d in perm]))


def _wrap_dim(d: int, ndim: int) -> int:
    """torch's dim wrapping (a 0-d tensor takes dims 0 and -1), and its IndexError beyond it."""
    bound = max(ndim, 1)
    if not -bound <= d < bound:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-bound}, {bound - 1}], but got {d})")
    return d % bound


def _resolve_size(shape: tuple[int, ...], size) -> tuple[int, ...]:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = math.prod(shape) // known if known else 0
    return tuple(size)


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view_rule(func, args, kwargs) -> Decision:
    """A sharded dim stays sharded when it maps onto an output dim at the same position in the
    flattened layout: one-to-one ([B,S,H] S(2) <-> [B*S,H] S(1)), or, for even shards, as the
    outermost part of a merge or a split (``_view_map``, as torch's view rule); other sharded dims
    are gathered first (correct, slower; a write through such a view raises)."""
    x = args[0]
    out_shape = _resolve_size(x.shape, args[1])
    if math.prod(out_shape) != math.prod(x.shape):
        raise RuleError(f"shape {list(args[1])} is invalid for a tensor of shape {list(x.shape)}")
    if func is aten.view.default:
        # a view of the global tensor as torch sees it (its strides: x.t() is not contiguous): where
        # torch cannot view it, neither do we (torch's error), rather than copying silently
        stride = x.stride() if callable(x.stride) else x.stride
        if not _viewable(tuple(x.shape), tuple(stride), out_shape):
            raise RuntimeError(
                "view size is not compatible with input tensor's size and stride (at least one dimension spans "
                "across two contiguous subspaces). Use .reshape(...) instead."
            )
    target, out = [], []
    for i, p in enumerate(x.placements):
        if p.is_shard():
            alone = sum(q.is_shard() and q.dim == p.dim for q in x.placements) == 1
            e = _view_map(x.shape, out_shape, p.dim, x.mesh.size(i) if alone else None)
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


def _viewable(shape: tuple[int, ...], stride: tuple[int, ...], new_shape: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` can be viewed as ``new_shape``: torch's own rule
    (``at::detail::computeStride``), in plain Python. (Running a meta tensor's view here would be
    an op that activation checkpointing's dispatch modes record, shifting their cache.)"""
    if not shape or math.prod(shape) == 0:
        return True
    view_d = len(new_shape) - 1
    chunk_base_stride = stride[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[tensor_d]
        if tensor_d == 0 or (shape[tensor_d - 1] != 1 and stride[tensor_d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return False
            if tensor_d > 0:
                chunk_base_stride = stride[tensor_d - 1]
                tensor_numel = view_numel = 1
    return view_d == -1


def _view_map(shape, out_shape, d: int, ranks: int | None) -> int | None:
    """The output dim a shard of input dim ``d`` becomes, or None (gather it first). Always when
    an output dim of the same size starts at the same flattened position; with ``ranks`` (the one
    mesh dim sharding ``d`` has that many ranks) also where ``d`` is the outermost part of a merged
    output dim (``[4, 6] S(0) -> [24] S(0)``) or an output dim is the outermost part of ``d``
    (``[24] S(0) -> [4, 6] S(0)``), when the shards are even: then each rank's piece is exactly
    its ``torch.chunk`` of the output dim, so the view aliases it (and writes through it land)."""
    before = math.prod(shape[:d])
    for e, size in enumerate(out_shape):
        if math.prod(out_shape[:e]) != before:
            continue
        if size == shape[d]:
            return e
        if size == 1:  # a size-1 dim inserted at this position ([B, V, S] -> [B, V, 1, S]): look past it
            continue
        if ranks is None or size == 0 or shape[d] == 0:
            return None
        if size % shape[d] == 0 and shape[d] % ranks == 0:  # d merged with dims inside it
            return e
        if shape[d] % size == 0 and size % ranks == 0:  # d split, e its outermost part
            return e
        return None
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
    elif func is aten.squeeze.dims and len(args[1]) == 0:
        dims = ()  # squeeze(dim=()) squeezes nothing (a reduction's dim=() means every dim)
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
    # locally, squeeze the dims of global size 1 only: a shard of one row is not a size-1 dim
    local_fn = functools.partial(_local_squeeze, dims=tuple(sorted(gone)))
    return Decision((_spec(x, target, x.shape),), _spec(x, out, shape), local_fn=local_fn)


def _local_squeeze(func, args, kwargs, *, dims):
    return aten.squeeze.dims(args[0], list(dims)) if dims else aten.alias.default(args[0])


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
