"""Operator dispatch for DTensor: run supported aten ops on the local tensors.

Supported here:
- pointwise ops (``torch.Tag.pointwise``), their in-place forms and ``copy_``/``zero_``/``fill_``/
  ``_to_copy``: the fast path needs every DTensor operand to share mesh, placements and global
  shape (fully replicated operands may broadcast); plain-tensor operands must be scalars (0-d).
  Operands of different shapes (broadcasting) or a Partial operand next to a non-Partial one go
  through the ``pointwise_decision`` rule (``_ops``); same-shape operands with different
  non-Partial placements still raise (redistribute one of them explicitly);
- ``_foreach_*`` forms of those ops, element by element, so ``torch.optim`` works with foreach;
- ``detach``/``alias``, ``*_like`` factories, ``is_same_size``, ``item`` of replicated tensors;
- random ops (``uniform_``, ``normal_``, ``bernoulli_``, ``native_dropout``...) through the RNG
  tracker in ``random.py``;
- ops with a sharding rule in ``_ops.RULES`` (mm/addmm/bmm, t/transpose/permute, view/
  _unsafe_view/expand/unsqueeze/squeeze, sum/mean, amax/amin/max/min/argmax/argmin, cat/stack/
  split/unbind/slice/select, new_* factories, scatter/gather, embedding, native_layer_norm,
  _fused_rms_norm, _softmax, _log_softmax, nll_loss(2d) and their backwards; a tensor-list
  argument such as ``cat``'s counts as its elements): the rule picks target input specs and the output spec, or
  one spec per output (cached); operands that differ are redistributed into new DTensors (never
  in place) before the op runs on the local tensors;
- any op whose DTensor operands are all fully replicated.

Partial placements only allow ops that commute with the pending reduction (add/sub of two
Partial operands, scaling by a scalar, negation, copies). A non-linear op on a lone
Partial(sum/avg) operand (``partial + 1e-6``) raises naming the op and the placements; with
several DTensor operands (autograd's ``grad / count``) or a Partial(max/min) the Partials are
reduced to Replicate first.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._api import DTensor, _redistribute
from ._layout import DTensorSpec
from ._ops import RULES, decide, pointwise_decision
from ._ops._rules import RuleError

aten = torch.ops.aten

_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}
_ALIAS = {aten.detach.default, aten.alias.default}
_LAYOUT_OPS = {aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten._to_copy.default, aten.clone.default}
# Ops whose result on Partial inputs is still a valid Partial of the result (sum/avg reductions).
_PARTIAL_SAFE = {"clone", "detach", "alias", "_to_copy", "copy_", "zero_", "neg", "neg_"}
_PARTIAL_SCALE = {"mul", "mul_", "div", "div_"}
_PARTIAL_ADD = {"add", "add_", "sub", "sub_"}
# torch.optim's fused=True kernels: per-tensor elementwise updates over lists (params, grads, states).
_FUSED_OPTIMIZERS = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
_RANDOM = {"uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_"}


def _is_pointwise_name(base: str) -> bool:
    if base in ("copy", "zero", "fill"):
        return True
    packet = getattr(aten, base, None)
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


@functools.lru_cache(maxsize=2048)
def _classify(func) -> str:
    name = func.overloadpacket.__name__
    if func in _ALIAS:
        return "alias"
    if func in _LIKE:
        return "like"
    if func is aten.is_same_size.default:
        return "same_size"
    if func is aten._local_scalar_dense.default:
        return "item"
    if func is aten.native_dropout.default or name in _RANDOM:
        return "random"
    if func in (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar):
        return "norm"
    if name in _FUSED_OPTIMIZERS:  # elementwise per tensor, like the foreach ops
        return "foreach"
    if name.startswith("_foreach_"):
        return "foreach" if _is_pointwise_name(name[len("_foreach_") :].rstrip("_")) else "unsupported"
    if torch.Tag.pointwise in func.tags or func in _LAYOUT_OPS:
        return "pointwise"
    return "unsupported"


# In-place ops that change a tensor's shape or strides: the wrapper's metadata is fixed at creation.
_METADATA_INPLACE = {
    "unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_", "resize_",
    "resize_as_", "set_",
}  # fmt: skip


def dispatch(func, args: tuple, kwargs: dict):
    if _is_mutable(func) and args and isinstance(args[0], DTensor):
        self = args[0]
        if self._copy_of is not None or _changes_metadata(func):
            raise _refused_inplace(func, self)
    kind = _classify(func)
    if kind == "pointwise":
        return _pointwise(func, args, kwargs)
    if kind == "foreach":
        return _foreach(func, args, kwargs)
    if kind == "alias":
        self = args[0]
        return DTensor(func(self._wait_local()), self._spec, requires_grad=False)
    if kind == "like":
        self = args[0]
        spec = self._spec
        if spec.has_partial():  # a fresh value is the same on every rank: Replicate, not Partial
            spec = spec.with_placements(tuple(_replicate_if_partial(p) for p in spec.placements))
        return DTensor(func(self._wait_local(), *args[1:], **kwargs), spec, requires_grad=False)
    if kind == "same_size":
        return tuple(args[0].shape) == tuple(args[1].shape)
    if kind == "item":
        self = args[0]
        if not self._spec.is_replicated():
            raise _unsupported(func, [self], "item() needs a fully replicated DTensor; call full_tensor() first")
        return self._wait_local().item()
    if kind == "random":
        from .random import random_op

        return random_op(func, args, kwargs)
    if kind == "norm":
        return _norm(func, args, kwargs)
    dts = _dtensors_in(args, kwargs)
    if dts and all(d._spec.is_replicated() and d._spec.mesh == dts[0]._spec.mesh for d in dts):
        return _replicated(func, args, kwargs, dts[0]._spec)
    if dts and func in RULES:
        return _run_rule(func, args, kwargs, dts)
    raise _unsupported(func, dts, "this operator has no sharding rule yet")


@functools.lru_cache(maxsize=512)
def _changes_metadata(func) -> bool:
    return func.overloadpacket.__name__ in _METADATA_INPLACE


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


def _dtensors_in(args: tuple, kwargs: dict) -> list:
    """The DTensor operands, in order (ATen arguments nest at most one list deep); cheaper than a
    pytree flatten on this per-op path."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, DTensor):
            found.append(a)
        elif isinstance(a, list | tuple):
            found.extend(x for x in a if isinstance(x, DTensor))
    return found


def _freeze(x):
    """A hashable stand-in for an argument: DTensor -> its spec, lists -> tuples."""
    if isinstance(x, DTensor):
        return x._spec
    if isinstance(x, list | tuple):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype)
    return x


def _run_rule(func, args: tuple, kwargs: dict, dts):
    """Redistribute operands to the rule's target specs (new DTensors; the operands are never
    written), run ``func`` on the local tensors and wrap the result in the rule's output spec."""
    args = tuple(_list_operands(func, a, dts) if isinstance(a, list | tuple) else a for a in args)
    frozen_args = _freeze(args)
    frozen_kwargs = tuple(sorted((k, _freeze(v)) for k, v in kwargs.items()))
    try:
        try:
            decision = decide(func, frozen_args, frozen_kwargs)
        except TypeError:  # an unhashable argument: decide without the cache
            decision = decide.__wrapped__(func, frozen_args, frozen_kwargs)
    except RuleError as e:
        raise _unsupported(func, dts, str(e)) from None
    targets = iter(decision.targets)
    moved = False

    def local(a):
        nonlocal moved
        if isinstance(a, DTensor):
            target = next(targets)
            src = a._spec
            if src is not target and (src.placements != target.placements or src.mesh != target.mesh):
                a = _redistribute(a, target, False)
                moved = True
            return a._wait_local()
        if isinstance(a, torch.Tensor) and a.ndim > 0:
            raise RuntimeError(
                f"hpservice.dtensor: {func} mixes a DTensor with a torch.Tensor of shape {tuple(a.shape)}; "
                "wrap it with DTensor.from_local or distribute_tensor first"
            )
        return a

    local_args = [
        [local(x) for x in a] if isinstance(a, list | tuple) and any(isinstance(x, DTensor) for x in a) else local(a)
        for a in args
    ]
    if decision.local_shape_arg is not None:
        local_args[decision.local_shape_arg] = list(decision.out.local_shape)
    if decision.local_fn is not None:
        out = decision.local_fn(func, tuple(local_args), kwargs)
    else:
        out = func(*local_args, **kwargs)
    if isinstance(decision.out, tuple):  # several outputs (native_layer_norm, max.dim, split)
        result = type(out)(
            None if o is None or s is None else DTensor(o, s, requires_grad=False)
            for o, s in zip(out, decision.out, strict=True)
        )
        outs = result
    else:
        result = DTensor(out, decision.out, requires_grad=False)
        outs = (result,)
    if func.is_view and (moved or any(d._copy_of is not None for d in dts)):
        # torch's result would alias the input; ours was computed from a redistributed copy.
        for o in outs:
            if o is not None:
                o._copy_of = f"{func} on placements {dts[0].placements}"
    return result


def _list_operands(func, items, dts):
    """A tensor-list argument holding DTensors (``cat``, ``stack``): plain tensors in it are
    accepted only when they are all zeros (autograd fills the gradients of unused ``split`` /
    ``unbind`` outputs with ``torch.zeros``), as Replicate DTensors: every rank holds the same."""
    if not any(isinstance(x, DTensor) for x in items):
        return items
    mesh = dts[0]._spec.mesh
    out = []
    for x in items:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            if x.ndim > 0 and x.any():
                raise RuntimeError(
                    f"hpservice.dtensor: {func} mixes DTensors with a torch.Tensor of shape {tuple(x.shape)} in a "
                    "tensor list; wrap it with DTensor.from_local or distribute_tensor first"
                )
            from .placement_types import Replicate

            x = DTensor(x, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(x.shape)), requires_grad=False)
        out.append(x)
    return out


def _replicated(func, args: tuple, kwargs: dict, spec: DTensorSpec):
    """Every rank holds the whole of every operand, so any op is correct on the local tensors."""
    out = func(*_locals(args), **dict(zip(kwargs, _locals(kwargs.values()), strict=True)))
    if _is_mutable(func) and args and isinstance(args[0], DTensor):
        return args[0]
    return _wrap_replicated(out, spec)


def _wrap_replicated(out, spec: DTensorSpec):
    """Fully replicated: the local result is the global one, strides included (``x.t()``)."""
    if isinstance(out, torch.Tensor):
        shape, stride = tuple(out.shape), tuple(out.stride())
        if shape != spec.shape or stride != spec.stride:
            spec = DTensorSpec(spec.mesh, spec.placements, shape, stride)
        return DTensor(out, spec, requires_grad=False)
    if isinstance(out, tuple | list):
        return type(out)(_wrap_replicated(o, spec) for o in out)
    return out


def _locals(values) -> tuple:
    """``values`` with every DTensor (also inside a list argument) replaced by its local tensor."""
    out = []
    for a in values:
        if isinstance(a, DTensor):
            a = a._wait_local()
        elif isinstance(a, list | tuple) and any(isinstance(x, DTensor) for x in a):
            a = type(a)(x._wait_local() if isinstance(x, DTensor) else x for x in a)
        out.append(a)
    return tuple(out)


def _norm(func, args: tuple, kwargs: dict):
    """Whole-tensor vector norms of sharded tensors: local norms combined over the sharded mesh
    dims (sum of |x|^p, max for inf, min for -inf); the result is a replicated 0-d DTensor."""
    import torch.distributed as dist

    from .placement_types import Replicate

    single = func is aten.linalg_vector_norm.default
    tensors = [args[0]] if single else list(args[0])
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if single and (kwargs.get("dim") is not None or (len(args) > 2 and args[2] is not None)):
        raise _unsupported(func, [t for t in tensors if isinstance(t, DTensor)], "only whole-tensor norms (dim=None)")
    if single and kwargs.get("dtype") is not None:
        raise _unsupported(func, tensors, "the dtype argument is not supported")
    ord_ = float(ord_)
    specs = [t._spec for t in tensors]
    if any(s.has_partial() for s in specs):
        raise _unsupported(func, tensors, "the norm of a Partial tensor needs its reduction first")
    mesh = specs[0].mesh
    if any(s.mesh != mesh for s in specs):
        raise _unsupported(func, tensors, "all tensors must share one mesh")
    local = torch.stack([torch.linalg.vector_norm(t._wait_local(), ord_) for t in tensors])
    if ord_ in (float("inf"), float("-inf")):
        op, value = (dist.ReduceOp.MAX if ord_ > 0 else dist.ReduceOp.MIN), local.clone()
    elif ord_ == 0:
        op, value = dist.ReduceOp.SUM, local.clone()
    else:
        op, value = dist.ReduceOp.SUM, local.double().pow(ord_)
    # One all-reduce per (set of sharded mesh dims, mesh dim), whatever the number of tensors.
    by_dims: dict[tuple[int, ...], list[int]] = {}
    for j, s in enumerate(specs):
        by_dims.setdefault(tuple(i for i, p in enumerate(s.placements) if p.is_shard()), []).append(j)
    for dims, members in by_dims.items():
        if not dims:
            continue
        index = torch.tensor(members)
        part = value[index]
        for i in dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(i))
        value[index] = part
    if op is dist.ReduceOp.SUM and ord_ != 0:
        value = value.pow(1.0 / ord_)
    local = value.to(local.dtype)
    replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, ())
    outs = [DTensor(v, replicated, requires_grad=False) for v in local.unbind(0)]
    return outs[0] if single else outs


def _replicate_if_partial(p):
    from .placement_types import Replicate

    return Replicate() if p.is_partial() else p


def _unsupported(func, dts, why: str) -> NotImplementedError:
    placements = ", ".join("(" + ", ".join(map(str, d.placements)) + ")" for d in dts)
    return NotImplementedError(f"hpservice.dtensor: {func} on DTensor placements [{placements}]: {why}")


def _is_scalar(t: DTensor) -> bool:
    """A replicated 0-d DTensor (a global norm, a clip coefficient) acts as a scalar operand."""
    return t.ndim == 0 and t._spec.is_replicated()


@functools.lru_cache(maxsize=2048)
def _is_mutable(func) -> bool:
    return func._schema.is_mutable


def _pointwise(func, args: tuple, kwargs: dict):
    # Fast path (an optimizer's per-parameter ops): flat positional args, no tensors in kwargs.
    if not any(isinstance(a, list | tuple) for a in args) and not any(
        isinstance(v, torch.Tensor) for v in kwargs.values()
    ):
        first = args[0]
        if isinstance(first, DTensor) and not first._spec.has_partial():
            spec = first._spec
            local_args = []
            for a in args:
                if isinstance(a, DTensor):
                    scalar = _is_scalar(a) and a._spec.mesh == spec.mesh
                    if a._spec is not spec and not scalar and not _compatible(a._spec, spec):
                        break
                    local_args.append(a._wait_local())
                elif isinstance(a, torch.Tensor) and a.ndim > 0:
                    break
                else:
                    local_args.append(a)
            else:
                out = func(*local_args, **kwargs)
                if _is_mutable(func):
                    return first
                return _wrap(out, spec)
    return _pointwise_general(func, args, kwargs)


def _pointwise_general(func, args: tuple, kwargs: dict):
    flat, tree = tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, DTensor)]
    spec = next((t._spec for t in tensors if not _is_scalar(t)), tensors[0]._spec)
    dts = []
    for i, a in enumerate(flat):
        if isinstance(a, DTensor):
            s = a._spec
            if s is not spec and not (_is_scalar(a) and a._spec.mesh == spec.mesh):
                if not _compatible(s, spec):
                    # Different layouts (broadcasting, Partial, or e.g. a replicated gradient of a
                    # sharded parameter in an optimizer's in-place op): the rule redistributes the
                    # other operands to the output's (``self``'s for in-place ops) layout.
                    return _pointwise_redistribute(func, args, kwargs)
                dts.append(a)
            elif s is spec:
                dts.append(a)
            flat[i] = a._wait_local()
        elif isinstance(a, torch.Tensor) and a.ndim > 0:
            # RuntimeError, not TypeError: torch turns a TypeError in a binary operator into NotImplemented.
            raise RuntimeError(
                f"hpservice.dtensor: {func} mixes a DTensor with a torch.Tensor of shape {tuple(a.shape)}; "
                "wrap it with DTensor.from_local or distribute_tensor first (0-d tensors are allowed as scalars)"
            )
    if spec.has_partial() and not _partial_ok(func, args, dts):
        # A Partial(max/min) (from max/amax/min over a sharded dim), or a Partial with another
        # DTensor operand (autograd's formulas, e.g. grad / count): reduce first, as for operands
        # of different layouts. A lone Partial(sum/avg) under a non-linear op raises.
        nonlinear = any(p.is_partial() and p.reduce_op not in ("sum", "avg") for p in spec.placements)
        if nonlinear or len(tensors) > 1:
            return _pointwise_redistribute(func, args, kwargs)
        raise _unsupported(func, dts, "not linear in a pending (Partial) reduction; redistribute to Replicate first")
    local_args, local_kwargs = tree_unflatten(flat, tree)
    out = func(*local_args, **local_kwargs)
    if _is_mutable(func) and args and isinstance(args[0], DTensor):
        return args[0]
    return _wrap(out, spec)


def _pointwise_redistribute(func, args: tuple, kwargs: dict):
    """Broadcasting between different layouts (``out[B, S, O] S(2) + bias[O]``), or a Partial
    operand with a non-Partial one: the ``pointwise_decision`` rule picks the layouts."""
    flat, tree = tree_flatten((args, kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, DTensor)]
    tensors = [flat[i] for i in positions]
    mutable = _is_mutable(func) and bool(args) and isinstance(args[0], DTensor)
    try:
        decision = pointwise_decision(func, tuple(t._spec for t in tensors), mutable)
    except RuleError as e:
        raise _unsupported(func, tensors, str(e)) from None
    for a in flat:
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim > 0:
            raise RuntimeError(
                f"hpservice.dtensor: {func} mixes a DTensor with a torch.Tensor of shape {tuple(a.shape)}; "
                "wrap it with DTensor.from_local or distribute_tensor first (0-d tensors are allowed as scalars)"
            )
    for i, t, target in zip(positions, tensors, decision.targets, strict=True):
        if t._spec is not target and t._spec != target:
            t = _redistribute(t, target, False)
        flat[i] = t._wait_local()
    local_args, local_kwargs = tree_unflatten(flat, tree)
    out = func(*local_args, **local_kwargs)
    if mutable:
        return args[0]
    return _wrap(out, decision.out)


def _compatible(a: DTensorSpec, b: DTensorSpec) -> bool:
    """Same layout, or both fully replicated on one mesh (then broadcasting is local)."""
    if a.mesh != b.mesh:
        return False
    if a.placements == b.placements and a.shape == b.shape:
        return True
    return a.is_replicated() and b.is_replicated()


def _partial_ok(func, args, dts) -> bool:
    """Whether ``func`` commutes with the pending reduction of its Partial operands."""
    name = func.overloadpacket.__name__
    ops = {p.reduce_op for d in dts for p in d.placements if p.is_partial()}
    linear = ops <= {"sum", "avg"}
    if name in _PARTIAL_SAFE and (linear or name not in ("neg", "neg_")):
        return True
    if linear and name in _PARTIAL_SCALE and len(dts) == 1:
        # Scaling a Partial by a scalar; dividing by a Partial is not linear.
        return name.startswith("mul") or args[0] is dts[0]
    return linear and name in _PARTIAL_ADD and len(dts) == 2


def _wrap(out, spec: DTensorSpec):
    if isinstance(out, torch.Tensor):
        if not spec.contiguous and out.is_contiguous():  # clone/contiguous() of a transposed view
            spec = DTensorSpec(spec.mesh, spec.placements, spec.shape)
        if tuple(out.shape) == spec.local_shape:
            return DTensor(out, spec, requires_grad=False)
        # Only fully replicated operands may broadcast: the local result is the global one.
        return DTensor(out, DTensorSpec(spec.mesh, spec.placements, tuple(out.shape)), requires_grad=False)
    if isinstance(out, tuple | list):
        return type(out)(_wrap(o, spec) for o in out)
    return out


def _foreach(func, args: tuple, kwargs: dict):
    """Element j of every tensor list must share the layout of ``args[0][j]``."""
    selves = args[0]
    specs = [s._spec if isinstance(s, DTensor) else None for s in selves]
    name = func.overloadpacket.__name__

    def unwrap(value, position):
        if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
            out = []
            for j, t in enumerate(value):
                if isinstance(t, DTensor):
                    s = t._spec
                    ref = specs[j]
                    if ref is None or (
                        s is not ref and (s.placements != ref.placements or s.shape != ref.shape or s.mesh != ref.mesh)
                    ):
                        raise _unsupported(
                            func, [t], f"element {j} of argument {position} has a different layout than self[{j}]"
                        )
                    if s.has_partial() and name not in ("_foreach_zero_", "_foreach_copy_"):
                        raise _unsupported(func, [t], "foreach ops on Partial DTensors are not supported")
                    out.append(t._wait_local())
                elif specs[j] is not None and t.ndim > 0:
                    raise RuntimeError(f"hpservice.dtensor: {func} mixes DTensor and torch.Tensor at element {j}")
                else:
                    out.append(t)
            return out
        if isinstance(value, DTensor):
            if _is_scalar(value):
                return value._wait_local()
            raise _unsupported(func, [value], "a single DTensor operand to a foreach op must be a replicated scalar")
        return value

    local_args = [unwrap(a, i) for i, a in enumerate(args)]
    local_kwargs = {k: unwrap(v, k) for k, v in kwargs.items()}
    out = func(*local_args, **local_kwargs)
    if out is None or _is_mutable(func):
        return None if out is None else selves
    return [DTensor(o, s, requires_grad=False) if s is not None else o for o, s in zip(out, specs, strict=True)]
