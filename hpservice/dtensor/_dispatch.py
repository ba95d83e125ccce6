"""Operator dispatch for DTensor: one path for every op, as torch's.

    propagate (the op's rule, ``_ops``; cached) -> redistribute the operands whose layout differs
    from the rule's (into new DTensors, never in place) -> run the op, or the rule's local
    function, on the local tensors -> wrap the result(s) in the rule's output spec(s).

The rules live in ``_ops``, one file per op family (views, matrix products, pointwise and
foreach, reductions and norms, tensor building and indexing, embedding, attention, random).
An op without a rule runs only when every DTensor operand is fully replicated (the local
result is then the global one); otherwise it raises naming the op and the placements.

Before propagation, in-place ops are refused where torch would write through a view we could
not honour (a "view" computed from redistributed data: the write would miss the input's
shards) or where the wrapper's shape would go stale (``unsqueeze_``); an operand the op writes
is never redistributed (the write would be lost), so a rule asking for that raises. Plain tensors
join DTensors only as 0-d scalars (and as all-zero entries of a tensor list: autograd's
gradients of unused ``split`` outputs). ``is_same_size`` and ``item()`` are answered directly,
as torch's custom handlers are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ._api import DTensor, _redistribute
from ._layout import DTensorSpec
from ._ops import LocalShaped, PlainTensor, RuleError, decide, rule_for, written_args
from ._ops._registry import same_ranks
from .placement_types import Replicate

aten = torch.ops.aten

# In-place ops that change a tensor's shape or strides: the wrapper's metadata is fixed at creation.
_METADATA_INPLACE = {
    "unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_", "resize_",
    "resize_as_", "set_",
}  # fmt: skip


class _OpInfo(NamedTuple):
    """What dispatch needs to know about an op overload, looked up once."""

    handler: Callable | None  # answered without a rule (``_CUSTOM_HANDLERS``)
    scalar_free: bool  # its rule ignores Python numbers (left out of the cache key)
    per_element: bool  # foreach: list elements are checked per element by the rule
    mutable: bool
    changes_metadata: bool  # in-place shape/stride change (``unsqueeze_``)
    written: frozenset[int]  # argument positions it writes
    is_view: bool


class IMPLICIT_REPLICATION:
    """Whether plain tensors mixed with DTensors are taken as replicated
    (``hpservice.dtensor.experimental.implicit_replication``)."""

    enabled = False


@functools.lru_cache(maxsize=4096)
def _op_info(func) -> _OpInfo:
    rule, scalar_free = rule_for(func)
    return _OpInfo(
        handler=_CUSTOM_HANDLERS.get(func),
        scalar_free=scalar_free,
        per_element=getattr(rule, "per_element", False),
        mutable=func._schema.is_mutable,
        changes_metadata=func.overloadpacket.__name__ in _METADATA_INPLACE,
        written=written_args(func),
        is_view=func.is_view,
    )


def dispatch(func, args: tuple, kwargs: dict):
    info = _op_info(func)
    if info.handler is not None:
        return info.handler(func, args, kwargs)
    self = args[0] if args and isinstance(args[0], DTensor) else None
    if info.mutable and self is not None and (self._copy_of is not None or info.changes_metadata):
        raise _refused_inplace(func, self)
    if not info.per_element and any(isinstance(a, list | tuple) for a in args):
        args = tuple(_list_operands(func, a) if isinstance(a, list | tuple) else a for a in args)
    ops = _flatten(args, info)
    if ops.plain is not None and ops.dts and (_is_one_element(ops.plain) or IMPLICIT_REPLICATION.enabled):
        ops = _flatten(_plain_replicated(args, ops.dts[0]._spec.mesh), info)  # off the path of every other op
    dts = ops.dts
    if ops.plain is not None and dts:  # torch checks the mix before any sharding rule: RuntimeError
        raise _mixed(func, dts, ops.plain)
    decision = _propagate(func, ops.frozen, kwargs, dts, info.scalar_free)
    local_args, moved = _local_operands(func, ops, decision, info)
    for v in kwargs.values():
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            raise _mixed(func, dts, v)
    if decision.local_shape_arg is not None:
        local_args[decision.local_shape_arg] = list(decision.out.local_shape)
    if decision.local_fn is not None:
        out = decision.local_fn(func, tuple(local_args), kwargs)
    else:
        out = func(*local_args, **kwargs)
    if info.mutable and self is not None:
        return None if out is None else self
    result = _wrap(out, decision.out)
    if info.is_view and (moved or any(d._copy_of is not None for d in dts)):
        # torch's result would alias the input; ours was computed from a redistributed copy.
        for o in result if isinstance(result, tuple | list) else (result,):
            if isinstance(o, DTensor):
                o._copy_of = f"{func} on placements {dts[0].placements}"
    return result


class _Operands(NamedTuple):
    """``args`` flattened once (torch's dispatcher flattens its arguments once, too): what the rule
    sees and what the local op will take."""

    frozen: tuple  # the hashable stand-in of args: the rule's cache key
    dts: list  # the DTensor operands, in flattened order (the rule's targets are in this order)
    local: list  # args with lists copied; each DTensor's slot is filled with its local tensor
    slots: list  # (argument index, index in its list or None) of each of dts
    plain: torch.Tensor | None  # the first plain tensor operand that cannot mix with DTensors


def _flatten(args: tuple, info: _OpInfo) -> _Operands:
    """One pass over ``args`` (lists one level deep: ``cat``, ``stack``, foreach ops). Plain
    tensors in the lists of a per-element (foreach) op are checked element by element by its
    rule; anywhere else a non-scalar plain tensor is refused, before any rule runs (as torch)."""
    frozen, dts, local, slots, plain = [], [], [], [], None
    for i, a in enumerate(args):
        if isinstance(a, DTensor):
            frozen.append(a._spec)
            dts.append(a)
            slots.append((i, None))
            local.append(a)
        elif isinstance(a, list | tuple):
            items = []
            for j, x in enumerate(a):
                if isinstance(x, DTensor):
                    items.append(x._spec)
                    dts.append(x)
                    slots.append((i, j))
                else:
                    if plain is None and isinstance(x, torch.Tensor) and x.ndim > 0 and not info.per_element:
                        plain = x
                    items.append(_freeze(x, info.scalar_free))
            frozen.append(tuple(items))
            local.append(list(a))
        else:
            if plain is None and isinstance(a, torch.Tensor) and a.ndim > 0:
                plain = a
            frozen.append(_freeze(a, info.scalar_free))
            local.append(a)
    return _Operands(tuple(frozen), dts, local, slots, plain)


def _propagate(func, frozen_args: tuple, kwargs: dict, dts: list, scalar_free: bool):
    """The rule's decision for these operand specs (cached on the frozen arguments)."""
    frozen_kwargs = tuple(sorted((k, _freeze(v, scalar_free)) for k, v in kwargs.items())) if kwargs else ()
    mesh_ids = tuple(id(d._spec.mesh) for d in dts)
    try:
        try:
            return decide(func, frozen_args, frozen_kwargs, mesh_ids)
        except TypeError:  # an unhashable argument: decide without the cache
            return decide.__wrapped__(func, frozen_args, frozen_kwargs, mesh_ids)
    except RuleError as e:
        raise _unsupported(func, dts, str(e)) from None


def _local_operands(func, ops: _Operands, decision, info: _OpInfo) -> tuple[list, bool]:
    """The local tensors to run on, each DTensor moved to its target spec first; and whether any
    had to be moved."""
    if ops.plain is not None:
        # RuntimeError, not TypeError: torch turns a TypeError in a binary operator into NotImplemented.
        raise _mixed(func, ops.dts, ops.plain)
    local_args, moved = ops.local, False
    for dt, (i, j), target in zip(ops.dts, ops.slots, decision.targets, strict=True):
        local, m = _at_target(func, dt, target, i, info)
        moved |= m
        if j is None:
            local_args[i] = local
        else:
            local_args[i][j] = local
    return local_args, moved


def _at_target(func, a: DTensor, target: DTensorSpec, position: int, info: _OpInfo) -> tuple[torch.Tensor, bool]:
    """(the local tensor of ``a`` in the layout ``target``, whether it had to be redistributed)."""
    src = a._spec
    if src is target or (src.placements == target.placements and src.mesh == target.mesh):
        return a._wait_local(), False
    if src.is_replicated() and target.is_replicated() and same_ranks(src.mesh, target.mesh):
        return a._wait_local(), False  # the same value on the same ranks (_registry.one_mesh)
    return _move(func, a, target, position, info)._wait_local(), True


def _move(func, a: DTensor, target: DTensorSpec, position: int, info: _OpInfo) -> DTensor:
    if position in info.written:
        raise _unsupported(
            func,
            [a],
            f"argument {position} is written in place and would need a redistribution to "
            f"({', '.join(map(str, target.placements))}) first; redistribute it yourself (or use the out-of-place op)",
        )
    return _redistribute(a, target, False)


def _wrap(out, spec):
    if isinstance(out, torch.Tensor):
        if spec is None:
            return out
        if isinstance(spec, LocalShaped):  # fully replicated: the local result is the global one
            placements = (Replicate(),) * spec.mesh.ndim
            return DTensor(out, DTensorSpec(spec.mesh, placements, tuple(out.shape), tuple(out.stride())))
        return DTensor(out, spec, requires_grad=False)
    if isinstance(out, tuple | list):
        # LocalShaped is a NamedTuple, yet one spec for every output (a replicated fallback)
        several = isinstance(spec, tuple) and not isinstance(spec, LocalShaped)
        specs = spec if several else (spec,) * len(out)
        return type(out)(_wrap(o, s) for o, s in zip(out, specs, strict=True))
    return out


def _freeze(x, scalar_free: bool):
    """A hashable stand-in for an argument: DTensor -> its spec, lists -> tuples, plain tensors ->
    (shape, dtype); Python numbers -> None for rules that ignore them (``scalar_free``)."""
    if isinstance(x, DTensor):
        return x._spec
    if isinstance(x, list | tuple):
        return tuple(_freeze(v, scalar_free) for v in x)
    if isinstance(x, torch.Tensor):
        return PlainTensor(tuple(x.shape), x.dtype)
    if scalar_free and isinstance(x, int | float | complex):
        return None
    return x


def _is_one_element(x) -> bool:
    """A plain 1-d tensor of one element (``torch.tensor([q])``, as torch's own decompositions
    make): torch takes it as a replicated value beside DTensors (with a warning there), and so do
    we, unless it requires a gradient (wrap it yourself with ``from_local``)."""
    return type(x) is torch.Tensor and x.ndim == 1 and x.numel() == 1 and not x.requires_grad


def _replicated_plain(x: torch.Tensor, mesh) -> DTensor:
    return DTensor(x, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(x.shape)), requires_grad=False)


def _plain_replicated(args: tuple, mesh) -> tuple:
    """``args`` with each top-level one-element plain tensor (every non-0-d plain tensor under
    ``implicit_replication``) a Replicate DTensor on ``mesh`` (tensor lists: ``_list_operands``)."""
    implicit = IMPLICIT_REPLICATION.enabled

    def replicated(a) -> bool:
        if implicit:
            return isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim > 0
        return _is_one_element(a)

    return tuple(_replicated_plain(a, mesh) if replicated(a) else a for a in args)


def _list_operands(func, items):
    """A tensor-list argument mixing DTensors and plain tensors (``cat``, ``stack``): the plain
    ones are accepted, as Replicate DTensors, when they are all zeros (autograd fills the gradients
    of unused ``split`` / ``unbind`` outputs with ``torch.zeros``) or one-element 1-d tensors
    (``_is_one_element``)."""
    has_dtensor = has_plain = False
    for x in items:
        if isinstance(x, DTensor):
            has_dtensor = True
        elif isinstance(x, torch.Tensor):
            has_plain = True
    if not (has_dtensor and has_plain):
        return items
    mesh = next(x for x in items if isinstance(x, DTensor))._spec.mesh
    out = []
    for x in items:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            if x.ndim > 0 and not IMPLICIT_REPLICATION.enabled and not _is_one_element(x) and x.any():
                raise _mixed(func, [d for d in items if isinstance(d, DTensor)], x, in_list=True)
            x = _replicated_plain(x, mesh)
        out.append(x)
    return out


# ---- answered without a rule (torch's custom op handlers) -----------------------------------------


def _is_same_size(func, args, kwargs) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


def _item(func, args, kwargs):
    self = args[0]
    if not self._spec.is_replicated():
        raise _unsupported(func, [self], "item() needs a fully replicated DTensor; call full_tensor() first")
    return self._wait_local().item()


_CUSTOM_HANDLERS = {aten.is_same_size.default: _is_same_size, aten._local_scalar_dense.default: _item}


# ---- errors -----------------------------------------------------------------------------------------


def _unsupported(func, dts, why: str, error: type[Exception] = NotImplementedError) -> Exception:
    """The one error of this dispatcher: the op, the placements of its DTensor operands, why."""
    placements = ", ".join("(" + ", ".join(map(str, d.placements)) + ")" for d in dts)
    return error(f"hpservice.dtensor: {func} on DTensor placements [{placements}]: {why}")


def _mixed(func, dts, tensor: torch.Tensor, in_list: bool = False) -> RuntimeError:
    where = " in a tensor list" if in_list else ""
    return _unsupported(
        func,
        dts,
        f"mixes a DTensor with a torch.Tensor of shape {tuple(tensor.shape)}{where}; wrap it with "
        "DTensor.from_local or distribute_tensor first (0-d tensors are allowed as scalars)",
        RuntimeError,
    )


def _refused_inplace(func, self: DTensor) -> NotImplementedError:
    """In-place ops torch would apply but we could not: writes into a "view" computed from
    redistributed data (they would miss the original's shards), and ops changing the shape."""
    if self._copy_of is None:
        name = func.overloadpacket.__name__
        return _unsupported(
            func, [self], f"in-place {name} would change the DTensor's shape or strides; use the out-of-place op"
        )
    return _unsupported(
        func,
        [self],
        f"in-place write into the result of {self._copy_of}, which is not a view of its input: that input had "
        "to be redistributed first, so the write would not reach it; redistribute the input to the "
        "placements the view needs (or write out of place)",
    )
