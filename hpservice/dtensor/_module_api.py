"""``distribute_module``: a module's parameters and buffers as DTensors, and hooks on its inputs and
outputs, with torch's name, arguments and order of effects.

1. ``partition_fn(name, submodule, mesh)`` runs on every submodule (``named_modules`` order); it
   may turn that submodule's own parameters into DTensors (``distribute_tensor``). Without it,
   nothing is partitioned.
2. Every parameter and buffer still a plain tensor afterwards is replicated on the mesh, so the
   module holds DTensors only (a parameter stays an ``nn.Parameter`` with its ``requires_grad``).
3. ``input_fn(module, inputs, mesh)`` becomes a forward pre-hook, ``output_fn(module, outputs,
   mesh)`` a forward hook (the two-argument forms ``(inputs, mesh)`` / ``(outputs, mesh)`` still
   work, with torch's FutureWarning).

A module is distributed once: a second call raises, as torch's does. There is no ambient mesh
(torch's ``with mesh:``): ``device_mesh`` is required.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from ._api import DTensor, distribute_tensor
from .device_mesh import DeviceMesh
from .placement_types import Replicate

__all__ = ["distribute_module"]


def _replicate_own_tensors(module: nn.Module, mesh: DeviceMesh) -> None:
    """The module's own (not its children's) plain parameters and buffers as Replicate DTensors."""
    replicate = [Replicate()] * mesh.ndim
    for key, param in module._parameters.items():
        if param is not None and not isinstance(param, DTensor):
            dt = distribute_tensor(param.data, mesh, replicate)
            module.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))
    for key, buffer in module._buffers.items():
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[key] = distribute_tensor(buffer, mesh, replicate)


def _hook_arity(fn: Callable, what: str) -> int:
    count = len(inspect.signature(fn).parameters)
    if count == 2:
        warnings.warn(
            f"Deprecating {what} that takes two arguments ({'inputs' if what == 'input_fn' else 'outputs'}, device_mesh), "
            f"please use {what} that takes in (module, {'inputs' if what == 'input_fn' else 'outputs'}, device_mesh) instead!",
            FutureWarning,
            stacklevel=3,
        )
    elif count != 3:
        raise ValueError(f"{what} should take in 3 arguments, but got {count} arguments!")
    return count


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable[..., Any] | None = None,
    output_fn: Callable[..., Any] | None = None,
) -> nn.Module:
    """Partition ``module``'s parameters with ``partition_fn`` (the rest replicated), install
    ``input_fn`` / ``output_fn`` as forward pre-hook / forward hook; returns ``module``."""
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError(
            "distribute_module should only be called once on a module, but it has already been called on this module!"
        )
    if device_mesh is None:
        raise ValueError("hpservice distribute_module needs device_mesh (there is no ambient mesh as torch's `with mesh:`)")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be an hpservice.dtensor.DeviceMesh, got {type(device_mesh).__name__}")
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        _replicate_own_tensors(submodule, device_mesh)
    if input_fn is not None:
        if _hook_arity(input_fn, "input_fn") == 2:
            module.register_forward_pre_hook(lambda _, inputs: input_fn(inputs, device_mesh))
        else:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        if _hook_arity(output_fn, "output_fn") == 2:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(outputs, device_mesh))
        else:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    module._distribute_module_applied = True
    return module
