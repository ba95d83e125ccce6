"""Sharding rules of elementwise ops: every op torch tags ``pointwise`` (and their in-place
forms), the layout ops ``copy_``/``zero_``/``fill_``/``clone``/``_to_copy``, the ``_foreach_*``
forms of those (``torch.optim``'s ``foreach=True``) and the fused optimizer kernels
(``fused=True``: elementwise over lists).

- Operands of one layout (fully replicated 0-d DTensors, a global norm or a clip coefficient,
  broadcast as scalars): the output has that layout, no communication.
- Different layouts or shapes (broadcasting): ``pointwise_decision`` picks the output layout as
  torch does (``R * S(0)`` is ``S(0)``, a local slice of the replicated operand); in-place ops
  keep ``self``'s layout and the other operands move to it.
- Partial operands: only ops that commute with the pending reduction keep them (add/sub of two
  operands Partial alike, scaling by a scalar, negation, copies). A non-linear op on a lone
  Partial(sum/avg) operand (``partial + 1e-6``) raises; with several DTensor operands
  (autograd's ``grad / count``) or a Partial(max/min) the Partials are reduced first.
- foreach / fused: element ``j`` of every list follows the rule above with ``self[j]``; the
  lists a kernel writes (fused optimizers write params, grads and states) must already have
  ``self[j]``'s layout (the dispatcher never redistributes a written operand).
"""

from __future__ import annotations

import torch

from .._layout import DTensorSpec
from ..placement_types import Placement, Shard
from ._registry import (
    _R,
    Decision,
    PlainTensor,
    RuleError,
    _is_linear_partial,
    _spec,
    flat_specs,
    one_mesh,
    rebind,
    register_family,
)

aten = torch.ops.aten

# Ops whose result on Partial inputs is still a valid Partial of the result (sum/avg reductions).
_PARTIAL_SAFE = {"clone", "detach", "alias", "_to_copy", "copy_", "zero_", "neg", "neg_"}
_PARTIAL_SCALE = {"mul", "mul_", "div", "div_"}
_PARTIAL_ADD = {"add", "add_", "sub", "sub_"}
# Elementwise ops torch does not tag pointwise: the layout ops and masked_fill (its mask broadcasts).
_LAYOUT_OPS = {
    aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten._to_copy.default, aten.clone.default,
    aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Tensor,
}  # fmt: skip
# Elementwise ops without torch's pointwise tag (rsub, activation backwards).
_UNTAGGED_ELEMENTWISE = {
    aten.rsub.Tensor, aten.rsub.Scalar, aten.floor_divide.default, aten.fill.Scalar, aten._conj.default,
    aten.elu_backward.default, aten.hardtanh_backward.default, aten.leaky_relu_backward.default,
    aten.mish_backward.default, aten.softplus_backward.default,
}  # fmt: skip
# torch.optim's fused=True kernels: per-tensor elementwise updates over lists (params, grads, states).
_FUSED_OPTIMIZERS = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}


def _is_pointwise_name(base: str) -> bool:
    if base in ("copy", "zero", "fill"):
        return True
    packet = getattr(aten, base, None)
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _is_pointwise(func) -> bool:
    return func in _LAYOUT_OPS or func in _UNTAGGED_ELEMENTWISE or torch.Tag.pointwise in func.tags


def _is_foreach(func) -> bool:
    name = func.overloadpacket.__name__
    if name in _FUSED_OPTIMIZERS:
        return True
    return name.startswith("_foreach_") and _is_pointwise_name(name[len("_foreach_") :].rstrip("_"))


def _is_scalar(s: DTensorSpec) -> bool:
    """A replicated 0-d DTensor (a global norm, a clip coefficient) acts as a scalar operand."""
    return s.ndim == 0 and s.is_replicated()


def _partial_ok(name: str, lead: DTensorSpec, self_is_lead: bool, n_main: int) -> bool:
    """Whether op ``name`` commutes with the pending reduction of its Partial operands (all of
    layout ``lead``; ``n_main``: the non-scalar DTensor operands)."""
    linear = all(p.reduce_op in ("sum", "avg") for p in lead.placements if p.is_partial())
    if name in _PARTIAL_SAFE and (linear or name not in ("neg", "neg_")):
        return True
    if linear and name in _PARTIAL_SCALE and n_main == 1:
        # Scaling a Partial by a scalar; dividing by a Partial is not linear.
        return name.startswith("mul") or self_is_lead
    return linear and name in _PARTIAL_ADD and n_main == 2


def _elementwise(name: str, specs: list[DTensorSpec], mutable: bool, self_is_dtensor: bool) -> Decision:
    """The decision for one elementwise application over DTensor operands ``specs`` (``self``
    first when ``self_is_dtensor``)."""
    main = [s for s in specs if not _is_scalar(s)]
    lead = specs[0] if mutable and self_is_dtensor else (main[0] if main else specs[0])
    if all(s == lead for s in main) and all(s.mesh == lead.mesh for s in specs):
        if not lead.has_partial():
            return Decision(tuple(specs), lead)
        if _partial_ok(name, lead, self_is_dtensor and specs[0] == lead, len(main)):
            return Decision(tuple(specs), lead)
        # not linear in the pending reduction: torch reduces the Partial first (pointwise_decision)
    return pointwise_decision(name, tuple(specs), mutable and self_is_dtensor)


@register_family(_is_pointwise, scalar_free=True)
def _pointwise_rule(func, args, kwargs) -> Decision:
    specs = flat_specs(args)
    self_is_dtensor = bool(args) and isinstance(args[0], DTensorSpec)
    return _elementwise(func.overloadpacket.__name__, specs, func._schema.is_mutable, self_is_dtensor)


@register_family(_is_foreach, scalar_free=True)
def _foreach_rule(func, args, kwargs) -> Decision:
    """Element ``j`` of each list argument (and any single DTensor scalar) with ``self[j]``."""
    name = func.overloadpacket.__name__
    base = name if name in _FUSED_OPTIMIZERS else name[len("_foreach_") :]
    mutable = func._schema.is_mutable
    selves = args[0]
    lists = [i for i, a in enumerate(args) if isinstance(a, tuple)]
    singles = [i for i, a in enumerate(args) if isinstance(a, DTensorSpec)]
    for i in singles:
        if not _is_scalar(args[i]):
            raise RuleError(f"argument {i}: a single DTensor operand to a foreach op must be a replicated scalar")
    if any(len(args[i]) not in (0, len(selves)) for i in lists):
        raise RuleError("tensor lists of different lengths")
    target: dict[tuple[int, int | None], DTensorSpec] = {(i, None): args[i] for i in singles}
    outs = []
    for j in range(len(selves)):
        operands = [(i, j) for i in lists if args[i] and isinstance(args[i][j], DTensorSpec)]
        operands += [(i, None) for i in singles]
        if not operands:
            outs.append(None)
            continue
        specs = [args[i][j] if j is not None else args[i] for i, j in operands]
        plain = [args[i][j] for i in lists if args[i] and isinstance(args[i][j], PlainTensor) and args[i][j].shape]
        if plain:
            raise RuleError(f"element {j} mixes DTensors with a torch.Tensor of shape {plain[0].shape}")
        if name in _FUSED_OPTIMIZERS and any(s.has_partial() for s in specs):
            raise RuleError(f"{name} on Partial DTensors (reduce the gradients first)")
        d = _elementwise(base, specs, mutable, isinstance(selves[j], DTensorSpec))
        for key, t in zip(operands, d.targets, strict=True):
            if key[1] is None:
                if t != rebind(target[key], t.mesh):
                    raise RuleError(f"argument {key[0]}: the scalar DTensor would need a redistribution")
                continue  # a replicated scalar: the same local value on every element's mesh
            target[key] = t
        outs.append(d.out)
    flat = []
    for i, a in enumerate(args):
        if isinstance(a, DTensorSpec):
            flat.append(target[(i, None)])
        elif isinstance(a, tuple):
            flat.extend(target[(i, j)] for j, x in enumerate(a) if isinstance(x, DTensorSpec))
    return Decision(tuple(flat), None if mutable else tuple(outs))


_foreach_rule.per_element = True  # parameters of one optimizer may live on different meshes


def _broadcast_placement(out_p: Placement, out_shape, shape) -> Placement:
    """The placement an operand of ``shape`` needs so that broadcasting its local piece against
    the output's local piece is right (right-aligned; a size-1 or missing dim -> Replicate)."""
    if out_p.is_shard():
        d = out_p.dim - (len(out_shape) - len(shape))
        if d < 0 or shape[d] != out_shape[out_p.dim]:
            return _R
        return Shard(d)
    return out_p


def _all_partial(specs, i: int, p: Placement) -> bool:
    """Whether every operand is Partial ``p`` on mesh dim ``i`` and there are two of them: a sum of
    pending sums is one; a pending sum plus a number (``x + 1``: the number added on every rank)
    is not."""
    return len(specs) > 1 and all(s.placements[i] == p for s in specs)


def pointwise_decision(name: str, specs: tuple[DTensorSpec, ...], mutable: bool) -> Decision:
    """Operands with different layouts. In-place ops keep ``self``'s layout. Otherwise, per mesh
    dim, the output is sharded where any operand is sharded on a dim of the output's size
    (redistributing a Replicate operand to it is a local slice, so ``R * S(0)`` is ``S(0)`` with
    no communication, as in torch); the dim most operands shard wins, then the lowest, so the
    layout does not depend on operand order. Partial stays only for add/sub of operands Partial
    with the same op; otherwise Partials are reduced (to the shard, or to Replicate)."""
    mesh = one_mesh(specs)
    specs = tuple(rebind(s, mesh) for s in specs)
    try:
        out_shape = tuple(torch.broadcast_shapes(*(s.shape for s in specs)))
    except RuntimeError as e:
        raise RuleError(str(e)) from None
    ref = specs[0] if mutable else max(specs, key=lambda s: (s.ndim, s.shape == out_shape))
    if mutable and ref.shape != out_shape:
        raise RuleError("in-place op: self cannot be broadcast")
    linear_add = name in _PARTIAL_ADD
    out = []
    for i in range(mesh.ndim):
        if mutable:
            p = ref.placements[i]
            if p.is_partial():  # self stays Partial only under add/sub of the same Partial
                keep = linear_add and _is_linear_partial(p) and _all_partial(specs, i, p)
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
            keep = linear_add and _is_linear_partial(p) and _all_partial(specs, i, p)
            out.append(p if keep else _R)
        else:
            out.append(_R)
    targets = tuple(_spec(s, [_broadcast_placement(p, out_shape, s.shape) for p in out], s.shape) for s in specs)
    if mutable and targets[0] != specs[0]:
        raise RuleError("in-place op: self would need a redistribution; redistribute it first")
    return Decision(targets, _spec(ref, out, out_shape))
