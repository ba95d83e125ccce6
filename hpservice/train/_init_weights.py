"""Filling a model built on the meta device: the same values for the same seed at every layout."""

from __future__ import annotations

import torch
import torch.nn as nn

from hpservice.dtensor import DeviceMesh, DTensor, Replicate, distribute_tensor
from hpservice.dtensor import random as dtensor_random

from ._errors import TrainingError

__all__ = ["init_weights", "reset_parameters"]


def init_weights(model: nn.Module, mesh: DeviceMesh, seed: int) -> None:
    """Run the model's own ``init_weights()`` with the sharding-independent DTensor RNG, each
    parameter from a stream keyed by its name (``parameter_streams``), so every layout (FSDP,
    HSDP, tp, pipeline stages, one process) starts from the same values for the same seed.
    Parameters that are still plain tensors (replicated ones under tp alone) are wrapped as
    Replicate DTensors on ``mesh`` for the init, so they draw from the same streams, then unwrapped."""
    plain = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                dt = distribute_tensor(param.detach(), mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
                module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
                plain.append((module, name))
    dtensor_random.manual_seed(seed)
    with torch.no_grad(), dtensor_random.parameter_streams(model.named_parameters()):
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()
        else:
            reset_parameters(model)
        for module in model.modules():  # LoRA adapters (models/lora.py): PEFT's init, A Kaiming, B zero
            reset_lora = getattr(module, "reset_lora_parameters", None)
            if callable(reset_lora):
                reset_lora()
    for module, name in plain:
        param = module._parameters[name]
        module.register_parameter(name, nn.Parameter(param.detach().to_local(), requires_grad=param.requires_grad))


def reset_parameters(model: nn.Module) -> None:
    """Initialise a model that has no ``init_weights()`` the way torch's meta-device recipe for
    fully_shard does: each submodule's own ``reset_parameters()`` (every torch layer has one).
    A module holding parameters or buffers of its own without one would keep the uninitialised
    memory ``to_empty`` gave it, so it is refused by name instead."""
    for name, module in model.named_modules():
        own = [*module._parameters.values(), *module._buffers.values()]
        if not any(t is not None for t in own):
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset) and isinstance(module, nn.MultiheadAttention):
            reset = module._reset_parameters  # torch's own layer, which names it privately
        if not callable(reset):
            kinds = ", ".join(n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None)
            raise TrainingError(
                f"model has no init_weights(), and {name or 'the root module'} ({type(module).__name__}) holds "
                f"{kinds} but has no reset_parameters(): the model is built on the meta device, so give the model an "
                "init_weights() (or that module a reset_parameters()) that fills every parameter and buffer"
            )
        reset()
