"""Text generation from a Llama (or Qwen2, Qwen3, Mistral) with a key/value cache: greedy, temperature and top-k sampling.

``generate(model, prompt_ids, max_new_tokens)`` runs the prompt once (the "prefill"), then one
token at a time, each step attending over the cached keys and values of every earlier position
instead of recomputing them. The per-step math is the model's own: its projections, norms,
rotary table and feed-forward modules, called with the cached keys and values. The tests check
that the logits equal a full forward of the whole sequence.
One process, unsharded weights (a checkpoint loads into a plain model for this).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

from .llama import Attention, Llama

__all__ = ["KVCache", "generate", "next_logits"]


class KVCache:
    """Keys and values of the positions seen so far, per layer: ``[B, n_kv_heads, S, head_dim]``."""

    def __init__(self, n_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


def _attention(attn: Attention, x: torch.Tensor, rope: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
    """The model's attention (its own projections) over the cached positions and x's."""
    q, k, v = attn.qkv(x, rope)
    start, S = cache.length, x.shape[1]
    k, v = attn.expand_kv(*cache.extend(layer, k, v))
    # New query i (position start + i) sees keys 0 .. start + i (the last sliding_window of them).
    offset = torch.arange(start, start + S, device=x.device)[:, None] - torch.arange(start + S, device=x.device)
    mask = offset >= 0
    if attn.sliding_window is not None:
        mask &= offset < attn.sliding_window
    scale = getattr(attn, "softmax_scale", None)  # MLA's: 1 / sqrt(its query/key width)
    return attn.project_out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))


@torch.no_grad()
def next_logits(model: Llama, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` of ``tokens`` (the positions after the cached ones), filling the cache."""
    start, S = cache.length, tokens.shape[1]
    if start + S > model.cfg.max_seq_len:
        raise ValueError(f"generation past LlamaConfig.max_seq_len ({model.cfg.max_seq_len})")
    rope = model.rope_cache[start : start + S]
    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        h = h + _attention(layer.attention, layer.attention_norm(h), rope, cache, i)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    cache.length += S
    return model.output(model.norm(h))


@torch.no_grad()
def generate(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    stop_ids: Collection[int] = (),
) -> list[int]:
    """The new token ids after ``prompt_ids``: greedy with ``temperature`` 0, else sampled from
    the softmax at that temperature over the ``top_k`` most likely tokens (all when None); stops
    at any of ``stop_ids`` (included; a model's end-of-text tokens, ``hf_text.stop_ids``) or after
    ``max_new_tokens``."""
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(len(model.layers))
    logits = next_logits(model, torch.tensor([prompt_ids], device=device), cache)[:, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        if temperature <= 0:
            token = int(logits.argmax(-1))
        else:
            scaled = logits.float() / temperature
            if top_k is not None and top_k < scaled.shape[-1]:
                kth = scaled.topk(top_k, dim=-1).values[..., -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            token = int(torch.multinomial(scaled.softmax(-1), 1, generator=gen))
        out.append(token)
        if token in stop_ids or cache.length >= model.cfg.max_seq_len:
            break
        logits = next_logits(model, torch.tensor([[token]], device=device), cache)[:, -1]
    return out
