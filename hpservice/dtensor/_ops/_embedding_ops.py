"""Sharding rules of embedding lookups (forward and backward), per mesh dim.

- ``embedding(weight, ids)``: weight Replicate -> the output follows the ids (ids Shard(d) ->
  output Shard(d)); weight Shard(1) (embedding dim) -> output Shard(-1), ids Replicate; weight
  Shard(0) (vocab-parallel) -> ids Replicate, each rank looks up only the ids of its vocabulary
  range (the others map to local row 0 and their output rows are zeroed): output Partial(sum).
- ``embedding_dense_backward``: ids and grad sharded on the same batch dim -> Partial(sum); grad
  Shard(-1) -> Shard(1); otherwise replicated.
"""

from __future__ import annotations

import functools

import torch

from .._layout import DTensorSpec
from ..placement_types import Partial, Shard
from ._registry import _R, Decision, RuleError, _is_linear_partial, _spec, register

aten = torch.ops.aten


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
