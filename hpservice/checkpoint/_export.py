"""Full (unsharded) model weights in and out of sharded training.

- ``export_safetensors(checkpoint, out)``: a sharded checkpoint -> one ``.safetensors`` file of the
  full model state dict, in one process, whatever world size wrote it.
- ``load_full_state_dict(model, source)``: full weights (a ``.safetensors`` file or a dict) -> a
  sharded model; with a file, each rank reads only the slices its shards need.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn

from hpservice.dtensor import DTensor

from ._errors import CheckpointError
from ._reader import CheckpointReader

__all__ = ["export_safetensors", "load_full_state_dict"]


def export_safetensors(checkpoint: str | os.PathLike, out: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Write the full model state dict of a committed checkpoint to ``out``; returns name -> shape."""
    from safetensors.torch import save_file

    tensors = CheckpointReader(Path(checkpoint)).load_model_tensors()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out))
    return {k: tuple(v.shape) for k, v in tensors.items()}


def load_full_state_dict(
    model: nn.Module, source: str | os.PathLike | dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load full tensors into ``model``, sharded or not. From a file, each rank reads only its slices."""
    targets = model.state_dict()
    if isinstance(source, dict):
        names, read = set(source), lambda name, index: source[name][index]
        shapes = {k: tuple(v.shape) for k, v in source.items()}
        handle = None
    else:
        from safetensors import safe_open

        handle = safe_open(str(source), framework="pt")
        names = set(handle.keys())
        shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in names}

        def read(name, index):
            return handle.get_slice(name)[index]

    missing = sorted(set(targets) - names)
    unexpected = sorted(names - set(targets))
    mismatched = [
        f"{k}: source {shapes[k]} vs model {tuple(v.shape)}"
        for k, v in targets.items()
        if k in names and shapes[k] != tuple(v.shape)
    ]
    if mismatched or (strict and (missing or unexpected)):
        raise CheckpointError(
            f"full state dict does not match the model; missing {missing}, unexpected {unexpected}, shape mismatches {mismatched}"
        )
    with torch.no_grad():
        for name, target in targets.items():
            if name not in names:
                continue
            if isinstance(target, DTensor):
                local = target._wait_local()
                index = tuple(
                    slice(o, o + n) for o, n in zip(target._spec.local_offset, target._spec.local_shape, strict=True)
                )
                if local.numel():
                    local.copy_(read(name, index))
            else:
                target.copy_(read(name, tuple(slice(None) for _ in target.shape)))
