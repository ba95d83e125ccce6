"""Tensor-parallel plan for the built-in Llama (``hpservice.models.llama``), as torchtitan applies it.

Attention ``wq``/``wk``/``wv`` and the MLP's ``w1``/``w3`` are colwise (each rank holds a slice of
the heads / hidden units), ``wo`` and ``w2`` rowwise (the Partial products reduced once, the
output replicated), the output head colwise with ``use_local_output=False``: the logits stay a
DTensor sharded on the vocabulary, for ``vocab_parallel_cross_entropy``. The token embedding and
the norms stay replicated (plain tensors).

Between the colwise and rowwise projections, attention runs on the local heads: the colwise
outputs are local tensors ``[B, S, (n_heads / tp) * head_dim]``, so ``llama_tp_plan`` divides each
``Attention``'s ``n_heads`` and ``n_kv_heads`` by ``tp`` (rotary embeddings, the GQA repeat and
SDPA are per head, so they run unchanged on a rank's heads). Every rank must start from the same
weights: the plan slices parameters locally.
"""

from __future__ import annotations

from torch import nn

from ..dtensor import DeviceMesh
from .api import parallelize_module
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["apply_llama_tp", "llama_tp_plan"]


def _check_heads(model: nn.Module, tp: int) -> None:
    cfg = model.cfg
    for name, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads)):
        if value % tp != 0:
            raise ValueError(
                f"tensor parallelism: LlamaConfig.{name} ({value}) must be divisible by tp ({tp}) "
                f"(n_heads {cfg.n_heads}, n_kv_heads {cfg.n_kv_heads})"
            )
    if cfg.tie_embeddings:
        raise NotImplementedError("tensor parallelism: a Llama with tie_embeddings=True is not supported")


def llama_tp_plan(model: nn.Module, tp: int | None = None) -> dict[str, ParallelStyle]:
    """The plan dict (submodule FQN -> style) for a ``Llama``. With ``tp`` given, checks that the
    query and key/value head counts divide by it (a ``ValueError`` naming the sizes otherwise)."""
    if tp is not None:
        _check_heads(model, tp)
    plan: dict[str, ParallelStyle] = {"output": ColwiseParallel(use_local_output=False)}
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update(
            {
                p + "attention.wq": ColwiseParallel(),
                p + "attention.wk": ColwiseParallel(),
                p + "attention.wv": ColwiseParallel(),
                p + "attention.wo": RowwiseParallel(),
                p + "feed_forward.w1": ColwiseParallel(),
                p + "feed_forward.w3": ColwiseParallel(),
                p + "feed_forward.w2": RowwiseParallel(),
            }
        )
    return plan


def apply_llama_tp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Parallelize a ``Llama`` in place on the 1-d tensor-parallel ``mesh`` and return it:
    ``llama_tp_plan`` plus the per-rank head counts of every ``Attention``."""
    tp = mesh.size()
    _check_heads(model, tp)
    parallelize_module(model, mesh, llama_tp_plan(model, tp))
    for layer in model.layers:
        layer.attention.n_heads //= tp
        layer.attention.n_kv_heads //= tp
    return model
