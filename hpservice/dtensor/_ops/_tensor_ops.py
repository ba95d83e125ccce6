"""Sharding rules of tensor-building and indexing ops: cat/stack/split/unbind/slice/select (and
the slice/select backwards), factories from a DTensor (``new_*``, ``*_like``), scatter/gather,
index_select/index_add.

A dim that an op cuts, joins or indexes into is gathered when sharded; shards of other dims stay
(operands move to the first such shard); linear Partials stay where the op is linear in them.
"""

from __future__ import annotations

import torch

from .._layout import DTensorSpec
from ..placement_types import Placement, Shard
from ._registry import _R, Decision, RuleError, _gather_dims, _is_linear_partial, _replicated, _spec, register

aten = torch.ops.aten


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


@register(aten.split.Tensor, aten.unsafe_split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
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
    if func in (aten.split.Tensor, aten.unsafe_split.Tensor):
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


# ---- factories from a DTensor ---------------------------------------------------------------------

_LIKE = (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)


@register(*_LIKE)
def _like_rule(func, args, kwargs) -> Decision:
    """``zeros_like(x)``: x's layout; a Partial becomes Replicate (a fresh value is the same on
    every rank, not a pending sum)."""
    x = args[0]
    out = [_R if p.is_partial() else p for p in x.placements]
    return Decision((x,), x.with_placements(tuple(out)))


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


# ---- scatter / gather / index ---------------------------------------------------------------------


@register(aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.gather.default)
def _scatter_rule(func, args, kwargs) -> Decision:
    """scatter / scatter_add(self, dim, index, src) / gather(self, dim, index): shards of a dim other than
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


@register(aten.index_select.default)
def _index_select_rule(func, args, kwargs) -> Decision:
    """``x.index_select(dim, index)``: ``dim`` is gathered when sharded, the index replicated;
    shards of other dims and linear Partials of ``x`` stay (the op is linear in ``x``)."""
    x, dim, index = args[0], args[1] % max(args[0].ndim, 1), args[2]
    if not isinstance(index, DTensorSpec):
        raise RuleError("the index must be a DTensor")
    placements = _gather_dims(x, {dim}, partial_ok=True)
    shape = (*x.shape[:dim], index.shape[0] if index.ndim else 1, *x.shape[dim + 1 :])
    out = DTensorSpec(x.mesh, tuple(placements), shape if index.ndim else x.shape[:dim] + x.shape[dim + 1 :])
    return Decision((_spec(x, placements, x.shape), _replicated(index)), out)


@register(aten.index_add.default, aten.index_add_.default)
def _index_add_rule(func, args, kwargs) -> Decision:
    """``x.index_add(dim, index, source)``: per mesh dim, a Shard of ``x`` on another dim stays
    when ``source`` has that dim's size (``source`` moves to it), a linear Partial stays when
    both are Partial alike; otherwise both are replicated (in-place: ``x`` keeps its layout or the
    op raises). The index is replicated."""
    x, dim, index, source = args[0], args[1] % max(args[0].ndim, 1), args[2], args[3]
    if not isinstance(index, DTensorSpec) or not isinstance(source, DTensorSpec):
        raise RuleError("index and source must be DTensors")
    if source.ndim != x.ndim:
        raise RuleError(f"source {list(source.shape)} and self {list(x.shape)} have different ranks")
    placements = []
    for px, ps in zip(x.placements, source.placements, strict=True):
        keep_shard = px.is_shard() and px.dim != dim and source.shape[px.dim] == x.shape[px.dim]
        placements.append(px if keep_shard or (_is_linear_partial(px) and ps == px) else _R)
    targets = (_spec(x, placements, x.shape), _replicated(index), _spec(source, placements, source.shape))
    return Decision(targets, targets[0])


@register(aten.flip.default)
def _flip_rule(func, args, kwargs) -> Decision:
    """``x.flip(dims)`` (cumsum's backward): a flipped dim is gathered when sharded (a shard of
    the reversed dim is another rank's piece); other shards and linear Partials stay."""
    x = args[0]
    dims = {d % max(x.ndim, 1) for d in args[1]}
    target = _spec(x, _gather_dims(x, dims, partial_ok=True), x.shape)
    return Decision((target,), target)


@register(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default)
def _triangle_rule(func, args, kwargs) -> Decision:
    """``tril`` / ``triu``: which elements stay depends on their (row, column) in the whole
    matrix, so the last two dims are gathered when sharded; batch shards and linear Partials stay
    (zeroing elements is linear)."""
    x = args[0]
    if x.ndim < 2:
        raise RuleError("tril/triu need at least 2 dims")
    target = _spec(x, _gather_dims(x, {x.ndim - 2, x.ndim - 1}, partial_ok=True), x.shape)
    return Decision((target,), target)


@register(aten.roll.default)
def _roll_rule(func, args, kwargs) -> Decision:
    """``roll(shifts, dims)``: a rolled dim is gathered when sharded (elements cross shards); with no
    ``dims`` the flattened tensor rolls, so every dim is. Other shards and linear Partials stay."""
    x = args[0]
    dims = args[2] if len(args) > 2 else kwargs.get("dims", ())
    rolled = {d % max(x.ndim, 1) for d in dims} if dims else set(range(x.ndim))
    target = _spec(x, _gather_dims(x, rolled, partial_ok=True), x.shape)
    return Decision((target,), target)


@register(aten.repeat.default)
def _repeat_rule(func, args, kwargs) -> Decision:
    """``repeat(repeats)``: ``repeats`` may add leading dims; a shard stays (on its shifted dim)
    where that dim is repeated once, else it is gathered; linear Partials stay (repeat is linear)."""
    x, repeats = args[0], list(args[1])
    lead = len(repeats) - x.ndim
    if lead < 0:
        raise RuleError("fewer repeats than dims")
    placements = _gather_dims(x, {d for d in range(x.ndim) if repeats[d + lead] != 1}, partial_ok=True)
    out = [Shard(p.dim + lead) if p.is_shard() else p for p in placements]
    shape = tuple(r * (x.shape[i - lead] if i >= lead else 1) for i, r in enumerate(repeats))
    return Decision((_spec(x, placements, x.shape),), DTensorSpec(x.mesh, tuple(out), shape))


@register(aten.constant_pad_nd.default)
def _pad_rule(func, args, kwargs) -> Decision:
    """``F.pad(x, pad, value=v)``: ``pad`` pairs run from the last dim backwards; a padded dim is
    gathered when sharded (the pad lands on the first and last ranks only). Other shards stay;
    linear Partials stay when ``v`` is 0 (each piece padded with zeros sums to the padded sum)."""
    x, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    padded = {x.ndim - 1 - i // 2 for i in range(0, len(pad), 2) if pad[i] or pad[i + 1]}
    placements = _gather_dims(x, padded, partial_ok=value == 0)
    shape = list(x.shape)
    for i in range(0, len(pad), 2):
        shape[x.ndim - 1 - i // 2] += pad[i] + pad[i + 1]
    if any(n < 0 for n in shape):
        raise RuleError(f"negative output size {tuple(shape)}")
    return Decision((_spec(x, placements, x.shape),), DTensorSpec(x.mesh, tuple(placements), tuple(shape)))
