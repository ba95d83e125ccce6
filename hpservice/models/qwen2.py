"""Qwen2 / Qwen2.5: the Llama decoder (``llama.py``) with biases on the query, key and value
projections (``qkv_bias``), a larger rope base and a 152k-token vocabulary.

    tokens -> embed -> n_layers x [x + attn(norm(x)); h + swiglu(norm(h))] -> norm -> head

Hugging Face's ``Qwen2ForCausalLM`` (``model_type: qwen2``) imports with ``model.init_from`` and
exports back (``hf.py``); its sliding-window option (``use_sliding_window: true``, off in every
released Qwen2/2.5 model) is refused on import. The tensor-parallel plan is the Llama's: the
biases of the colwise projections are sharded with their rows.
"""

from __future__ import annotations

from ._spec import HFNames, ModelSpec
from .llama import Llama, LlamaConfig, flops_per_token, parallelize_llama

QWEN2_FLAVORS: dict[str, LlamaConfig] = {
    # CPU tests and examples: uneven head counts would not split over tp 2, so 4 and 2.
    "tiny": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, qkv_bias=True, norm_eps=1e-6),
    # Qwen2.5-0.5B (about 0.49e9 parameters, tied embeddings).
    "0.5B": LlamaConfig(
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        hidden_dim=4864,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=32768,
        tie_embeddings=True,
        qkv_bias=True,
    ),
    # Qwen2.5-7B (about 7.6e9 parameters).
    "7B": LlamaConfig(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        hidden_dim=18944,
        vocab_size=152064,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=32768,
        qkv_bias=True,
    ),
}


class Qwen2(Llama):
    """A Qwen2 / Qwen2.5 model: ``Llama`` with ``cfg.qkv_bias`` (the flavors set it)."""



def qwen_config_fields(refuse, **fields) -> dict:
    """The Qwen families' own config fields: ``fields``, once their per-layer sliding windows are
    known to be off (not implemented)."""
    refuse("use_sliding_window", (None, False), "Qwen's per-layer sliding windows are not implemented")
    return fields


MODEL_SPEC = ModelSpec(
    name="qwen2",
    model_cls=Qwen2,
    config_cls=LlamaConfig,
    flavors=QWEN2_FLAVORS,
    description="Qwen2 / Qwen2.5: the Llama decoder with q/k/v biases",
    flops_per_token=flops_per_token,
    hf=HFNames(
        "qwen2",
        "Qwen2ForCausalLM",
        config_fields=lambda cfg, need, refuse: qwen_config_fields(refuse, qkv_bias=True),
        config_keys=lambda cfg: {"use_sliding_window": False, "sliding_window": None},
        variants=frozenset({"qkv_bias"}),
    ),
    parallelize=parallelize_llama,
    pipeline_stage=Qwen2.keep_stage,
)
