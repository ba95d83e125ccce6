"""``parallelize_module``: apply parallel styles to the submodules named by a plan."""

from __future__ import annotations

import fnmatch

from torch import nn

from ..dtensor import DeviceMesh
from .style import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle],
) -> nn.Module:
    """Apply ``parallelize_plan`` in place and return ``module``.

    The plan is a style (applied to ``module`` itself) or a dict from submodule FQN to style;
    an FQN may hold ``fnmatch`` wildcards (``"layers.*.up"``), which must match at least one module.
    """
    if device_mesh.ndim != 1:
        raise ValueError(f"parallelize_module: expected a 1-d tensor-parallel mesh, got {device_mesh}")
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan._apply(module, device_mesh)
    if not isinstance(parallelize_plan, dict):
        raise TypeError(f"parallelize_module: plan must be a ParallelStyle or a dict, got {type(parallelize_plan)}")
    names = [name for name, _ in module.named_modules() if name]
    for fqn, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_module: plan[{fqn!r}] is not a ParallelStyle: {style!r}")
        if any(c in fqn for c in "*?["):
            matched = [n for n in names if fnmatch.fnmatchcase(n, fqn)]
            if not matched:
                raise ValueError(f"parallelize_module: no submodule matches {fqn!r}")
        else:
            module.get_submodule(fqn)  # raises AttributeError naming the missing module
            matched = [fqn]
        for name in matched:
            style._apply(module.get_submodule(name), device_mesh)
    return module
