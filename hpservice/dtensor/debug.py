"""Debugging helpers, named as in ``torch.distributed.tensor.debug``."""

from ._ops import decide


def _clear_sharding_prop_cache() -> None:
    """Forget every cached sharding decision.

    The cache's keys and decisions hold the operands' ``DTensorSpec``s, and so their meshes and
    the meshes' process groups: a process that runs one job after another (a rank pool, a
    notebook) calls this when a job's groups are destroyed, or each gloo group lives on with its
    polling threads (NCCL: its communicators) for as long as its decisions stay cached.
    """
    decide.cache_clear()
