"""Mistral: the Llama decoder (``llama.py``) with sliding-window attention where the config sets
one (``sliding_window``: each token sees itself and the ``sliding_window - 1`` tokens before it;
Mistral 7B v0.1: 4096; v0.3 and later: none) and a head width that may differ from
dim / n_heads (``attn_head_dim``).

Hugging Face's ``MistralForCausalLM`` (``model_type: mistral``) imports with ``model.init_from``
and exports back (``hf.py``). A window shorter than the sequence is a boolean mask given to
SDPA; with context parallelism or document masking it is refused (not built yet).
"""

from __future__ import annotations

from ._spec import HFNames, ModelSpec
from .llama import Llama, LlamaConfig, flops_per_token, parallelize_llama

MISTRAL_FLAVORS: dict[str, LlamaConfig] = {
    # CPU tests and examples: a window (16) shorter than the sequences they train on.
    "tiny": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, sliding_window=16),
    # Mistral-7B-v0.3 (about 7.25e9 parameters; 32768-token vocabulary, no sliding window).
    "7B": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=14336,
        vocab_size=32768,
        rope_theta=1000000.0,
        max_seq_len=32768,
    ),
}


class Mistral(Llama):
    """A Mistral model: ``Llama`` with ``cfg.sliding_window`` where the flavor or checkpoint sets one."""


MODEL_SPEC = ModelSpec(
    name="mistral",
    model_cls=Mistral,
    config_cls=LlamaConfig,
    flavors=MISTRAL_FLAVORS,
    description="Mistral: the Llama decoder with a sliding attention window",
    flops_per_token=flops_per_token,
    hf=HFNames(
        "mistral",
        "MistralForCausalLM",
        config_fields=lambda cfg, need, refuse: {"sliding_window": cfg.get("sliding_window")},
        config_keys=lambda cfg: {"sliding_window": cfg.sliding_window},
        variants=frozenset({"sliding_window"}),
    ),
    parallelize=parallelize_llama,
    pipeline_stage=Mistral.keep_stage,
)
