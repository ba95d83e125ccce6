"""``register_sharding``: a user's sharding rule for an operator, in torch's form.

torch's form: the function takes the op's arguments (each DTensor as its ``DTensorSpec``: ``shape``,
``ndim``, ``placements``, ``mesh``) and returns the acceptable shardings *for one mesh dimension*,
each a pair ``(output placements, input placements)`` with one input entry per argument (``None``
for a non-tensor). As torch does, every combination over the mesh's dimensions is a candidate
(``itertools.product``, in the order the function listed them); candidates whose inputs cannot be
sharded (a dim smaller than its number of shards) are dropped, and for an in-place op so are those
that would move ``self``. The choice among the rest follows torch's order of preference:

1. the last candidate that needs no redistribution of any input;
2. else the first whose redistribution costs nothing (a replicated input is only sliced);
3. else the cheapest by torch's estimate of the collectives' time (``_cost``), the first of
   equal cost.

torch's estimate also slows the mesh dims that cross hosts and counts each dtype's bytes; ours
assumes one host and 4-byte elements, so in rule 3 two candidates of nearly equal cost may be
ordered differently from torch's. The values are the op's either way. The rule registered replaces
any default rule of the op, as in torch, for ops written in ``torch.library`` too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

from .. import _dispatch
from .._layout import DTensorSpec, _from_torch_placement
from .._ops import _registry
from .._ops._registry import Decision, RuleError, flat_specs, run_on_meta
from ..placement_types import Placement

__all__ = ["register_sharding"]


def register_sharding(op):
    """A decorator registering its function as the sharding rule of ``op`` (an ``OpOverload`` or
    a list of them); returns the function unchanged."""
    overloads = op if isinstance(op, list | tuple) else [op]
    for overload in overloads:
        if not isinstance(overload, torch._ops.OpOverload):
            raise TypeError(f"register_sharding takes OpOverloads (torch.ops.aten.mm.default), not {overload!r}")

    def deco(sharding_fn: Callable):
        for overload in overloads:
            _registry.RULES[overload] = _custom_rule(sharding_fn)
        _registry.rule_for.cache_clear()
        _registry.decide.cache_clear()
        _dispatch._op_info.cache_clear()
        return sharding_fn

    return deco


def _ours(p) -> Placement | None:
    if p is None or isinstance(p, Placement):
        return p
    return _from_torch_placement(p)


def _custom_rule(sharding_fn: Callable) -> Callable:
    def rule(func, args: tuple, kwargs: dict) -> Decision:
        specs = flat_specs(args)
        mesh = specs[0].mesh
        n_out = len(func._schema.returns)
        per_dim = []
        for i, choice in enumerate(sharding_fn(*args, **kwargs)):
            outs, ins = choice
            outs = [_ours(p) for p in outs]
            ins = [_ours(p) for p in ins if p is not None]
            if len(outs) != n_out or len(ins) != len(specs):
                raise RuleError(
                    f"register_sharding's function returned sharding {i} with {len(outs)} output and {len(ins)} "
                    f"input placements; {func} has {n_out} outputs and {len(specs)} tensor operands"
                )
            per_dim.append((outs, ins))
        candidates = []
        for combo in itertools.product(per_dim, repeat=mesh.ndim):
            targets = tuple(spec.with_placements(tuple(c[1][k] for c in combo)) for k, spec in enumerate(specs))
            if not all(_shardable(t) for t in targets):
                continue
            if func._schema.is_mutable and targets[0].placements != specs[0].placements:
                continue
            out_placements = [tuple(c[0][k] for c in combo) for k in range(n_out)]
            candidates.append((targets, out_placements))
        if not candidates:
            raise RuleError("none of the shardings its register_sharding function returned fits these operands")
        targets, out_placements = candidates[_choose(specs, [c[0] for c in candidates])]
        return Decision(targets, _outputs(func, args, kwargs, mesh, out_placements))

    return rule


def _shardable(spec: DTensorSpec) -> bool:
    shards = [1] * spec.ndim
    for size, p in zip(spec.mesh.shape, spec.placements, strict=True):
        if p.is_shard():
            shards[p.dim % spec.ndim] *= size
    return all(n == 1 or spec.shape[d] >= n for d, n in enumerate(shards))


_LATENCY_US, _HOP_US, _GB_PER_S = 6.6, 0.6, 87.7  # a ring collective within one host, as torch models it


def _ring_us(gigabytes: float, devices: int, hops_per_device: int = 1) -> float:
    hops = hops_per_device * (devices - 1)
    return _LATENCY_US + hops * _HOP_US + gigabytes * hops / devices / _GB_PER_S * 1e6


def _cost(current: DTensorSpec, target: DTensorSpec) -> float:
    """Estimated microseconds of the collectives from ``current`` to ``target``, mesh dim by mesh
    dim: torch's ring model (all-gather and reduce-scatter one pass, all-reduce two, a shard moved
    to another dim an all-gather's cost plus a penalty, nothing from a replica). Elements are
    counted at 4 bytes (a spec carries no dtype)."""
    if current.is_replicated() or current.placements == target.placements:
        return 0.0
    shards = math.prod(size for size, p in zip(current.mesh.shape, current.placements, strict=True) if p.is_shard())
    gigabytes = math.prod(current.shape) * 4 / shards / 2**30
    cost = 0.0
    for devices, a, b in zip(current.mesh.shape, current.placements, target.placements, strict=True):
        if a == b:
            continue
        if a.is_shard() and b.is_replicate():
            gigabytes *= devices
            cost += _ring_us(gigabytes, devices)
        elif a.is_shard() and b.is_shard():
            cost += _ring_us(gigabytes, devices) + 1.0
        elif a.is_partial() and b.is_replicate():
            cost += _ring_us(gigabytes, devices, hops_per_device=2)
        elif a.is_partial() and b.is_shard():
            cost += _ring_us(gigabytes, devices)
            gigabytes /= devices
        elif b.is_partial():  # a shard or another reduction made a pending sum: never
            return math.inf
        else:  # replicate -> shard: a local slice
            gigabytes /= devices
    return cost


def _choose(specs: Sequence[DTensorSpec], candidates: list[tuple[DTensorSpec, ...]]) -> int:
    costs = [sum(_cost(s, t) for s, t in zip(specs, targets, strict=True)) for targets in candidates]
    unmoved = [
        i
        for i, targets in enumerate(candidates)
        if all(s.placements == t.placements for s, t in zip(specs, targets, strict=True))
    ]
    if unmoved:
        return unmoved[-1]
    free = [i for i, c in enumerate(costs) if c == 0]
    if free:
        return free[0]
    return costs.index(min(costs))


def _outputs(func, args: tuple, kwargs: dict, mesh, out_placements: list) -> DTensorSpec | tuple:
    """The output specs: global shapes and strides from the op run on meta tensors."""

    try:
        out = run_on_meta(func, args, kwargs)
    except Exception as e:
        raise RuleError(f"cannot infer the output shape of {func} on meta tensors ({e})") from None
    outs = out if isinstance(out, tuple | list) else (out,)
    specs = tuple(
        None
        if p is None or not isinstance(t, torch.Tensor)
        else DTensorSpec(mesh, p, tuple(t.shape), tuple(t.stride()))
        for t, p in zip(outs, out_placements, strict=True)
    )
    return specs if len(func._schema.returns) > 1 else specs[0]
