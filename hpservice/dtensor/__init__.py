"""hpservice.dtensor: distributed tensors on a DeviceMesh, built on torch.distributed collectives.

Same names and semantics as ``torch.distributed.tensor`` where they overlap, so switching is a
change of import::

    from hpservice.dtensor import DTensor, DeviceMesh, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
"""

from . import (
    _torch_state_dict,  # noqa: F401  (registers our DTensor with torch's state-dict helpers)
    random,
)
from ._api import DTensor, distribute_tensor
from ._factories import empty, full, ones, rand, randn, zeros
from ._layout import DTensorSpec
from ._module_api import distribute_module
from ._redistribute import plan_redistribution
from .device_mesh import DeviceMesh, init_device_mesh
from .placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "init_device_mesh",
    "ones",
    "plan_redistribution",
    "rand",
    "randn",
    "random",
    "zeros",
]
