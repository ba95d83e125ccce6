"""hpservice.fsdp: fully sharded data parallel (FSDP) and hybrid sharding (HSDP) on hpservice.dtensor.

Same surface as ``torch.distributed.fsdp`` (FSDP2)::

    from hpservice.fsdp import fully_shard, MixedPrecisionPolicy
"""

from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
