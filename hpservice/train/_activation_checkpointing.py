"""Activation checkpointing of a model's transformer blocks (``training.activation_checkpointing``).

Applied after tensor parallelism and before fully_shard, in torchtitan's order: each chosen
block's ``forward`` is wrapped in place with non-reentrant ``torch.utils.checkpoint``, so
parameter names, checkpoints and fully_shard's module hooks stay as they are (the hooks run
outside the recomputed region). Modes:

- ``full``: every block keeps only its input; backward recomputes the whole block.
- ``selective`` with ``selective_every: k``: every k-th block, as ``full``.
- ``selective`` without it: op level (torchtitan's ``op`` mode): every block keeps the outputs of
  matmuls and attention and recomputes the cheap pointwise and normalisation ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from hpservice.spec import JobSpec


def transformer_blocks(model: nn.Module, what: str) -> list[nn.Module]:
    """The model's repeated blocks (``model.layers``), which checkpointing and compile act on."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        raise ValueError(f"{what} needs a model whose blocks are in .layers (an nn.ModuleDict or nn.ModuleList); {type(model).__name__} has none")
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def _save_matmuls(ctx, op, *args, **kwargs):
    """Op-level selective checkpointing (torchtitan's "op" mode): keep matmul and attention
    outputs, recompute the cheap pointwise and normalisation ops in backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}  # fmt: skip


def apply_activation_checkpointing(model: nn.Module, spec: JobSpec) -> None:
    """Recompute blocks' activations in backward (``training.activation_checkpointing``). The
    block's ``forward`` is wrapped in place (non-reentrant ``torch.utils.checkpoint``), so
    parameter names, checkpoints and fully_shard's module hooks stay as they are: the hooks run
    outside the recomputed region, as with torchtitan's wrapper under fully_shard."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    t = spec.training
    if t.activation_checkpointing == "none":
        return
    context_fn = None
    if t.activation_checkpointing == "selective" and t.selective_every is None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    for i, block in enumerate(transformer_blocks(model, "training.activation_checkpointing")):
        if t.activation_checkpointing == "selective" and t.selective_every is not None and i % t.selective_every:
            continue
        kwargs = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn is not None else {})
        block.forward = functools.partial(checkpoint, functools.partial(_recomputable, block, block.forward), **kwargs)


def _recomputable(block: nn.Module, forward, *args, **kwargs):
    """The block's forward; when autograd recomputes it in backward, fully_shard's parameters are
    gathered first (the recompute runs inside the block, where no module hook fires). Under
    torch.compile the recompute is part of the compiled backward graph, which runs after
    fully_shard's pre-backward hook has gathered the block."""
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1 and hasattr(block, "unshard"):
        block.unshard()
    return forward(*args, **kwargs)
