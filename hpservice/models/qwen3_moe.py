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

from .llama import Llama, LlamaConfig, TransformerBlock
from .moe import MoE


@dataclass
class Qwen3MoeConfig(LlamaConfig):
    """A ``LlamaConfig`` (``hidden_dim``: the dense layers' SwiGLU) with the experts'."""

    num_experts: int = 8
    """Routed experts per sparse layer."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k)."""
    moe_hidden_dim: int = 32
    """Each expert's SwiGLU hidden size (Hugging Face's ``moe_intermediate_size``)."""
    moe_every: int = 1
    """Every moe_every-th layer is sparse (``decoder_sparse_step``)."""
    first_dense_layers: int = 0
    """The first layers stay dense (``mlp_only_layers`` = 0 .. first_dense_layers - 1)."""
    route_norm: bool = True
    """Renormalise each token's top-k weights to sum 1 (``norm_topk_prob``)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the load-balancing loss, per sparse layer (0: none)."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing: each step moves every expert's routing bias by this toward balance (0: off)."""
    capacity_factor: float | None = None
    """Each expert takes at most capacity_factor x its even share of a forward's tokens, the rest dropped and
    counted (None: dropless)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "experts_per_token", "moe_hidden_dim", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Qwen3MoeConfig.{name} must be a positive int, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig.experts_per_token ({self.experts_per_token}) must be at most num_experts ({self.num_experts})"
            )
        if self.first_dense_layers < 0 or self.aux_loss_coef < 0 or self.bias_update_rate < 0:
            raise ValueError("Qwen3MoeConfig: first_dense_layers, aux_loss_coef and bias_update_rate must be >= 0")

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense_layers and (layer_id + 1) % self.moe_every == 0

    def ffn_matmul_params(self, layer_id: int) -> int:
        """A sparse layer's active ones: the router, and the experts_per_token experts a token reaches."""
        if not self.is_sparse(layer_id):
            return super().ffn_matmul_params(layer_id)
        return self.dim * self.num_experts + self.experts_per_token * 3 * self.dim * self.moe_hidden_dim


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
