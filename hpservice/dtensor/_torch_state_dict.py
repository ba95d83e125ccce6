"""Our DTensor in torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``).

``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True`` gather
values through ``torch.distributed._state_dict_utils``, which recognises torch's own DTensor
class only: ours would pass through as shards. As our DTensor registers itself for torch.optim's
foreach lists, it registers here: the state-dict walker sends our DTensors to the same gather /
offload function torch's get (they share ``redistribute`` / ``to_local``), and loading a full
state dict (``full_state_dict=True``, or rank 0's with ``broadcast_from_rank0=True``) slices each
rank's piece for parameters and optimizer states that are our DTensors.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._state_dict_utils as _sdu

from ._api import DTensor, distribute_tensor


def _identity(obj, *args, **kwargs):
    return obj


def _install() -> None:
    if getattr(_sdu, "_hpservice_installed", False):
        return
    original_iterate = _sdu._iterate_state_dict
    original_distribute = _sdu._distribute_state_dict
    original_broadcast = _sdu._broadcast_tensors

    @functools.wraps(original_iterate)
    def _iterate_state_dict(iter_object, sharded_tensor_func, dtensor_func, tensor_func, **kwargs):
        if isinstance(iter_object, DTensor):
            value = dtensor_func(iter_object, kwargs.get("pg"), kwargs.get("device"), kwargs.get("companion_obj"))
            # The rest (cpu_offload, ranks_only, companion copies) as for any tensor.
            return original_iterate(value, sharded_tensor_func, dtensor_func, _identity, **kwargs)
        return original_iterate(iter_object, sharded_tensor_func, dtensor_func, tensor_func, **kwargs)

    @functools.wraps(original_distribute)
    def _distribute_state_dict(full_state_dict, local_state_dict, device, pg=None):
        ours = {k: v for k, v in local_state_dict.items() if isinstance(v, DTensor)}
        original_distribute(full_state_dict, local_state_dict, device, pg)
        for key, local in ours.items():
            value = full_state_dict.get(key)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                # Every rank holds the full value: slice locally, no communication.
                local_state_dict[key] = distribute_tensor(
                    value.detach().to(device), local.device_mesh, local.placements, src_data_rank=None
                )

    @functools.wraps(original_broadcast)
    def _broadcast_tensors(full_state_dict, local_state_dict, keys, device, pg=None):
        # broadcast_from_rank0: torch's helper replaces a local value it does not recognise as
        # its DTensor by the whole broadcast tensor; ours get their piece of it instead.
        ours = {k: local_state_dict[k] for k in keys if isinstance(local_state_dict.get(k), DTensor)}
        original_broadcast(full_state_dict, local_state_dict, keys, device, pg)
        for key, local in ours.items():
            value = local_state_dict.get(key)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                local_state_dict[key] = distribute_tensor(
                    value.detach().to(device), local.device_mesh, local.placements, src_data_rank=None
                )

    _sdu._iterate_state_dict = _iterate_state_dict
    _sdu._distribute_state_dict = _distribute_state_dict
    _sdu._broadcast_tensors = _broadcast_tensors
    # torch.distributed.checkpoint.state_dict imported the name directly.
    import torch.distributed.checkpoint.state_dict as _state_dict

    if getattr(_state_dict, "_distribute_state_dict", None) is original_distribute:
        _state_dict._distribute_state_dict = _distribute_state_dict
    _sdu._hpservice_installed = True


_install()
