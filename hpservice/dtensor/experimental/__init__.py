"""``torch.distributed.tensor.experimental`` under its names: ``local_map``, ``register_sharding``
and ``implicit_replication``, so code written against torch's experimental API switches by import.

torch's ``context_parallel`` context manager is not here: context parallelism is the trainer's
``parallelism.cp`` (``hpservice.parallel.context_parallel``), not a wrapper around SDPA calls."""

from ._func_map import local_map
from ._implicit import implicit_replication
from ._register_sharding import register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]
