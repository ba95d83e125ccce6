"""Qwen3-MoE: the Qwen3 decoder (``qwen3.py``: per-head q/k norms, its own head width) whose
feed-forward is a mixture of experts (``moe.py``) in the sparse layers: a softmax top-k router
over ``num_experts`` SwiGLU experts, ``experts_per_token`` per token, their weights renormalised
to sum 1 (``route_norm``, Hugging Face's ``norm_topk_prob``).

    block i:  h = x + attn(norm(x));  out = h + (MoE if sparse(i) else SwiGLU)(norm(h))
    sparse(i) = i >= first_dense_layers and (i + 1) % moe_every == 0

Hugging Face's ``Qwen3MoeForCausalLM`` (``model_type: qwen3_moe``; its ``decoder_sparse_step``
and ``mlp_only_layers`` = the first layers) imports with ``model.init_from`` and exports back
(``hf.py``: expert e's ``gate_proj`` / ``up_proj`` / ``down_proj`` are row e of our stacked
``w1`` / ``w3`` / ``w2``). Its auxiliary loss (``router_aux_loss_coef``, when
``output_router_logits``) becomes ``aux_loss_coef``; ours is per layer (``moe.py``).

Tensor parallelism shards attention as the Llama's plan does; the MoE layers run replicated on
the tp ranks (every rank routes the same tokens to the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ._spec import HFNames, ModelSpec
from .llama import Llama, TransformerBlock, flops_per_token, parallelize_llama
from .moe import MoE, MoEConfig, moe_post_optimizer_hooks
from .qwen2 import qwen_config_fields
from .qwen3 import QWEN3_CONFIG_KEYS


@dataclass
class Qwen3MoeConfig(MoEConfig):
    """``MoEConfig`` with Qwen3-MoE's sparse-layer step; its first dense layers are Hugging Face's
    ``mlp_only_layers``."""

    moe_every: int = 1
    """Every moe_every-th layer is sparse (``decoder_sparse_step``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.moe_every, int) or isinstance(self.moe_every, bool) or self.moe_every <= 0:
            raise ValueError(f"Qwen3MoeConfig.moe_every must be a positive int, got {self.moe_every!r}")

    def is_sparse(self, layer_id: int) -> bool:
        return super().is_sparse(layer_id) and (layer_id + 1) % self.moe_every == 0

    def sparse_layers(self) -> int:
        # layers i in [first_dense_layers, n_layers) with (i + 1) a multiple of moe_every
        first = min(self.first_dense_layers, self.n_layers)
        return self.n_layers // self.moe_every - first // self.moe_every


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeConfig] = {
    # CPU tests and examples: 8 experts, 2 per token, the first layer dense.
    "tiny": Qwen3MoeConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attn_head_dim=24, vocab_size=256, qk_norm=True, norm_eps=1e-6,
        hidden_dim=128, num_experts=8, experts_per_token=2, moe_hidden_dim=32, first_dense_layers=1,
    ),
    # Qwen3-30B-A3B (about 30.5e9 parameters, 3.3e9 active per token).
    "30B-A3B": Qwen3MoeConfig(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, attn_head_dim=128, hidden_dim=6144, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm=True,
        num_experts=128, experts_per_token=8, moe_hidden_dim=768,
    ),
}


class Qwen3Moe(Llama):
    """Qwen3-MoE: ``Llama`` blocks with a ``MoE`` feed-forward in the sparse layers."""

    cfg: Qwen3MoeConfig

    def build_block(self, layer_id: int, cfg: Qwen3MoeConfig) -> nn.Module:
        block = TransformerBlock(layer_id, cfg)
        if cfg.is_sparse(layer_id):
            block.feed_forward = MoE(
                cfg.dim, cfg.moe_hidden_dim, cfg.num_experts, cfg.experts_per_token,
                route_norm=cfg.route_norm, aux_loss_coef=cfg.aux_loss_coef, capacity_factor=cfg.capacity_factor,
                init_std=block.feed_forward.init_std,
            )  # fmt: skip
        return block



def _moe_fields(cfg: dict, need) -> dict:
    """``Qwen3MoeConfig``'s own fields from a ``qwen3_moe`` config.json."""
    dense = list(cfg.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ValueError(
            f"mlp_only_layers = {dense[:8]!r}{'...' if len(dense) > 8 else ''} is not supported: dense layers must "
            "be the first ones (0, 1, ...)"
        )
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 4's name, 5's
    if experts is None:
        raise ValueError("no num_experts (or num_local_experts)")
    return {
        "num_experts": experts,
        "experts_per_token": need("num_experts_per_tok"),
        "moe_hidden_dim": need("moe_intermediate_size"),
        "moe_every": cfg.get("decoder_sparse_step", 1),
        "first_dense_layers": len(dense),
        "route_norm": bool(cfg.get("norm_topk_prob", False)),
        # transformers adds its auxiliary loss only when output_router_logits is set
        "aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0,
    }


def _moe_keys(cfg) -> dict:
    return {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_hidden_dim,
        "decoder_sparse_step": cfg.moe_every,
        "mlp_only_layers": list(range(cfg.first_dense_layers)),
        "norm_topk_prob": cfg.route_norm,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": cfg.aux_loss_coef > 0,
    }


MODEL_SPEC = ModelSpec(
    name="qwen3_moe",
    model_cls=Qwen3Moe,
    config_cls=Qwen3MoeConfig,
    flavors=QWEN3_MOE_FLAVORS,
    description="Qwen3-MoE: Qwen3 blocks with mixture-of-experts feed-forwards (top-k softmax routing)",
    flops_per_token=flops_per_token,
    hf=HFNames(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        config_fields=lambda cfg, need, refuse: qwen_config_fields(refuse, qk_norm=True, **_moe_fields(cfg, need)),
        config_keys=lambda cfg: {**QWEN3_CONFIG_KEYS, **_moe_keys(cfg)},
        variants=frozenset({"qk_norm"}),
        # routing biases change routing; transformers' Qwen3-MoE has none
        unsupported=lambda cfg: ["bias_update_rate"] if cfg.bias_update_rate else [],
    ),
    parallelize=parallelize_llama,
    post_optimizer_hooks=moe_post_optimizer_hooks,
    pipeline_stage=Qwen3Moe.keep_stage,
)
