"""DTensor factory functions: ``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``.

Same names, signatures and layouts as ``torch.distributed.tensor``'s. ``size`` is the global
shape; each rank allocates only its local piece (``DTensorSpec.local_shape``: uneven shards as
``torch.chunk`` cuts them). As in torch, every rank fills its own piece with the same init, so a
``Partial`` placement holds that value on each rank (``ones`` with ``Partial()`` on 2 ranks sums
to twos).

``rand`` / ``randn`` draw from ``hpservice.dtensor.random``: the values do not depend on the
placements (a sharded ``randn`` reassembles to the replicated one under the same seed). They are
not the values torch's own generator tracker would draw (docs/dtensor.md, Random numbers).

Unlike torch, there is no ambient mesh (``with mesh:``): ``device_mesh`` is required.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._api import DTensor
from ._layout import DTensorSpec, normalize_placements, replicate_all
from .device_mesh import DeviceMesh, mesh_device
from .placement_types import Placement

__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]


def _size(size) -> tuple[int, ...]:
    """``zeros(2, 3)``, ``zeros((2, 3))`` and ``zeros(torch.Size([2, 3]))`` are one shape."""
    if len(size) == 1 and isinstance(size[0], Sequence | torch.Size):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise ValueError(f"size must be non-negative integers, got {size!r}")
    return tuple(size)


def _make(fill, size, device_mesh, placements, dtype, layout, requires_grad) -> DTensor:
    if device_mesh is None:
        raise ValueError("hpservice.dtensor factories need device_mesh (there is no ambient mesh as torch's `with mesh:`)")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be an hpservice.dtensor.DeviceMesh, got {type(device_mesh).__name__}")
    if layout != torch.strided:
        raise ValueError(f"layout {layout} is not supported: only torch.strided")
    shape = _size(size)
    placements = normalize_placements(placements or replicate_all(device_mesh), device_mesh, len(shape))
    spec = DTensorSpec(device_mesh, placements, shape)
    local = fill(spec.local_shape, dtype=dtype or torch.get_default_dtype(), device=mesh_device(device_mesh))
    return DTensor(local, spec, requires_grad=requires_grad)


def zeros(
    *size,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of zeros of global shape ``size``."""
    return _make(torch.zeros, size, device_mesh, placements, dtype, layout, requires_grad)


def ones(
    *size,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of ones of global shape ``size`` (each rank's piece is ones, ``Partial`` too)."""
    return _make(torch.ones, size, device_mesh, placements, dtype, layout, requires_grad)


def empty(
    *size,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """An uninitialised DTensor of global shape ``size``."""
    return _make(torch.empty, size, device_mesh, placements, dtype, layout, requires_grad)


def full(
    size,
    fill_value,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of global shape ``size`` filled with ``fill_value``."""

    def fill(shape, **kwargs):
        return torch.full(shape, fill_value, **kwargs)

    return _make(fill, (size,), device_mesh, placements, dtype, layout, requires_grad)


def _random(draw: str, size, device_mesh, placements, dtype, layout, requires_grad) -> DTensor:
    out = _make(torch.empty, size, device_mesh, placements, dtype, layout, False)
    with torch.no_grad():
        out.uniform_(0.0, 1.0) if draw == "rand" else out.normal_(0.0, 1.0)  # the DTensor RNG, by global index
    return out.requires_grad_(requires_grad)


def rand(
    *size,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Uniform [0, 1) values of global shape ``size``, the same whatever the placements."""
    return _random("rand", size, device_mesh, placements, dtype, layout, requires_grad)


def randn(
    *size,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Standard normal values of global shape ``size``, the same whatever the placements."""
    return _random("randn", size, device_mesh, placements, dtype, layout, requires_grad)
