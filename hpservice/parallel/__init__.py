"""Tensor parallelism on ``hpservice.dtensor`` (same names and semantics as
``torch.distributed.tensor.parallel`` where they overlap)::

    from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

Sequence parallelism: ``SequenceParallel`` (norms on sequence-sharded activations),
``ColwiseParallel(input_layouts=Shard(1))``, ``RowwiseParallel(output_layouts=Shard(1))``,
``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``.
"""

from hpservice.parallel_dims import ParallelDims

from .api import parallelize_module
from .loss import loss_parallel, vocab_parallel_cross_entropy
from .plans import apply_llama_tp, llama_tp_plan
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelDims",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "apply_llama_tp",
    "llama_tp_plan",
    "loss_parallel",
    "parallelize_module",
    "vocab_parallel_cross_entropy",
]
