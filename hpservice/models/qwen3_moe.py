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


MODEL_SPEC = ModelSpec(
    name="qwen3_moe",
    model_cls=Qwen3Moe,
    config_cls=Qwen3MoeConfig,
    flavors=QWEN3_MOE_FLAVORS,
    description="Qwen3-MoE: Qwen3 blocks with mixture-of-experts feed-forwards (top-k softmax routing)",
    flops_per_token=flops_per_token,
    hf=HFNames("qwen3_moe", "Qwen3MoeForCausalLM"),
    parallelize=parallelize_llama,
    post_optimizer_hooks=moe_post_optimizer_hooks,
    pipeline_stage=Qwen3Moe.keep_stage,
)
