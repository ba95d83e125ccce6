"""``local_map``: call a function written for plain tensors on DTensors' local pieces.

The function sees each DTensor argument's local tensor (after checking, or redistributing to,
``in_placements``) and its outputs are wrapped back into DTensors with ``out_placements`` on the
inputs' mesh. Nothing is communicated for the outputs: the caller states their placements, as with
``DTensor.from_local(..., run_check=False)``. Arguments and outputs are flattened as torch flattens
them (``torch.utils._pytree``), so placements are given per flattened leaf, in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .._api import DTensor
from .._layout import _from_torch_placement
from ..placement_types import Placement

__all__ = ["local_map"]


def _placements(p: Sequence | None) -> tuple[Placement, ...] | None:
    """torch's or our placements as ours (a ``local_map`` written for torch passes torch's)."""
    if p is None:
        return None
    return tuple(x if isinstance(x, Placement) else _from_torch_placement(x) for x in p)


def local_map(
    func: Callable | None = None,
    out_placements=None,
    in_placements=None,
    in_grad_placements=None,
    device_mesh=None,
    *,
    redistribute_inputs: bool = False,
):
    """``func`` wrapped to take DTensors and return DTensors (torch's ``local_map``).

    - ``in_placements``: one entry per flattened argument, the placements each DTensor argument
      must have (``None`` for a non-tensor; a plain tensor is passed as it is whatever its entry).
      A DTensor with other placements is redistributed with ``redistribute_inputs=True``, else a
      ``ValueError``. ``None`` (the default) checks nothing.
    - ``in_grad_placements``: the placements of each DTensor argument's gradient as ``func`` returns
      it (``to_local(grad_placements=...)``); default, the argument's own.
    - ``out_placements``: the placements of each flattened output (one sequence for a single
      output, a tuple of them for several; ``None`` for a non-tensor output).
    - ``device_mesh``: the outputs' mesh; default, the first DTensor argument's.

    Called with no DTensor argument, ``func`` runs as it is and its outputs are returned as they
    are, as in torch. Used as a decorator when ``func`` is omitted."""
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    return functools.partial(
        _call_locally, func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs
    )


def _call_locally(func, out_placements, in_placements, in_grad_placements, mesh, redistribute_inputs, *args, **kwargs):
    leaves, tree = pytree.tree_flatten(args)
    if in_placements is not None and len(in_placements) != len(leaves):
        raise AssertionError(f"in_placements has {len(in_placements)} entries for {len(leaves)} flattened arguments")
    local_leaves, saw_dtensor = [], False
    for i, arg in enumerate(leaves):
        wanted = None if in_placements is None else _placements(in_placements[i])
        if not isinstance(arg, DTensor):
            if wanted is not None and not isinstance(arg, torch.Tensor):
                raise AssertionError(f"argument {i} ({arg!r}) is not a tensor but in_placements gives it {wanted}")
            local_leaves.append(arg)
            continue
        saw_dtensor = True
        mesh = arg.device_mesh if mesh is None else mesh
        if in_placements is not None:
            if wanted is None:
                raise AssertionError(f"argument {i} is a DTensor but its in_placements entry is None")
            if tuple(arg.placements) != wanted:
                if not redistribute_inputs:
                    raise ValueError(
                        f"argument {i} of local_map has placements {tuple(arg.placements)}, not the in_placements "
                        f"{wanted}; pass redistribute_inputs=True to redistribute it"
                    )
                arg = arg.redistribute(placements=wanted)
        if in_grad_placements is not None:
            grad = _placements(in_grad_placements[i])
            if grad is None:
                raise AssertionError(f"argument {i} is a DTensor but its in_grad_placements entry is None")
            local_leaves.append(arg.to_local(grad_placements=grad))
        else:
            local_leaves.append(arg.to_local())
    out = func(*pytree.tree_unflatten(local_leaves, tree), **kwargs)
    if not saw_dtensor:
        return out
    outs, out_tree = pytree.tree_flatten(out)
    specs = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(specs) != len(outs):
        raise AssertionError(f"local_map's function returned {len(outs)} values but out_placements gives {len(specs)}")
    wrapped = []
    for value, spec in zip(outs, specs, strict=True):
        if isinstance(value, DTensor):
            raise AssertionError(f"local_map's function must return plain tensors, got a DTensor: {value}")
        if isinstance(value, torch.Tensor):
            wrapped.append(DTensor.from_local(value, mesh, _placements(spec), run_check=False))
        else:
            if spec is not None:
                raise AssertionError(f"a non-tensor output ({value!r}) must have out_placements None, not {spec}")
            wrapped.append(value)
    return pytree.tree_unflatten(wrapped, out_tree)
