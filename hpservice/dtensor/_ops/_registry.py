"""The sharding-rule registry and propagation: ``rule(func, args, kwargs) -> Decision`` per aten op.

Every operator a DTensor runs goes through one path (``_dispatch.dispatch``): the rule of its op
(from ``RULES``, or from the family that claims it: pointwise, foreach, random) decides, per mesh
dim, the spec each DTensor operand must have and the output spec(s); the dispatcher redistributes
the operands that differ (into new DTensors, never in place), runs the op on the local tensors and
wraps the result. An op without a rule runs only when every operand is fully replicated (then the
local result is the global one); otherwise it raises naming the op and the placements.

``args``/``kwargs`` reach a rule frozen (hashable): every DTensor is replaced by its
``DTensorSpec``, lists by tuples, plain tensors by ``PlainTensor(shape, dtype)``. For families
registered ``scalar_free`` (pointwise, foreach) Python numbers are replaced by ``None`` too, so an
optimizer's changing step size does not make every call a cache miss. Rules reason about
placements and global shapes only; local shapes always come from the specs (uneven
``torch.chunk`` shards stay exact). Decisions are cached (``decide``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._layout import DTensorSpec
from ..placement_types import Placement, Replicate

aten = torch.ops.aten

_R = Replicate()
_LINEAR_PARTIAL = ("sum", "avg")


class RuleError(Exception):
    """The rule cannot handle these operands; the dispatcher turns it into NotImplementedError."""


class LocalShaped(NamedTuple):
    """Output marker of an op on fully replicated operands: the local result is the global
    tensor, so its spec (shape and strides) is read off the local result."""

    mesh: object


@dataclasses.dataclass(frozen=True)
class PlainTensor:
    """A frozen plain-tensor argument (a 0-d scalar, an optimizer's step); not a tuple, so rules
    never take it for a tensor list."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Decision(NamedTuple):
    targets: tuple[DTensorSpec, ...]  # one per DTensor operand, in flattened positional order
    out: DTensorSpec | LocalShaped | tuple | None  # a tuple for ops with several outputs
    local_shape_arg: int | None = None  # positional arg replaced by ``out.local_shape`` (view/expand)
    local_fn: Callable | None = None  # replaces ``func`` on the local tensors


RULES: dict = {}
_FAMILIES: list[tuple[Callable, Callable, bool]] = []  # (claims(func), rule, scalar_free)
_SCALAR_FREE: set = set()


def register(*ops, scalar_free: bool = False):
    """Register ``rule`` for these op overloads."""

    def deco(fn):
        for op in ops:
            RULES[op] = fn
            if scalar_free:
                _SCALAR_FREE.add(op)
        return fn

    return deco


def register_family(claims: Callable, *, scalar_free: bool = False):
    """Register ``rule`` for every op ``claims(func)`` accepts (pointwise ops are tagged by torch,
    hundreds of them: claiming beats listing). Explicit ``register`` entries take precedence.
    A rule with ``per_element = True`` (foreach) checks meshes per list element itself."""

    def deco(fn):
        _FAMILIES.append((claims, fn, scalar_free))
        return fn

    return deco


@functools.lru_cache(maxsize=4096)
def rule_for(func) -> tuple[Callable | None, bool]:
    """(rule, scalar_free) of ``func``; (None, False) when no rule is registered."""
    if func in RULES:
        return RULES[func], func in _SCALAR_FREE
    name = func.overloadpacket.__name__
    if name.endswith("_copy") and name != "_copy":
        # view_copy, transpose_copy...: the layout of the view they copy, in new memory.
        view = getattr(getattr(torch.ops.aten, name[: -len("_copy")], None), func._overloadname, None)
        if view is not None and view in RULES:
            rule = RULES[view]
            return functools.partial(_copy_of_view_rule, rule, view), view in _SCALAR_FREE
    for claims, rule, scalar_free in _FAMILIES:
        if claims(func):
            return rule, scalar_free
    return None, False


def _copy_of_view_rule(rule, view, func, args, kwargs) -> Decision:
    """A ``*_copy`` op decided as its view (the view rules read which overload they serve)."""
    return rule(view, args, kwargs)


@functools.lru_cache(maxsize=4096)
def decide(func, args: tuple, kwargs: tuple, mesh_ids: tuple = ()) -> Decision:
    """Cached rule decision; ``args``/``kwargs`` frozen (specs instead of DTensors). Meshes of
    equal layout compare equal (AUDIT 3) but may belong to different roots: ``mesh_ids`` (the
    operands' mesh objects, kept alive by the cached specs) keeps a cached decision from handing
    one call's mesh to another's output."""
    if any(isinstance(v, DTensorSpec) for _, v in kwargs):
        raise RuleError("DTensor keyword arguments are not supported")
    specs = flat_specs(args)
    if not specs:
        raise RuleError("no DTensor among the positional arguments")
    rule, _ = rule_for(func)
    if not getattr(rule, "per_element", False):
        mesh = one_mesh(specs)
        if any(s.mesh != mesh for s in specs):
            args = _rebound(args, mesh)
            specs = flat_specs(args)
    mesh = specs[0].mesh
    if rule is None:
        if all(s.is_replicated() for s in specs):
            return Decision(tuple(specs), LocalShaped(mesh))
        return _replicated_fallback(func, specs, mesh)
    try:
        decision = rule(func, args, dict(kwargs))
    except (AttributeError, TypeError):
        # A rule reads its tensor operands as specs; a plain 0-d tensor among them (a scalar the
        # caller passed as a tensor) is fine when every DTensor is replicated: local = global.
        if not any(isinstance(x, PlainTensor) for a in args for x in (a if isinstance(a, tuple) else (a,))):
            raise
        if all(s.is_replicated() for s in specs):
            return Decision(tuple(specs), LocalShaped(mesh))
        raise RuleError("a plain torch.Tensor operand where this rule needs DTensors; distribute it first") from None
    if func.is_view or _any_strided(decision.out):
        # a view's strides, and a non-contiguous output's (clone of a transposed view keeps its
        # layout, contiguous() does not): torch's, from the op on meta tensors. Decided here, from
        # global specs, so every rank agrees (a rank's local result cannot say: an empty shard
        # counts as contiguous whatever its strides)
        decision = _with_view_strides(func, args, kwargs, decision)
    return decision


def _replicated_fallback(func, specs: list[DTensorSpec], mesh) -> Decision:
    """An op without a rule of its own runs on whole tensors, as torch's replicate strategy runs
    the ops it registers that way (the linear-algebra family, ``cumprod``, ``diag``...): every
    operand is gathered (a Partial reduced) to Replicate and each rank computes the one result,
    Replicate. Exact for any deterministic op, at the cost of the gathers. Refused where it would
    not be: an op that writes an operand (a sharded ``self`` cannot hold a gathered result) or
    draws random numbers (each rank's draw would be its own, not the DTensor RNG's)."""
    if func._schema.is_mutable:
        raise RuleError("this operator has no sharding rule yet (in place: it cannot run on gathered copies)")
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise RuleError("this operator has no sharding rule yet (a random op)")
    return Decision(tuple(_replicated(s) for s in specs), LocalShaped(mesh))


def _any_strided(out) -> bool:
    """Whether an output spec of a decision is not contiguous."""
    outs = out if isinstance(out, tuple) and not isinstance(out, LocalShaped) else (out,)
    return any(isinstance(o, DTensorSpec) and not o.contiguous for o in outs)


def run_on_meta(func, args: tuple, kwargs: dict):
    """``func`` on meta tensors of the frozen arguments' global shapes and strides (a spec's
    tensor; a tuple of them, a list): what the op's output looks like globally, allocating nothing."""

    def meta(a):
        if isinstance(a, DTensorSpec):
            return torch.empty_strided(a.shape, a.stride, device="meta")
        if isinstance(a, tuple):
            return [meta(x) for x in a]
        return a

    return func(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})


def _with_view_strides(func, args: tuple, kwargs: tuple, decision: Decision) -> Decision:
    """A view's global strides are torch's for the same view of the global tensor (``x.t()`` has
    stride (1, n), so ``x.t().reshape(-1)`` copies as in torch): run the op on meta tensors."""

    try:
        out = run_on_meta(func, args, dict(kwargs))
    except Exception:  # meta cannot run it: keep the rule's contiguous strides
        return decision

    def restride(spec, t):
        if not isinstance(spec, DTensorSpec) or not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.shape:
            return spec
        stride = tuple(t.stride())
        return spec if stride == spec.stride else DTensorSpec(spec.mesh, spec.placements, spec.shape, stride)

    if isinstance(decision.out, tuple):
        outs = tuple(restride(s, t) for s, t in zip(decision.out, out, strict=True))
    else:
        outs = restride(decision.out, out)
    return decision._replace(out=outs)


def same_ranks(a, b) -> bool:
    """Meshes over the same set of ranks and device type (``(dp, tp)`` and ``(tp, dp)`` of one
    world): a fully replicated value on one is the same value, held by the same ranks, on the other."""
    return a == b or (a.device_type == b.device_type and sorted(a._ranks) == sorted(b._ranks))


def one_mesh(specs) -> object:
    """The mesh that operands on several meshes meet on: the first sharded or Partial operand's.
    Operands on another mesh are allowed when fully replicated over the same ranks (the norms of
    gradients that live on ``(dp, tp)`` and ``(tp, dp)``, stacked by ``clip_grad_norm_``); any
    other mix is refused, as torch refuses a cross-mesh op."""
    ref = next((s for s in specs if not s.is_replicated()), specs[0]).mesh
    for s in specs:
        if s.mesh != ref and not (s.is_replicated() and same_ranks(s.mesh, ref)):
            raise RuleError("all DTensor operands must share one mesh")
    return ref


def rebind(spec: DTensorSpec, mesh) -> DTensorSpec:
    """A fully replicated ``spec`` re-expressed on ``mesh`` (over the same ranks, ``same_ranks``)."""
    if spec.mesh == mesh:
        return spec
    return DTensorSpec(mesh, (_R,) * mesh.ndim, spec.shape, spec.stride)


def _rebound(args: tuple, mesh) -> tuple:
    def one(a):
        if isinstance(a, DTensorSpec):
            return rebind(a, mesh)
        if isinstance(a, tuple):
            return tuple(one(x) for x in a)
        return a

    return tuple(one(a) for a in args)


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


@functools.lru_cache(maxsize=2048)
def written_args(func) -> frozenset[int]:
    """Positions of the arguments ``func`` writes (``Tensor(a!)``): they may not be redistributed."""
    return frozenset(
        i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def _spec(like: DTensorSpec, placements, shape) -> DTensorSpec:
    placements = tuple(placements)
    if placements == like.placements and tuple(shape) == like.shape:
        return like
    return DTensorSpec(like.mesh, placements, tuple(shape))


def _replicated(spec: DTensorSpec) -> DTensorSpec:
    return _spec(spec, [_R] * len(spec.placements), spec.shape)


def _is_linear_partial(p: Placement) -> bool:
    return p.is_partial() and p.reduce_op in _LINEAR_PARTIAL


def _dim_arg(args, kwargs, pos: int, default):
    return args[pos] if len(args) > pos else kwargs.get("dim", default)


def _gather_dims(x: DTensorSpec, dims, partial_ok: bool = False) -> list[Placement]:
    """Placements of ``x`` with every Shard of one of ``dims`` gathered (Replicate); Partials
    are reduced unless ``partial_ok`` (ops linear in their input)."""
    out = []
    for p in x.placements:
        if (p.is_shard() and p.dim in dims) or (p.is_partial() and not (partial_ok and _is_linear_partial(p))):
            out.append(_R)
        else:
            out.append(p)
    return out


def _reduce_dims(x: DTensorSpec, dims) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, tuple) and len(dims) == 0):
        return tuple(range(x.ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({d % max(x.ndim, 1) for d in dims}))
