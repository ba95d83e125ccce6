"""Attention for the built-in models: one entry point for every mask kind and every backend.

Mask kinds: causal (or none), a sliding window (``window``: a query attends to its own key and
the ``window - 1`` before it), and documents (packed sequences: only tokens of one's own
document). Backends:

- torch's ``F.scaled_dot_product_attention`` on the local sequence: no documents, one rank of
  the sequence; a window becomes a boolean mask when the sequence is longer than it (on CUDA,
  SDPA picks its flash or memory-efficient kernel where the mask allows);
- a blockwise backend put in force around forward and backward (``in_force``): context
  parallelism's ring or all-gather over the cp ranks (``parallel/context_parallel.py``:
  ``context_parallel``), or blockwise attention on one rank for documents (``document_masking``
  there). It takes every mask kind: causal, window and documents are conditions of each chunk
  pair's mask, from the chunks' global positions.

Context parallelism supplies its layout (which positions a rank holds) and its backend; the
models only call ``scaled_dot_product_attention`` here. A model that calls torch's
``F.scaled_dot_product_attention`` directly reaches the same backend through a function mode,
for causal and unmasked attention (no window: torch's function has no such argument).

The backend in force is a process-wide stack, not a thread-local one, because activation
checkpointing recomputes attention during backward, where torch's function modes of the forward
are not in force.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hpservice._graph_break import eager_under_compile

__all__ = ["ActiveAttention", "in_force", "scaled_dot_product_attention"]

Backend = Callable[..., torch.Tensor]  # (q, k, v, *, is_causal, scale, window) -> out


class ActiveAttention:
    """A blockwise backend in force (yielded by ``context_parallel`` / ``document_masking``), and
    ``calls``: how many attention calls reached it, so a caller can check that a model's
    attention went through it (a model computing its own softmax would attend across shards or
    documents without a word)."""

    def __init__(self, backend: Backend):
        self.backend, self.calls = backend, 0

    def __call__(self, q, k, v, *, is_causal: bool, scale: float | None, window: int | None = None):
        self.calls += 1
        return self.backend(q, k, v, is_causal=is_causal, scale=scale, window=window)


_ACTIVE: list[ActiveAttention] = []


def scaled_dot_product_attention(q, k, v, *, is_causal: bool = False, scale: float | None = None, window: int | None = None):
    """What the built-in models call: ``F.scaled_dot_product_attention`` (no mask, no dropout), or
    the blockwise backend in force; ``window`` (causal only) as described in the module."""
    if window is not None and not is_causal:
        raise ValueError("scaled_dot_product_attention: a sliding window needs is_causal=True")
    if _ACTIVE:
        return _blockwise_eagerly(q, k, v, is_causal, scale, window)
    if window is not None and q.shape[-2] > window:
        i = torch.arange(q.shape[-2], device=q.device)
        offset = i[:, None] - i[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(offset >= 0) & (offset < window), scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


@eager_under_compile
def _blockwise_eagerly(q, k, v, is_causal, scale, window):
    """Outside what torch.compile traces (the backends' collectives and loops run as Python): a
    compiled block runs up to attention, this, then the rest."""
    return _ACTIVE[-1](q, k, v, is_causal=is_causal, scale=scale, window=window)


class _TorchSDPAMode(TorchFunctionMode):
    """torch's ``F.scaled_dot_product_attention`` -> the backend in force."""

    def __init__(self, active: ActiveAttention):
        super().__init__()
        self.active = active

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        attn_mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        is_causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        if attn_mask is not None or dropout:
            raise NotImplementedError(
                "context parallelism: scaled_dot_product_attention with attn_mask or dropout_p is not "
                "supported (a causal mask and document ids are); torch's context_parallel refuses them too"
            )
        if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        return self.active(q, k, v, is_causal=is_causal, scale=kwargs.get("scale"))


@contextlib.contextmanager
def in_force(active: ActiveAttention) -> Iterator[ActiveAttention]:
    """``active`` for ``scaled_dot_product_attention`` here (the stack) and torch's (the mode)."""
    _ACTIVE.append(active)
    try:
        with _TorchSDPAMode(active):
            yield active
    finally:
        _ACTIVE.pop()
