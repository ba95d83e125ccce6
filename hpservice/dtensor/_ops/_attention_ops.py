"""Sharding rules for scaled-dot-product attention on CPU (forward and backward), per mesh dim.

``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` on CPU (no mask, no dropout) runs
``aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal) -> (out, lse)``
and its backward ``..._for_cpu_backward(grad_out, q, k, v, out, lse, dropout_p, is_causal)
-> (dq, dk, dv)``. Layouts: q ``[B, H, Sq, D]``, k ``[B, H, Skv, D]``, v ``[B, H, Skv, Dv]``,
out ``[B, H, Sq, Dv]``, lse ``[B, H, Sq]`` (the natural log of each query row's softmax
normaliser, scale included). ``is_causal`` is top-left aligned: query i sees keys j <= i.

Per mesh dim, q, k and v get one of four layouts (the cheapest for the operands' placements:
elements that must move, ties keep the query's placement; Partial operands are reduced first):

- ``Replicate`` everywhere, ``Shard(0)`` (batch) or ``Shard(1)`` (heads) on all three: every
  rank runs the kernel on its own rows; out and lse keep the placement. Heads / batch must have
  the same size in q, k and v.
- sequence parallel: q ``Shard(2)``, k and v ``Replicate`` on that mesh dim (a sequence-sharded
  k / v is all-gathered by the dispatcher, uneven ``torch.chunk`` pieces included); out and lse
  ``Shard(2)``. A rank holds the query rows ``[o, o + n)`` and all keys. Non-causal: one kernel
  call. Causal: keys ``[0, o)`` come before every local query, so they are one unmasked call
  (the "j < r" chunks, merged into one prefix), keys ``[o, o + n)`` are the diagonal block,
  causal within itself and top-left aligned (a kernel call with ``is_causal=True``), and keys
  from ``o + n`` on are never seen (the "j > r" chunks are skipped). No mask tensor is ever built
  (AUDIT 14): neither S x S nor local_q x global_kv.

Why the merge is exact: for a query row, softmax over the union of two disjoint key sets A and B
is ``exp(s - L)`` with ``L = log(exp(L_A) + exp(L_B))``; so ``out = exp(L_A - L) * out_A +
exp(L_B - L) * out_B`` (``out_X`` being the attention over X alone, ``L_X`` its logsumexp), and
``lse = logaddexp(L_A, L_B)`` is the global normaliser (computed with the max subtracted, so it
does not overflow).

Backward: the kernel rebuilds ``P = exp(q k^T * scale - lse)`` and ``D = rowsum(grad_out * out)``
from the ``out`` and ``lse`` it is given. Given the GLOBAL (merged) out and lse of this rank's
queries, ``P`` restricted to a key block is exactly the global attention probability on that
block and ``D`` is the global one, so each block's dq / dk / dv are the exact contributions of
these queries: dq is their sum over the blocks, dk / dv are laid out over the full key sequence
(zero where unseen) and summed over the ranks: reduce-scattered back to ``Shard(2)`` when k / v
came in sequence-sharded, ``Partial(sum)`` otherwise.

Not supported (a clear ``NotImplementedError`` naming the op and placements): ``attn_mask``,
``dropout_p > 0``, inputs that are not 4-d. The CUDA kernels (``_scaled_dot_product_flash_
attention``, ``_scaled_dot_product_efficient_attention`` and their backwards) have no rule: their
outputs include ints and RNG-state tensors that the dispatcher cannot pass through a rule's
output specs, and they cannot be tested on CPU.
"""

from __future__ import annotations

import functools
import math

import torch

from .._layout import DTensorSpec
from .._redistribute import execute_plan, plan_redistribution
from ..placement_types import Partial, Placement, Shard
from ._registry import _R, Decision, RuleError, _spec, register

aten = torch.ops.aten

_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SEQ = Shard(2)


def _arg(args, kwargs, pos: int, name: str, default):
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _check_supported(dropout_p, kwargs) -> None:
    if kwargs.get("attn_mask") is not None:
        raise RuleError("attn_mask is not supported on sharded inputs (use is_causal, or replicate q, k and v)")
    if dropout_p:
        raise RuleError(f"dropout_p={dropout_p} is not supported on sharded inputs")


def _move_cost(src: Placement, dst: Placement) -> int:
    """0 when nothing moves (same placement, or a slice of a replicated tensor), else 1."""
    if src == dst or (src.is_replicate() and not dst.is_replicate()):
        return 0
    return 1


def _choose(q: DTensorSpec, k: DTensorSpec, v: DTensorSpec):
    """Per mesh dim, the target placements of (q, k, v) and whether it is sequence parallel."""
    for s, name in ((q, "query"), (k, "key"), (v, "value")):
        if not isinstance(s, DTensorSpec):
            raise RuleError(f"the {name} must be a DTensor")
        if s.ndim != 4:
            raise RuleError(f"the {name} must be 4-d [batch, heads, seq, head_dim], got shape {list(s.shape)}")
    if k.shape[2] == 0:
        raise RuleError("attention over an empty key sequence is undefined")
    sizes = (math.prod(q.shape), math.prod(k.shape), math.prod(v.shape))
    layouts = [(_R, _R, _R)]
    for d in (0, 1):  # batch, heads: only when q, k and v agree on the size
        if q.shape[d] == k.shape[d] == v.shape[d]:
            layouts.append((Shard(d),) * 3)
    layouts.append((_SEQ, _R, _R))
    tq, tk, tv, seq = [], [], [], []
    for pq, pk, pv in zip(q.placements, k.placements, v.placements, strict=True):

        def key(c, pq=pq, pk=pk, pv=pv):
            cost = sum(_move_cost(p, t) * n for p, t, n in zip((pq, pk, pv), c, sizes, strict=True))
            return cost, c[0] != pq

        best = min(layouts, key=key)  # min keeps the first of equal keys: the order above breaks ties
        tq.append(best[0])
        tk.append(best[1])
        tv.append(best[2])
        seq.append(best[0] == _SEQ)
    return tq, tk, tv, seq


def _lse_shape(q: DTensorSpec) -> tuple[int, ...]:
    return tuple(q.shape[:3])


@register(_FWD)
def _sdpa_rule(func, args, kwargs) -> Decision:
    q, k, v = args[0], args[1], args[2]
    dropout_p = _arg(args, kwargs, 3, "dropout_p", 0.0)
    _check_supported(dropout_p, kwargs)
    tq, tk, tv, seq = _choose(q, k, v)
    tq_spec = _spec(q, tq, q.shape)
    out = DTensorSpec(q.mesh, tuple(tq), (*q.shape[:3], v.shape[3]))
    lse = DTensorSpec(q.mesh, tuple(tq), _lse_shape(q))
    local_fn = functools.partial(_local_forward, q_offset=tq_spec.local_offset[2] if any(seq) else None)
    return Decision((tq_spec, _spec(k, tk, k.shape), _spec(v, tv, v.shape)), (out, lse), local_fn=local_fn)


def _local_forward(func, args, kwargs, *, q_offset: int | None):
    """Attention of this rank's query rows ``[q_offset, q_offset + n)`` against all keys (sequence
    parallel), or of the local rows as on one device (``q_offset`` None: batch / heads / replicated)."""
    q, k, v = args[0], args[1], args[2]
    is_causal = bool(_arg(args, kwargs, 4, "is_causal", False))
    kw = {n: x for n, x in kwargs.items() if n not in ("dropout_p", "is_causal")}
    n, skv = q.shape[2], k.shape[2]
    if q.numel() == 0 or v.numel() == 0:  # an empty shard (the CPU kernel crashes on empty sequences)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # as the kernel's
        return q.new_zeros((*q.shape[:3], v.shape[3])), q.new_zeros(q.shape[:3], dtype=lse_dtype)
    if not is_causal or q_offset is None:  # all keys, or the same attention as on one device
        return func(q, k, v, 0.0, is_causal, **kw)
    parts = []
    prefix = min(q_offset, skv)
    if prefix:  # keys before every local query: no mask
        parts.append(func(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, **kw))
    end = min(q_offset + n, skv)
    if q_offset < end:  # the diagonal block, causal and top-left aligned within itself
        parts.append(func(q, k[:, :, q_offset:end], v[:, :, q_offset:end], 0.0, True, **kw))
    if len(parts) == 1:
        return parts[0]
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
    out = (o1.to(w1.dtype) * w1 + o2.to(w2.dtype) * w2).to(o1.dtype)
    return out, lse.to(l1.dtype)


@register(_BWD)
def _sdpa_backward_rule(func, args, kwargs) -> Decision:
    grad, q, k, v, out, lse = args[:6]
    dropout_p = _arg(args, kwargs, 6, "dropout_p", 0.0)
    _check_supported(dropout_p, kwargs)
    for s, name in ((grad, "grad_out"), (out, "out"), (lse, "logsumexp")):
        if not isinstance(s, DTensorSpec):
            raise RuleError(f"{name} must be a DTensor")
    tq, tk, tv, seq = _choose(q, k, v)
    tq_spec = _spec(q, tq, q.shape)
    targets = (
        _spec(grad, tq, grad.shape),
        tq_spec,
        _spec(k, tk, k.shape),
        _spec(v, tv, v.shape),
        _spec(out, tq, out.shape),
        _spec(lse, tq, lse.shape),
    )

    def grad_spec(x: DTensorSpec, target):
        # Sequence-parallel mesh dims: every rank holds contributions for all keys -> summed.
        partial = [Partial("sum") if s else t for s, t in zip(seq, target, strict=True)]
        final = [_SEQ if s and p == _SEQ else t for s, p, t in zip(seq, x.placements, partial, strict=True)]
        return DTensorSpec(x.mesh, tuple(partial), x.shape), DTensorSpec(x.mesh, tuple(final), x.shape)

    dk_partial, dk = grad_spec(k, tk)
    dv_partial, dv = grad_spec(v, tv)
    local_fn = functools.partial(
        _local_backward,
        q_offset=tq_spec.local_offset[2] if any(seq) else None,
        dk_specs=(dk_partial, dk),
        dv_specs=(dv_partial, dv),
    )
    return Decision(targets, (tq_spec, dk, dv), local_fn=local_fn)


def _local_backward(func, args, kwargs, *, q_offset: int | None, dk_specs, dv_specs):
    grad, q, k, v, out, lse = args[:6]
    is_causal = bool(_arg(args, kwargs, 7, "is_causal", False))
    kw = {n: x for n, x in kwargs.items() if n not in ("dropout_p", "is_causal")}
    n, skv = q.shape[2], k.shape[2]
    if q.numel() == 0 or v.numel() == 0:  # an empty shard: zero contributions
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    elif not is_causal or q_offset is None:
        dq, dk, dv = func(grad, q, k, v, out, lse, 0.0, is_causal, **kw)
    else:
        prefix = min(q_offset, skv)
        end = min(q_offset + n, skv)
        dq, pieces_k, pieces_v = None, [], []
        blocks = ((0, prefix, False), (q_offset, end, True))  # the unmasked prefix, the diagonal block
        for lo, hi, causal in blocks:
            if lo < hi:
                dq_j, dk_j, dv_j = func(grad, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse, 0.0, causal, **kw)
                dq = dq_j if dq is None else dq + dq_j
                pieces_k.append(dk_j)
                pieces_v.append(dv_j)
        if end < skv:  # keys after this rank's queries: no contribution
            pieces_k.append(k.new_zeros((*k.shape[:2], skv - end, k.shape[3])))
            pieces_v.append(v.new_zeros((*v.shape[:2], skv - end, v.shape[3])))
        dk, dv = torch.cat(pieces_k, dim=2), torch.cat(pieces_v, dim=2)
    return dq, _finish_grad(dk, *dk_specs), _finish_grad(dv, *dv_specs)


def _finish_grad(local: torch.Tensor, partial: DTensorSpec, final: DTensorSpec) -> torch.Tensor:
    """Reduce-scatter full-length partial key/value gradients back to the sequence shards."""
    if partial == final:
        return local
    return execute_plan(local.contiguous(), plan_redistribution(partial, final), partial)
