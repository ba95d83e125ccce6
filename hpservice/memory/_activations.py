"""The memory one micro-batch's forward and backward take on one rank, found by running them on
fake tensors.

``trace_step(part, ...)`` allocates the rank's local part (``_layout.rank_parts``) as
``FakeTensor``s (shapes, dtypes and devices, no data: an 8B model costs nothing) and runs one
micro-batch through it, forward, the loss (on the last stage), and backward, inside a
``TensorMemoryTracker``. That counts what this code itself allocates: every tensor autograd
saves (activation checkpointing applied as the trainer applies it, recomputation included),
the logits and the loss's float32 copies (with tensor parallelism the vocabulary-parallel
loss's own, ``parallel/loss.py``, on the rank's vocabulary piece), the attention kernel the device picks, and the
backward's temporaries. Each parameter's gradient is dropped the moment it is accumulated:
fully_shard moves gradients out of the unsharded parameters unit by unit, and the estimate counts
that separately (``estimate.py``).

Returned: ``saved`` (bytes alive after the forward: what one in-flight micro-batch of a pipeline
keeps) and ``peak`` (the high-water mark over forward and backward), both above the parameters.

A model whose forward cannot run on fake tensors (a routed mixture of experts sizes its buffers
from the routing: data-dependent shapes) gets the reason instead; the estimate then uses the per-block
formula ``formula_bytes`` and says so.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["formula_bytes", "trace_blocks", "trace_step"]

TRACED_BLOCKS = 2  # blocks run on fake tensors; the rest extrapolated (each block saves the same)


def trace_blocks(part: nn.Module, spec, frozen: set[str], **kwargs) -> tuple[int, int] | str:
    """``trace_step`` of a copy of ``part`` (left as it is) cut to its first ``TRACED_BLOCKS`` and
    ``TRACED_BLOCKS - 1`` blocks: the blocks of a decoder are alike, so what a forward saves and
    the backward's high-water mark grow by the same amount per block (the difference of the two
    runs) up to the part's block count. A few blocks cost a fraction of a deep model's run."""
    layers = getattr(part, "layers", None)
    n = len(layers) if layers is not None else 0
    if n <= TRACED_BLOCKS:
        return trace_step(_copy_with_blocks(part, n), spec, frozen, **kwargs)
    runs = []
    for k in (TRACED_BLOCKS - 1, TRACED_BLOCKS):
        run = trace_step(_copy_with_blocks(part, k), spec, frozen, **kwargs)
        if isinstance(run, str):
            return run
        runs.append(run)
    (s1, p1), (s2, p2) = runs
    more = n - TRACED_BLOCKS
    return s2 + more * (s2 - s1), p2 + more * (p2 - p1)


def _copy_with_blocks(part: nn.Module, k: int) -> nn.Module:
    """A deep copy of ``part`` with its first ``k`` blocks only (the others are not copied)."""
    import copy

    layers = getattr(part, "layers", None)
    if layers is None:
        return copy.deepcopy(part)
    kept = type(layers)() if not isinstance(layers, nn.ModuleDict) else nn.ModuleDict(dict(list(layers.items())[:k]))
    if not isinstance(layers, nn.ModuleDict):
        kept.extend(list(layers)[:k])
    part.layers = kept
    try:
        return copy.deepcopy(part)
    finally:
        part.layers = layers


def trace_step(
    part: nn.Module,
    spec,
    frozen: set[str],
    *,
    first: bool,
    last: bool,
    rows: int,
    seq: int,
    dim: int,
    device: str,
) -> tuple[int, int] | str:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hpservice.data import IGNORE_INDEX
    from hpservice.parallel.loss import _VocabParallelCE
    from hpservice.train._activation_checkpointing import apply_activation_checkpointing
    from hpservice.train._loss import cross_entropy_loss

    from ._tracker import TensorMemoryTracker

    tp = spec.parallelism.tp
    compute = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.parallelism.mixed_precision]
    if getattr(part, "layers", None) is not None:
        apply_activation_checkpointing(part, spec)
    try:
        if compute != torch.float32:  # fully_shard's mixed precision: the parameters, not the buffers
            for module in part.modules():
                for name, p in list(module.named_parameters(recurse=False)):
                    if p.is_floating_point():
                        module.register_parameter(name, nn.Parameter(p.detach().to(compute), p.requires_grad))
        with FakeTensorMode(allow_non_fake_inputs=True), TensorMemoryTracker(track_resize=False) as mem:
            part.to_empty(device=device)  # tracked from here: views of the parameters are not new memory
            if hasattr(part, "init_buffers"):
                part.init_buffers()
            for name, p in part.named_parameters():
                if name in frozen:
                    p.requires_grad_(False)
                else:
                    p.register_post_accumulate_grad_hook(_drop_grad)
            ids = torch.zeros(rows, seq, dtype=torch.long, device=device)
            base = mem.current
            mem.reset_peak()
            if first:
                x = ids
            else:  # the previous stage's activations, received
                x = torch.zeros(rows, seq, dim, dtype=compute, device=device, requires_grad=True)
            out = part(x)
            if last and tp > 1:  # the loss on the rank's vocabulary piece, as the trainer's
                out = _VocabParallelCE.apply(out.flatten(0, 1), ids.flatten(), IGNORE_INDEX, "mean")
            elif last:
                out = cross_entropy_loss(out, ids)
            saved = mem.current - base
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            del out, x
            return saved, mem.peak - base
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def formula_bytes(cfg, tokens: int, blocks: int, tp: int, act_bytes: int, checkpointed: bool, vocab_local: int | None) -> tuple[int, int]:
    """(saved, peak) of one micro-batch by formula, for a model that cannot be traced: per block
    the norms' inputs and outputs (4 h), q/k/v (h + 2 kv), the attention output (h), the
    feed-forward's inputs of its nonlinearity and product (4 f, f the routed experts' top_k x
    hidden plus the shared ones for a mixture of experts: experts_per_token); the logits and their float32 copy and
    gradient; with activation checkpointing each block keeps its input and one recomputes."""
    h = cfg.dim
    kv = getattr(cfg, "n_kv_heads", cfg.n_heads) * cfg.head_dim
    f = cfg.ffn_hidden_dim
    if getattr(cfg, "num_experts", 0):
        f = (cfg.experts_per_token + getattr(cfg, "n_shared_experts", 0)) * cfg.moe_hidden_dim
    block = tokens * (4 * h + (h + 2 * kv + h + 4 * f) // tp) * act_bytes
    logits = 3 * tokens * vocab_local * 4 if vocab_local else 0
    saved = (blocks * tokens * h * act_bytes + block) if checkpointed else blocks * block
    return saved + logits // 3, saved + logits + block

