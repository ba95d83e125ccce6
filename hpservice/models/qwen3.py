"""Qwen3 (dense): the Llama decoder (``llama.py``) with an RMSNorm over each head of the queries
and keys before the rotary embedding (``qk_norm``), and a head width set on its own
(``attn_head_dim``: 128 in every Qwen3, whatever the model width).

    q = rope(q_norm(wq(x).view(B, S, heads, head_dim)))      # likewise k with k_norm

Hugging Face's ``Qwen3ForCausalLM`` (``model_type: qwen3``) imports with ``model.init_from`` and
exports back (``hf.py``). Tensor parallelism: the Llama's plan, plus ``q_norm`` / ``k_norm`` run
on each rank's heads (``SequenceParallel(sequence_dim=2)``: their weights replicated, the partial
gradients of each rank's heads all-reduced), as torchtitan's Qwen3 plan does.
"""

from __future__ import annotations

from ._spec import HFNames, ModelSpec
from .llama import Llama, LlamaConfig, flops_per_token, parallelize_llama
from .qwen2 import qwen_config_fields

QWEN3_CONFIG_KEYS = {"use_sliding_window": False, "sliding_window": None, "attention_bias": False}

QWEN3_FLAVORS: dict[str, LlamaConfig] = {
    # CPU tests and examples: a head width (24) other than dim / n_heads (16), as in the real ones.
    "tiny": LlamaConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attn_head_dim=24, vocab_size=256, qk_norm=True, norm_eps=1e-6
    ),
    # Qwen3-0.6B (about 0.6e9 parameters, tied embeddings).
    "0.6B": LlamaConfig(
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        attn_head_dim=128,
        hidden_dim=3072,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=40960,
        tie_embeddings=True,
        qk_norm=True,
    ),
    # Qwen3-8B (about 8.2e9 parameters).
    "8B": LlamaConfig(
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        attn_head_dim=128,
        hidden_dim=12288,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=40960,
        qk_norm=True,
    ),
}


class Qwen3(Llama):
    """A dense Qwen3 model: ``Llama`` with ``cfg.qk_norm`` and ``cfg.attn_head_dim`` (the flavors set them)."""


MODEL_SPEC = ModelSpec(
    name="qwen3",
    model_cls=Qwen3,
    config_cls=LlamaConfig,
    flavors=QWEN3_FLAVORS,
    description="Qwen3 (dense): the Llama decoder with per-head q/k norms and a head width of its own",
    flops_per_token=flops_per_token,
    hf=HFNames(
        "qwen3",
        "Qwen3ForCausalLM",
        config_fields=lambda cfg, need, refuse: qwen_config_fields(refuse, qk_norm=True),
        config_keys=lambda cfg: QWEN3_CONFIG_KEYS,
        variants=frozenset({"qk_norm"}),
    ),
    parallelize=parallelize_llama,
    pipeline_stage=Qwen3.keep_stage,
)
