"""Sharding rules of reductions, scans, sorting, norms and the normalisation / loss layers.

- ``sum``/``mean`` over a sharded dim -> Partial(sum) (mean divides by the global count);
  ``amax``/``amin``/``max``/``min`` -> Partial(max/min); ops returning indices (``max.dim``,
  ``argmax``, ``sort``, ``topk``) and ops needing the whole dim (``var``/``std``: the global
  mean; ``cumsum``: the running sum) gather the reduced dim first; shards of other dims stay.
- ``linalg_vector_norm`` / ``_foreach_norm`` of whole tensors: local norms combined over the
  sharded mesh dims (one all-reduce per set of sharded dims): a replicated 0-d result. Over some
  dims (``norm(dim=)``, ``F.normalize``): the same combination over the reduced sharded dims;
  the other shards stay.
- ``native_layer_norm`` (+ backward), ``_softmax`` / ``_log_softmax`` (+ backward): dims that are
  not normalised keep their shards (the main output keeps the input's placements); a normalised
  dim that is sharded, or a Partial, is gathered / reduced to Replicate first. ``_fused_rms_norm``
  (+ backward; reached on CUDA builds) likewise.
- ``nll_loss_forward`` / ``nll_loss2d_forward`` (+ backward): input and target sharded alike on
  batch / position dims; "mean" divides local sums by the global total weight (Partial(sum)
  output), "sum" gives Partial(sum), "none" keeps the target's shards. A class-dim shard raises,
  pointing to ``hpservice.parallel.vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import functools
import math

import torch

from .._collectives import all_reduce_
from .._layout import DTensorSpec
from ..placement_types import Partial, Placement, Shard
from ._registry import (
    _R,
    Decision,
    RuleError,
    _gather_dims,
    _is_linear_partial,
    _reduce_dims,
    _spec,
    flat_specs,
    register,
)

aten = torch.ops.aten


# ---- reductions -----------------------------------------------------------------------------------


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


@register(aten.nansum.default)
def _nansum_rule(func, args, kwargs) -> Decision:
    """``nansum(dim=None, keepdim=False)``: as ``sum`` over a sharded dim (each rank skips its own
    NaNs: a Partial sum of exact pieces); a Partial input is reduced first, since a NaN in one
    rank's addend is not a NaN of the sum (``nanmean`` is ``nansum`` over a count of non-NaNs)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    whole = dim is None or (isinstance(dim, tuple | list) and len(dim) == 0)
    dims = tuple(range(x.ndim)) if whole else _reduce_dims(x, dim)
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if x.has_partial():
        x = _spec(x, [_R if p.is_partial() else p for p in x.placements], x.shape)
    target, _, out, shape = _reduction(x, dims, keepdim)
    return Decision((target,), _spec(x, out, shape))


@register(aten.prod.default, aten.prod.dim_int, aten.logsumexp.default)
def _gathered_scalar_reduction_rule(func, args, kwargs) -> Decision:
    """``prod`` and ``logsumexp``: not sums of the pieces, so a sharded reduced dim is gathered
    and Partials are reduced first (torch's rule); shards of other dims stay."""
    x = args[0]
    if func is aten.prod.default:
        dims, keepdim = tuple(range(x.ndim)), False
    else:
        dims = _reduce_dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    target, _, out, shape = _reduction(x, dims, keepdim, None)
    return Decision((target,), _spec(x, out, shape))


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


_ANY_ALL = (aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)


@register(*_ANY_ALL)
def _any_all_rule(func, args, kwargs) -> Decision:
    """``any`` / ``all``: a sharded reduced dim is gathered first (a boolean has no Partial the
    backends reduce); shards of other dims stay, Partials are reduced."""
    x = args[0]
    dims, keepdim = _reduce_args(x, args, kwargs, whole=func in (aten.any.default, aten.all.default))
    target, _, out, shape = _reduction(x, dims, keepdim, None)
    return Decision((target,), _spec(x, out, shape))


@register(aten.median.default, aten.nanmedian.default)
def _median_rule(func, args, kwargs) -> Decision:
    """``median()`` / ``nanmedian()`` of the whole tensor: an order statistic needs every element,
    so the tensor is gathered (Partials reduced) and the 0-d result is Replicate."""
    x = args[0]
    target, _, out, shape = _reduction(x, tuple(range(x.ndim)), False, None)
    return Decision((target,), _spec(x, out, shape))


@register(aten.kthvalue.default, aten.mode.default, aten.aminmax.default, aten.median.dim, aten.nanmedian.dim)
def _gathered_reduction_rule(func, args, kwargs) -> Decision:
    """``kthvalue(k, dim, keepdim)``, ``mode(dim, keepdim)``, ``(nan)median(dim, keepdim)``,
    ``aminmax(dim=, keepdim=)``: two
    outputs of one layout; the reduced dim is gathered when sharded (order statistics need it
    whole), Partials are reduced, other shards stay."""
    x = args[0]
    if func is aten.kthvalue.default:
        dim, keepdim = (
            (args[2] if len(args) > 2 else kwargs.get("dim", -1)),
            (args[3] if len(args) > 3 else kwargs.get("keepdim", False)),
        )
    elif func in (aten.mode.default, aten.median.dim, aten.nanmedian.dim):
        dim, keepdim = (
            (args[1] if len(args) > 1 else kwargs.get("dim", -1)),
            (args[2] if len(args) > 2 else kwargs.get("keepdim", False)),
        )
    else:
        dim, keepdim = kwargs.get("dim"), kwargs.get("keepdim", False)
    dims = tuple(range(x.ndim)) if dim is None else (dim % max(x.ndim, 1),)
    target, _, out, shape = _reduction(x, dims, bool(keepdim), None)
    out_spec = _spec(x, out, shape)
    return Decision((target,), (out_spec, out_spec))


@register(aten.logcumsumexp.default)
def _logcumsumexp_rule(func, args, kwargs) -> Decision:
    """A running log-sum-exp along ``dim`` needs the whole dim (gathered when sharded); it is not
    linear, so Partials are reduced."""
    x = args[0]
    target = _spec(x, _gather_dims(x, {args[1] % max(x.ndim, 1)}), x.shape)
    return Decision((target,), target)


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


_VAR_STD = (aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim, aten.var.default, aten.std.default)


@register(*_VAR_STD, aten.var_mean.correction, aten.std_mean.correction)
def _var_rule(func, args, kwargs) -> Decision:
    """var/std (and var_mean/std_mean, two outputs of one layout) need the global mean of the
    reduced dims: a sharded reduced dim is gathered first (exact; no merge of per-rank moments),
    Partials are reduced; shards of other dims stay."""
    x = args[0]
    if func in (aten.var.default, aten.std.default):
        dims, keepdim = tuple(range(x.ndim)), False
    else:
        dims = _reduce_dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
        positional = func in (aten.var.dim, aten.std.dim) and len(args) > 3
        keepdim = bool(args[3] if positional else kwargs.get("keepdim", False))
    target, _, out, shape = _reduction(x, dims, keepdim, None)
    out_spec = _spec(x, out, shape)
    if func in (aten.var_mean.correction, aten.std_mean.correction):
        return Decision((target,), (out_spec, out_spec))
    return Decision((target,), out_spec)


@register(aten.cumsum.default)
def _cumsum_rule(func, args, kwargs) -> Decision:
    """A running sum along ``dim`` needs the whole dim on each rank (gathered when sharded); it
    is linear, so a Partial(sum/avg) input stays Partial."""
    x = args[0]
    dim = args[1] % max(x.ndim, 1)
    target = _spec(x, _gather_dims(x, {dim}, partial_ok=True), x.shape)
    return Decision((target,), target)


@register(aten.sort.default, aten.sort.stable, aten.topk.default)
def _sort_rule(func, args, kwargs) -> Decision:
    """sort / topk along ``dim``: the dim is gathered when sharded (the order is global), Partials
    are reduced; shards of other dims stay. Outputs: (values, indices) of one layout."""
    x = args[0]
    if func is aten.topk.default:
        k = args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    else:
        dim = (
            (args[1] if len(args) > 1 else kwargs.get("dim", -1))
            if func is aten.sort.default
            else kwargs.get("dim", -1)
        )
    dim %= max(x.ndim, 1)
    placements = _gather_dims(x, {dim})
    target = _spec(x, placements, x.shape)
    shape = list(x.shape)
    if func is aten.topk.default and x.ndim:
        shape[dim] = k
    out = DTensorSpec(x.mesh, tuple(placements), tuple(shape))
    return Decision((target,), (out, out))


# ---- whole-tensor vector norms ----------------------------------------------------------------------


@register(aten.linalg_vector_norm.default, aten._foreach_norm.Scalar)
def _vector_norm_rule(func, args, kwargs) -> Decision:
    """Norms of whole tensors (``clip_grad_norm_``): each rank's local norm, combined over the mesh
    dims the tensor is sharded on (sum of |x|^p, max for inf, min for -inf), a replicated 0-d
    result per tensor, on that tensor's mesh (``_foreach_norm`` of gradients on several meshes
    gives each norm where its gradient lives, as torch's per-tensor rule does). Partial inputs
    are reduced first."""
    single = func is aten.linalg_vector_norm.default
    specs = flat_specs(args)
    keepdim = bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False))
    if single and (kwargs.get("dim") is not None or (len(args) > 2 and args[2] is not None) or keepdim):
        return _vector_norm_dims_rule(args, kwargs)  # keepdim over every dim: shape [1] * ndim, as torch
    if kwargs.get("dtype") is not None or (not single and len(args) > 2 and args[2] is not None):
        raise RuleError("the dtype argument is not supported")
    if not single and len(specs) != len(args[0]):
        raise RuleError("a tensor list mixing DTensors and torch.Tensors")
    # a norm is not linear: a Partial is reduced first, as torch does
    specs = [_spec(s, [_R if p.is_partial() else p for p in s.placements], s.shape) for s in specs]
    ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    scalars = tuple(DTensorSpec(s.mesh, (_R,) * s.mesh.ndim, ()) for s in specs)
    sharded = tuple(tuple(i for i, p in enumerate(s.placements) if p.is_shard()) for s in specs)
    meshes = tuple(s.mesh for s in specs)
    local_fn = functools.partial(_local_norms, ord_=ord_, meshes=meshes, sharded=sharded, single=single)
    return Decision(tuple(specs), scalars[0] if single else scalars, local_fn=local_fn)


_vector_norm_rule.per_element = True  # each tensor's norm on its own mesh


def _norm_terms(local: torch.Tensor, ord_: float):
    """(the all-reduce op, what it reduces) that combines local ``ord_``-norms into the global one:
    max / min of the norms for +-inf, the sum of the counts for 0, else the sum of ``norm^p``
    (in float64: the p-th powers of many pieces)."""
    import torch.distributed as dist

    if ord_ in (float("inf"), float("-inf")):
        return (dist.ReduceOp.MAX if ord_ > 0 else dist.ReduceOp.MIN), local.clone()
    if ord_ == 0:
        return dist.ReduceOp.SUM, local.clone()
    return dist.ReduceOp.SUM, local.double().pow(ord_)


def _norm_from_terms(value: torch.Tensor, op, ord_: float) -> torch.Tensor:
    import torch.distributed as dist

    return value.pow(1.0 / ord_) if op is dist.ReduceOp.SUM and ord_ != 0 else value


def _local_norms(func, args, kwargs, *, ord_: float, meshes, sharded, single: bool):
    tensors = [args[0]] if single else list(args[0])
    local = torch.stack([torch.linalg.vector_norm(t, ord_) for t in tensors])
    op, value = _norm_terms(local, ord_)
    # One all-reduce per (mesh, its sharded dims, mesh dim), whatever the number of tensors; every
    # rank walks the groups in the order of the first tensor of each (the same on every rank).
    by_dims: dict[tuple, list[int]] = {}
    for j, dims in enumerate(sharded):
        by_dims.setdefault((meshes[j], dims), []).append(j)
    for (mesh, dims), members in by_dims.items():
        if not dims:
            continue
        index = torch.tensor(members, device=value.device)
        part = value[index]
        for i in dims:
            all_reduce_(part, op, mesh.get_group(i))
        value[index] = part
    value = _norm_from_terms(value, op, ord_)
    outs = list(value.to(local.dtype).unbind(0))
    return outs[0] if single else outs


def _vector_norm_dims_rule(args, kwargs) -> Decision:
    """``vector_norm(x, ord, dim, keepdim)`` over some dims (``x.norm(dim=...)``, ``F.normalize``):
    shards of the other dims stay (shifted when the dims go); a sharded reduced dim is reduced
    in place: each rank's sum of ``|x|^p`` over its piece, all-reduced over those mesh dims (max /
    min for +-inf), then the p-th root, so the result is Replicate there (torch leaves a private
    norm-Partial placement that reduces to the same values). Partials are reduced first."""
    x = args[0]
    ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dims = _reduce_dims(x, args[2] if len(args) > 2 else kwargs.get("dim"))
    keepdim = bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False))
    dtype = kwargs.get("dtype")
    target = _spec(x, [_R if p.is_partial() else p for p in x.placements], x.shape)
    _, _, out, shape = _reduction(target, dims, keepdim, None)  # a reduced shard: Replicate
    out_spec = _spec(x, out, shape)
    reduced = tuple(i for i, p in enumerate(target.placements) if p.is_shard() and p.dim in dims)
    if not reduced:
        return Decision((target,), out_spec)
    local_fn = functools.partial(
        _local_norm_dims, ord_=ord_, dims=dims, keepdim=keepdim, dtype=dtype, mesh=x.mesh, reduced=reduced
    )
    return Decision((target,), out_spec, local_fn=local_fn)


def _local_norm_dims(func, args, kwargs, *, ord_, dims, keepdim, dtype, mesh, reduced):

    x = args[0]
    if x.numel() == 0 and ord_ in (float("inf"), float("-inf")):  # an empty piece (uneven shards):
        shape = [1 if d in dims else n for d, n in enumerate(x.shape) if keepdim or d not in dims]
        fill = 0.0 if ord_ > 0 else float("inf")  # the identity of its max / min (torch would raise)
        local = torch.full(shape, fill, dtype=dtype or x.dtype, device=x.device)
    else:
        local = torch.linalg.vector_norm(x, ord_, dims, keepdim, dtype=dtype)
    op, value = _norm_terms(local, ord_)
    for i in reduced:
        all_reduce_(value, op, mesh.get_group(i))
    value = _norm_from_terms(value, op, ord_)
    return value.to(local.dtype)


# ---- normalisation layers, softmax, losses ----------------------------------------------------------


def _keep(p: Placement, forbidden) -> bool:
    """A Shard placement that may stay: its dim is not in ``forbidden``."""
    return p.is_shard() and p.dim not in forbidden


def _common(placements, forbidden) -> Placement:
    """One mesh dim: the first operand Shard outside ``forbidden`` (the others move to it), else Replicate."""
    return next((p for p in placements if _keep(p, forbidden)), _R)


# ---- layer norm -----------------------------------------------------------------------------------


def _norm_dims(x: DTensorSpec, normalized_shape) -> tuple[int, int]:
    axis = x.ndim - len(normalized_shape)
    if axis < 0 or tuple(x.shape[axis:]) != tuple(normalized_shape):
        raise RuleError(f"normalized_shape {list(normalized_shape)} does not match input shape {list(x.shape)}")
    return axis, x.ndim


def _replicated_targets(specs) -> list:
    return [_spec(s, [_R] * len(s.placements), s.shape) for s in specs if isinstance(s, DTensorSpec)]


@register(aten.native_layer_norm.default)
def _layer_norm_rule(func, args, kwargs) -> Decision:
    x, normalized_shape = args[0], args[1]
    if not isinstance(x, DTensorSpec):
        raise RuleError("the input must be a DTensor")
    axis, n = _norm_dims(x, normalized_shape)
    forbidden = set(range(axis, n))
    placements = [_common([p], forbidden) for p in x.placements]
    stats_shape = (*x.shape[:axis], *([1] * (n - axis)))
    targets = [_spec(x, placements, x.shape), *_replicated_targets(args[2:4])]
    # AUDIT 9: the normalised output keeps the input's placements (its shape is the input's).
    out = _spec(x, placements, x.shape)
    stats = DTensorSpec(x.mesh, tuple(placements), stats_shape)
    return Decision(tuple(targets), (out, stats, stats))


@register(aten.native_layer_norm_backward.default)
def _layer_norm_backward_rule(func, args, kwargs) -> Decision:
    grad, x, normalized_shape, mean, rstd = args[:5]
    weight, bias = args[5], args[6]
    specs = (grad, x, mean, rstd)
    if not all(isinstance(s, DTensorSpec) for s in specs):
        raise RuleError("grad_output, input, mean and rstd must be DTensors")
    axis, n = _norm_dims(x, normalized_shape)
    forbidden = set(range(axis, n))
    placements = [
        _common([x.placements[i], grad.placements[i], mean.placements[i], rstd.placements[i]], forbidden)
        for i in range(len(x.placements))
    ]
    targets = [_spec(s, placements, s.shape) for s in specs]
    targets += _replicated_targets((weight, bias))
    param = [Partial("sum") if p.is_shard() else _R for p in placements]
    grad_in = _spec(x, placements, x.shape)
    grad_w = DTensorSpec(x.mesh, tuple(param), weight.shape) if isinstance(weight, DTensorSpec) else None
    grad_b = DTensorSpec(x.mesh, tuple(param), bias.shape) if isinstance(bias, DTensorSpec) else None
    return Decision(tuple(targets), (grad_in, grad_w, grad_b))


# ---- softmax / log-softmax ------------------------------------------------------------------------


@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def _softmax_rule(func, args, kwargs) -> Decision:
    x = args[0]
    dim = args[1] % max(x.ndim, 1)
    placements = [_common([p], {dim}) for p in x.placements]
    target = _spec(x, placements, x.shape)
    return Decision((target,), target)


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward_rule(func, args, kwargs) -> Decision:
    grad, out = args[0], args[1]
    if not isinstance(grad, DTensorSpec) or not isinstance(out, DTensorSpec):
        raise RuleError("grad_output and output must both be DTensors")
    dim = args[2] % max(out.ndim, 1)
    placements = [_common([po, pg], {dim}) for po, pg in zip(out.placements, grad.placements, strict=True)]
    target = _spec(out, placements, out.shape)
    return Decision((_spec(grad, placements, grad.shape), target), target)


# ---- nll_loss (cross-entropy on batch / sequence shards) ------------------------------------------


def _nll_placements(x: DTensorSpec, target: DTensorSpec, func):
    """Per mesh dim, the (input, target) placements: a shard of a batch / position dim of the
    input ([N, C, *]) pairs with the same dim of the target ([N, *]); the class dim is refused."""
    cdim = 1 if x.ndim >= 2 else 0
    if target.ndim != max(x.ndim - 1, 0):
        raise RuleError(f"input {list(x.shape)} and target {list(target.shape)} do not match")
    tx, tt = [], []
    for px, pt in zip(x.placements, target.placements, strict=True):
        if px.is_shard(cdim):
            raise RuleError(
                f"the input is sharded on its class dim {cdim} ({px}): cross-entropy over a vocabulary-sharded "
                "input is hpservice.parallel.vocab_parallel_cross_entropy(logits, target); or redistribute the "
                f"input to Replicate on dim {cdim} first"
            )
        if px.is_shard():
            tx.append(px)
            tt.append(Shard(px.dim - (px.dim > cdim)))
        elif pt.is_shard() and x.ndim >= 2:
            tt.append(pt)
            tx.append(Shard(pt.dim + (pt.dim >= cdim)))
        else:
            tx.append(_R)
            tt.append(_R)
    return tx, tt


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_rule(func, args, kwargs) -> Decision:
    """Input and target sharded alike on a batch / position dim. "none": the loss keeps the
    target's shards; "sum": the local sums are Partial(sum) (total_weight too); "mean": each rank
    divides its local sum by the global total weight (one all-reduce of a scalar), so the
    Partial(sum) of those is the global mean for any shard sizes and ignore_index;
    total_weight is then the global (Replicate) value."""
    x, target, weight, reduction = args[0], args[1], args[2], args[3]
    if not isinstance(x, DTensorSpec) or not isinstance(target, DTensorSpec):
        raise RuleError("input and target must both be DTensors (distribute the target like the input)")
    tx, tt = _nll_placements(x, target, func)
    sharded = tuple(i for i, p in enumerate(tt) if p.is_shard())
    targets = [_spec(x, tx, x.shape), _spec(target, tt, target.shape), *_replicated_targets([weight])]
    partial = [Partial("sum") if i in sharded else _R for i in range(len(tt))]
    scalar = DTensorSpec(x.mesh, tuple(partial), ())
    if reduction == 0:  # none
        out = (DTensorSpec(x.mesh, tuple(tt), target.shape), DTensorSpec(x.mesh, (_R,) * len(tt), ()))
        return Decision(tuple(targets), out)
    if reduction == 2 or not sharded:  # sum (or nothing sharded: the local op is the global one)
        tw = scalar if reduction == 2 else DTensorSpec(x.mesh, (_R,) * len(tt), ())
        return Decision(tuple(targets), (scalar, tw))
    local_fn = functools.partial(_local_nll_mean, mesh=x.mesh, mesh_dims=sharded)
    return Decision(tuple(targets), (scalar, DTensorSpec(x.mesh, (_R,) * len(tt), ())), local_fn=local_fn)


def _local_nll_mean(func, args, kwargs, *, mesh, mesh_dims):
    import torch.distributed as dist

    x, target, weight, _, ignore_index = args[:5]
    local_sum, total_weight = func(x, target, weight, 2, ignore_index)
    total_weight = total_weight.clone()
    for i in mesh_dims:
        all_reduce_(total_weight, dist.ReduceOp.SUM, mesh.get_group(i))
    return local_sum / total_weight, total_weight


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def _nll_loss_backward_rule(func, args, kwargs) -> Decision:
    grad, x, target, weight, reduction, _, total_weight = args[:7]
    if not all(isinstance(s, DTensorSpec) for s in (grad, x, target, total_weight)):
        raise RuleError("grad_output, input, target and total_weight must be DTensors")
    tx, tt = _nll_placements(x, target, func)
    # "none": the grad follows the target; otherwise it is a scalar. "mean" needs the global total weight.
    tgrad = _spec(grad, tt if reduction == 0 else [_R] * len(tt), grad.shape)
    ttw = _spec(total_weight, [_R] * len(tt), ()) if reduction == 1 else total_weight
    targets = [tgrad, _spec(x, tx, x.shape), _spec(target, tt, target.shape), *_replicated_targets([weight]), ttw]
    return Decision(tuple(targets), _spec(x, tx, x.shape))


# ---- fused RMSNorm (CUDA builds; on CPU F.rms_norm decomposes into pow/mean/rsqrt/mul) ------------


@register(aten._fused_rms_norm.default)
def _fused_rms_norm_rule(func, args, kwargs) -> Decision:
    """Like ``native_layer_norm``: dims that are not normalised keep their shards (the output keeps
    the input's placements, AUDIT 9), a normalised dim that is sharded or a Partial is gathered /
    reduced first; the weight is replicated. Outputs: (out, rstd)."""
    x, normalized_shape = args[0], args[1]
    if not isinstance(x, DTensorSpec):
        raise RuleError("the input must be a DTensor")
    axis, n = _norm_dims(x, normalized_shape)
    placements = [_common([p], set(range(axis, n))) for p in x.placements]
    stats = DTensorSpec(x.mesh, tuple(placements), (*x.shape[:axis], *([1] * (n - axis))))
    targets = [_spec(x, placements, x.shape), *_replicated_targets(args[2:3])]
    return Decision(tuple(targets), (_spec(x, placements, x.shape), stats))


@register(aten._fused_rms_norm_backward.default)
def _fused_rms_norm_backward_rule(func, args, kwargs) -> Decision:
    grad, x, normalized_shape, rstd, weight = args[:5]
    if not all(isinstance(s, DTensorSpec) for s in (grad, x, rstd)):
        raise RuleError("grad_output, input and rstd must be DTensors")
    axis, n = _norm_dims(x, normalized_shape)
    forbidden = set(range(axis, n))
    placements = [
        _common([x.placements[i], grad.placements[i], rstd.placements[i]], forbidden) for i in range(len(x.placements))
    ]
    targets = [_spec(s, placements, s.shape) for s in (grad, x, rstd)]
    targets += _replicated_targets((weight,))
    param = [Partial("sum") if p.is_shard() else _R for p in placements]
    grad_w = DTensorSpec(x.mesh, tuple(param), weight.shape) if isinstance(weight, DTensorSpec) else None
    return Decision(tuple(targets), (_spec(x, placements, x.shape), grad_w))
