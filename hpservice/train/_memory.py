"""What this rank's training state holds between steps: its pieces of the parameters, the
gradients they get (one per trainable parameter, in its layout), and the optimizer's state.

The numbers are this rank's local tensors (a fully_shard or tensor-parallel parameter counts its
shard only), so they are what a layout saves per rank: a LoRA run's gradients and optimizer state
are its adapters' alone. Transient memory (fully_shard's all-gathered parameters, activations) is
not in them: ``peak_rss_gib`` / ``peak_memory_allocated_gib`` measure the whole process.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hpservice.dtensor import DTensor
from hpservice.models.lora import is_nf4

__all__ = ["TrainingStateMemory", "local_bytes", "parameter_counts"]

_GIB = 2**30


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    if is_nf4(local):  # QLoRA's base: its 4-bit codes and quantised scalers, not the dtype it stands for
        return sum(local_bytes(getattr(local, name)) for name in local.__tensor_flatten__()[0])
    return local.numel() * local.element_size()


def parameter_counts(whole: nn.Module, frozen: set[str]) -> dict:
    """``trainable_params`` and ``total_params`` of the whole model on the meta device, before any
    layout (tied parameters once)."""
    seen: set[int] = set()
    total = trainable = 0
    for name, p in whole.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if name not in frozen else 0
    return {"trainable_params": trainable, "total_params": total}


class TrainingStateMemory:
    """The step record's parameter counts (whole model) and this rank's training-state memory."""

    def __init__(self, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer, counts: dict):
        self.model_parts, self.optimizer, self.counts = model_parts, optimizer, counts
        self._measured: dict | None = None  # fixed once the optimizer holds its state

    def record(self) -> dict:
        """Measured after the first optimizer step and kept: the layout and the state do not change."""
        if self._measured is None:
            params = {id(p): p for part in self.model_parts for p in part.parameters()}.values()
            optimizer_state = sum(
                local_bytes(v) for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            )
            measured = {
                "params_gib": sum(local_bytes(p) for p in params) / _GIB,
                "grads_gib": sum(local_bytes(p) for p in params if p.requires_grad) / _GIB,
                "optimizer_state_gib": optimizer_state / _GIB,
            }
            if not self.optimizer.state:  # before the first step: measure again
                return {**self.counts, **measured}
            self._measured = measured
        return {**self.counts, **self._measured}
