"""Sharding rules for the layers of a transformer: embedding, layer norm, softmax / log-softmax
(forward and backward), per mesh dim, in the style of ``_rules.py``.

- ``embedding(weight, ids)``: weight Replicate -> the output follows the ids (ids Shard(d) ->
  output Shard(d)); weight Shard(1) (embedding dim) -> output Shard(-1), ids Replicate; weight
  Shard(0) (vocab-parallel) -> ids Replicate, each rank looks up only the ids of its vocabulary
  range (the others map to local row 0 and their output rows are zeroed): output Partial(sum).
- ``embedding_dense_backward``: ids and grad sharded on the same batch dim -> Partial(sum); grad
  Shard(-1) -> Shard(1); otherwise replicated.
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

import torch

from .._layout import DTensorSpec
from ..placement_types import Partial, Placement, Shard
from ._rules import _R, Decision, RuleError, _is_linear_partial, _spec, register

aten = torch.ops.aten


def _keep(p: Placement, forbidden) -> bool:
    """A Shard placement that may stay: its dim is not in ``forbidden``."""
    return p.is_shard() and p.dim not in forbidden


def _common(placements, forbidden) -> Placement:
    """One mesh dim: the first operand Shard outside ``forbidden`` (the others move to it), else Replicate."""
    return next((p for p in placements if _keep(p, forbidden)), _R)


# ---- embedding ------------------------------------------------------------------------------------


@register(aten.embedding.default)
def _embedding_rule(func, args, kwargs) -> Decision:
    weight, ids = args[0], args[1]
    if not isinstance(weight, DTensorSpec) or not isinstance(ids, DTensorSpec):
        raise RuleError("weight and indices must both be DTensors (wrap the ids with DTensor.from_local)")
    if weight.ndim != 2:
        raise RuleError("the weight must be 2-d")
    out_ndim = ids.ndim + 1
    tw, ti, out = [], [], []
    for pw, pi in zip(weight.placements, ids.placements, strict=True):
        if pi.is_partial():
            pi = _R
        if pw.is_replicate():
            tw.append(_R)
            ti.append(pi)
            out.append(pi)
        elif pw == Shard(1):
            tw.append(pw)
            ti.append(_R)  # the ids are the smaller operand: gather them
            out.append(Shard(out_ndim - 1))
        elif pw == Shard(0):
            tw.append(pw)
            ti.append(_R)
            out.append(Partial("sum"))
        elif _is_linear_partial(pw):  # linear in the weight
            tw.append(pw)
            ti.append(_R)
            out.append(pw)
        else:
            tw.append(_R)
            ti.append(pi)
            out.append(pi)
    tw_spec = _spec(weight, tw, weight.shape)
    local_fn = None
    if any(p == Shard(0) for p in tw):
        lo = tw_spec.local_offset[0]
        local_fn = functools.partial(_masked_embedding, lo=lo, hi=lo + tw_spec.local_shape[0])
    out_spec = DTensorSpec(weight.mesh, tuple(out), (*ids.shape, weight.shape[1]))
    return Decision((tw_spec, _spec(ids, ti, ids.shape)), out_spec, local_fn=local_fn)


def _masked_embedding(func, args, kwargs, *, lo: int, hi: int):
    """Vocab-parallel lookup: ids outside [lo, hi) read local row 0 and their rows are zeroed."""
    weight, ids = args[0], args[1]
    if hi == lo:  # an empty vocabulary chunk (uneven torch.chunk sizes)
        return weight.new_zeros((*ids.shape, weight.shape[1]))
    outside = (ids < lo) | (ids >= hi)
    local_ids = torch.where(outside, torch.zeros_like(ids), ids - lo)
    out = func(weight, local_ids, *args[2:], **kwargs)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@register(aten.embedding_dense_backward.default)
def _embedding_backward_rule(func, args, kwargs) -> Decision:
    grad, ids, num_weights = args[0], args[1], args[2]
    if not isinstance(grad, DTensorSpec) or not isinstance(ids, DTensorSpec):
        raise RuleError("grad_output and indices must both be DTensors")
    scale_by_freq = bool(args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False))
    batch = set(range(ids.ndim))
    tg, ti, out = [], [], []
    for pg, pi in zip(grad.placements, ids.placements, strict=True):
        if scale_by_freq:  # frequencies are counted over all the ids: everything replicated
            tg.append(_R)
            ti.append(_R)
            out.append(_R)
            continue
        shard = next((p for p in (pi, pg) if p.is_shard() and p.dim in batch), None)
        if shard is not None:  # each rank holds the grad rows of its own ids: partial sums
            tg.append(shard)
            ti.append(shard)
            out.append(Partial("sum"))
        elif pg.is_shard():  # the embedding dim
            tg.append(pg)
            ti.append(_R)
            out.append(Shard(1))
        elif _is_linear_partial(pg):
            tg.append(pg)
            ti.append(_R)
            out.append(pg)
        else:
            tg.append(_R)
            ti.append(_R)
            out.append(_R)
    out_spec = DTensorSpec(grad.mesh, tuple(out), (num_weights, grad.shape[-1]))
    return Decision((_spec(grad, tg, grad.shape), _spec(ids, ti, ids.shape)), out_spec)


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


@register(aten._softmax.default, aten._log_softmax.default)
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
        dist.all_reduce(total_weight, group=mesh.get_group(i))
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
