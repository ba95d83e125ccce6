"""Policies for fully_shard (same names and fields as torch.distributed.fsdp)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication.

    param_dtype: dtype of the unsharded parameters (all-gathered and used in forward/backward);
        None keeps the original dtype.
    reduce_dtype: dtype in which gradients are reduced; None uses param_dtype (or the original).
    output_dtype: dtype the floating outputs of each fully_shard module are cast to (as torch's FSDP);
        None leaves them.
    cast_forward_inputs: cast floating forward inputs to param_dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{name}: expected a floating torch.dtype or None, got {value!r}")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU (the optimizer steps there); copy to the
    device for the all-gather and back after the reduce-scatter. pin_memory pins the CPU
    buffers when a CUDA device is present, so the copies can be asynchronous."""

    pin_memory: bool = True
