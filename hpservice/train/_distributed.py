"""Joining torch.distributed and picking this rank's device."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hpservice.spec import JobSpec

from ._errors import TrainingError

__all__ = ["init_distributed", "pick_device"]


def init_distributed(device_type: str) -> bool:
    """Join torch.distributed from env:// (torchrun, Ray workers), or make a world of one on an
    in-process store: it has no one to meet, and it leaves no ``MASTER_PORT``/``RANK`` in this
    process's environment, where a later run in the same process (a notebook, a test) would take
    them for a rendezvous on a port that may no longer be free. Returns True if this call created
    the process group (the caller destroys it)."""
    if dist.is_initialized():
        return False
    backend = dist.Backend.default_device_backend_map.get(device_type, "gloo")
    timeout = timedelta(minutes=10)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return True


def pick_device(spec: JobSpec) -> torch.device:
    """This rank's device. ``use_gpu: auto`` is decided by the one rule,
    ``ResourcesSpec.gpus_per_worker``: a GPU each when there is one for every rank on this node
    (torchrun's ``LOCAL_WORLD_SIZE``). Under Ray the coordinator already decided (never ``auto``)."""
    local = spec.resources.model_copy(update={"workers": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))})
    if local.gpus_per_worker(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if not torch.cuda.is_available():
            raise TrainingError("resources.use_gpu is true but no CUDA device is available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
