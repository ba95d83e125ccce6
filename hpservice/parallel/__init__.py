"""Tensor parallelism on ``hpservice.dtensor`` (same names and semantics as
``torch.distributed.tensor.parallel`` where they overlap)::

    from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
"""

from .api import parallelize_module
from .loss import vocab_parallel_cross_entropy
from .plans import apply_llama_tp, llama_tp_plan
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "RowwiseParallel",
    "apply_llama_tp",
    "llama_tp_plan",
    "parallelize_module",
    "vocab_parallel_cross_entropy",
]
