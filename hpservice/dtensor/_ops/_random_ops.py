"""Sharding rule of random ops: in-place samplers (``uniform_``, ``normal_``, ``bernoulli_``...),
``native_dropout`` and the ``rand*_like`` factories.

The layout is the input's (a ``*_like`` of a Partial is Replicate); the values come from
``random.py``: each element's value depends on a key taken from torch's generator (the default one,
or the op's ``generator=``) and its global index only, so a sharded tensor holds the pieces of the
one global tensor every placement would give, and replicas agree.
"""

from __future__ import annotations

import functools

import torch

from ._registry import _R, Decision, RuleError, register_family

aten = torch.ops.aten

_IN_PLACE = {"uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_"}
# *_like factory -> how a buffer of it is drawn
_LIKE = {
    aten.rand_like.default: lambda buf, gen, args: buf.uniform_(generator=gen),
    aten.randn_like.default: lambda buf, gen, args: buf.normal_(generator=gen),
    aten.randint_like.default: lambda buf, gen, args: buf.random_(0, args[1], generator=gen),
    aten.randint_like.low_dtype: lambda buf, gen, args: buf.random_(args[1], args[2], generator=gen),
}


def _is_random(func) -> bool:
    return func is aten.native_dropout.default or func in _LIKE or func.overloadpacket.__name__ in _IN_PLACE


@register_family(_is_random, scalar_free=True)
def _random_rule(func, args, kwargs) -> Decision:
    x = args[0]
    if func in _LIKE:
        out = x.with_placements(tuple(_R if p.is_partial() else p for p in x.placements))
        return Decision((x,), out, local_fn=functools.partial(_local_like, spec=out))
    if x.has_partial():
        raise RuleError("random values on a Partial DTensor are not defined")
    if func is aten.native_dropout.default:
        return Decision((x,), (x, x), local_fn=functools.partial(_local_dropout, spec=x))
    return Decision((x,), x, local_fn=functools.partial(_local_fill, spec=x))


def _tracker(spec):
    from .. import random

    return random._tracker(spec.mesh)


def _local_fill(func, args, kwargs, *, spec):
    local, rest = args[0], args[1:]
    kwargs = dict(kwargs)
    generator = kwargs.pop("generator", None)
    _tracker(spec).fill(local, spec, lambda buf, gen: func(buf, *rest, generator=gen, **kwargs), generator)
    return local


def _local_like(func, args, kwargs, *, spec):
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    out = aten.empty_like.default(args[0], **kwargs)
    draw = _LIKE[func]
    _tracker(spec).fill(out, spec, lambda buf, gen: draw(buf, gen, args))
    return out


def _local_dropout(func, args, kwargs, *, spec):
    local, p, train = args[0], args[1], args[2]
    if not train or p == 0:
        return local.clone(), torch.ones_like(local, dtype=torch.bool)
    keep = torch.empty_like(local)
    _tracker(spec).fill(keep, spec, lambda buf, gen: buf.bernoulli_(1 - p, generator=gen))
    mask = keep.bool()
    out = local * mask / (1 - p) if p < 1 else torch.zeros_like(local)
    return out, mask
