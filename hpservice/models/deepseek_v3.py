"""DeepSeek-V3: multi-head latent attention (MLA) and a mixture of experts with shared experts,
sigmoid-scored grouped top-k routing and aux-loss-free load balancing (DeepSeek-AI 2024).

    block i:  h = x + MLA(norm(x));  out = h + (MoE if i >= first_dense_layers else SwiGLU)(norm(h))

**MLA** (``MLAttention``): queries through a low-rank bottleneck (``q_lora_rank``; None: one
projection), keys and values from one compressed latent (``kv_lora_rank``) shared by all heads,
plus a rotary part of the key (``qk_rope_head_dim``) shared by all heads::

    q = wq_b(q_a_norm(wq_a(x)))  -> per head [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)]
    c, k_pe = split(wkv_a(x))  -> c [kv_lora_rank], k_pe [qk_rope_head_dim] (one head)
    k_nope, v = split(wkv_b(kv_norm(c)))  per head
    attention(q = [q_nope | rope(q_pe)], k = [k_nope | rope(k_pe)], v), scale 1 / sqrt(qk_head_dim)

The rotary dims are rotated in interleaved pairs, as DeepSeek's weights are laid out
(``rope_interleave``), so a Hugging Face checkpoint's rows load unpermuted. With YaRN frequencies
(DeepSeek-V3's long-context config) the softmax scale is multiplied by ``yarn_mscale(factor,
mscale_all_dim) ** 2``, as DeepSeek's reference does.

**MoE** (``moe.py``): ``num_experts`` routed experts, ``experts_per_token`` per token, scores
``sigmoid`` of the gate's logits; each token chooses among the ``n_limited_groups`` best of
``n_expert_groups`` groups (node-limited routing), on the scores plus ``expert_bias`` (Hugging
Face's ``e_score_correction_bias``, moved by ``bias_update_rate`` after each step: the
aux-loss-free balancing); the weights, the chosen scores renormalised (``route_norm``) times
``route_scale``; plus ``n_shared_experts`` always-on experts (one SwiGLU of that many times
``moe_hidden_dim``). The sequence-wise auxiliary loss (``aux_loss_coef``, per sequence) is ours:
transformers' DeepSeek-V3 has none.

Hugging Face's ``DeepseekV3ForCausalLM`` (``model_type: deepseek_v3``) imports with
``model.init_from`` and exports back (``hf.py``). ``rope_interleave: false`` is refused on import
(not built yet), never approximated.
Tensor parallelism: the query and the per-head key/value up-projection colwise, the output rowwise
(the compressed latent, one head, is computed whole on every tp rank); MoE layers replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hpservice.dtensor import DTensor, Partial, Replicate

from ._spec import HFNames, ModelSpec
from .attention import scaled_dot_product_attention
from .llama import (
    Llama,
    RMSNorm,
    TransformerBlock,
    _init_linear,
    apply_rope,
    flops_per_token,
    parallelize_llama,
    yarn_mscale,
)
from .moe import MoE, MoEConfig, moe_post_optimizer_hooks


@dataclass
class DeepseekV3Config(MoEConfig):
    """A ``MoEConfig`` (dim, layers, heads, vocabulary, ``hidden_dim`` of the dense layers'
    SwiGLU, norms, rope, the experts) with MLA's fields, shared experts and grouped routing.
    ``n_kv_heads`` must equal ``n_heads``; its sequence-wise aux loss is ``aux_loss_coef``."""

    q_lora_rank: int | None = None
    """Rank of the query bottleneck (None: one projection)."""
    kv_lora_rank: int = 32
    """Width of the compressed key/value latent."""
    qk_nope_head_dim: int = 16
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 8
    """Per-head query/key width with it (the key's is shared by all heads)."""
    v_head_dim: int = 16
    """Per-head value width."""
    first_dense_layers: int = 1
    n_shared_experts: int = 1
    """Always-on experts (one SwiGLU of n_shared_experts x moe_hidden_dim)."""
    n_expert_groups: int = 1
    """Routing groups; each token chooses among the n_limited_groups best (node-limited routing)."""
    n_limited_groups: int = 1
    route_scale: float = 1.0
    """Multiplies the routing weights (``routed_scaling_factor``)."""

    hf_rotate_half: ClassVar[bool] = False  # DeepSeek's weights keep the rotary dims in interleaved pairs, as ours

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads != self.n_heads:
            raise ValueError(f"DeepseekV3Config.n_kv_heads ({self.n_kv_heads}) must equal n_heads ({self.n_heads}) (MLA)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV3Config.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if self.num_experts % self.n_expert_groups or not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError(
                f"DeepseekV3Config: n_expert_groups ({self.n_expert_groups}) must divide num_experts "
                f"({self.num_experts}) and n_limited_groups ({self.n_limited_groups}) be between 1 and it"
            )

    @property
    def head_dim(self) -> int:
        """The rotary width (the rotary table's): ``qk_rope_head_dim``."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_matmul_params(self) -> int:
        q = self.dim * self.n_heads * self.qk_head_dim
        if self.q_lora_rank is not None:
            q = self.dim * self.q_lora_rank + self.q_lora_rank * self.n_heads * self.qk_head_dim
        kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + self.n_heads * self.v_head_dim * self.dim

    def attention_width(self) -> int:
        return self.n_heads * (self.qk_head_dim + self.v_head_dim) // 2

    def active_experts(self) -> int:
        return self.experts_per_token + self.n_shared_experts


DEEPSEEK_V3_FLAVORS: dict[str, DeepseekV3Config] = {
    # CPU tests and examples: 8 experts in 4 groups, 2 per token from the best 2 groups, 1 shared.
    "tiny": DeepseekV3Config(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256, hidden_dim=128, norm_eps=1e-6,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, experts_per_token=2, moe_hidden_dim=32, n_shared_experts=1, first_dense_layers=1,
        n_expert_groups=4, n_limited_groups=2, route_scale=2.5,
    ),
    # DeepSeek-V3 (671e9 parameters, 37e9 active) at its pretraining context (4096; its YaRN config
    # extends it to 163840: model.overrides rope_scaling / max_seq_len, or init_from its checkpoint).
    "671B": DeepseekV3Config(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280, hidden_dim=18432, norm_eps=1e-6,
        max_seq_len=4096, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=256, experts_per_token=8, moe_hidden_dim=2048, n_shared_experts=1,
        first_dense_layers=3, n_expert_groups=8, n_limited_groups=4, route_scale=2.5,
    ),
}


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module doc); the same ``qkv`` / ``expand_kv`` /
    ``project_out`` steps as the Llama's ``Attention``, so generation's key/value cache works."""

    def __init__(self, cfg: DeepseekV3Config, init_std: float = 0.02):
        super().__init__()
        self.n_heads = self.n_kv_heads = cfg.n_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.softmax_scale = cfg.qk_head_dim**-0.5
        yarn = cfg.rope_scaling if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "yarn" else None
        if yarn and yarn.get("mscale_all_dim"):  # DeepSeek's YaRN: a sharper softmax over the longer context
            self.softmax_scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
        self.sliding_window = None
        self.tp_mesh = None  # set by the tensor-parallel plan: k_pe's gradient sums over its ranks' heads
        self.init_std = init_std
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps for MLA's norms
            self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * cfg.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)

    @property
    def colwise(self) -> tuple[str, ...]:
        """The projections tensor parallelism splits by heads (the plan's colwise ones)."""
        return ("wq" if hasattr(self, "wq") else "wq_b", "wkv_b")

    def reset_parameters(self) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                _init_linear(getattr(self, name), 0.02)
        _init_linear(self.wo, self.init_std)
        self.kv_norm.reset_parameters()
        if hasattr(self, "q_a_norm"):
            self.q_a_norm.reset_parameters()

    def qkv(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(B, S, self.n_heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], -1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], -1)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, S, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        if self.tp_mesh is not None:  # one k_pe for every head, each tp rank's heads add to its gradient
            k_pe = DTensor.from_local(k_pe, self.tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        k_pe = apply_rope(k_pe.view(B, S, 1, self.rope_dim), rope).expand(B, S, self.n_heads, self.rope_dim)
        q = torch.cat([q_nope, apply_rope(q_pe, rope)], -1)
        k = torch.cat([k_nope, k_pe], -1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def expand_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # every head has its own keys and values already

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.v_dim))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x, rope)
        out = scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return self.project_out(out)


class DeepseekV3(Llama):
    """DeepSeek-V3: ``Llama`` blocks with MLA, and a ``MoE`` feed-forward after the first dense layers."""

    cfg: DeepseekV3Config

    def build_block(self, layer_id: int, cfg: DeepseekV3Config) -> nn.Module:
        block = TransformerBlock(layer_id, cfg)
        init_std = block.feed_forward.init_std
        block.attention = MLAttention(cfg, init_std)
        if cfg.is_sparse(layer_id):
            block.feed_forward = MoE(
                cfg.dim, cfg.moe_hidden_dim, cfg.num_experts, cfg.experts_per_token,
                score_func="sigmoid", route_norm=cfg.route_norm, route_scale=cfg.route_scale,
                num_expert_groups=cfg.n_expert_groups if cfg.n_expert_groups > 1 else None,
                num_limited_groups=cfg.n_limited_groups if cfg.n_expert_groups > 1 else None,
                shared_hidden_dim=cfg.n_shared_experts * cfg.moe_hidden_dim,
                aux_loss_coef=cfg.aux_loss_coef, capacity_factor=cfg.capacity_factor, aux_loss="sequence", init_std=init_std,
            )  # fmt: skip
        return block


__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepseekV3", "DeepseekV3Config", "MLAttention"]



def _deepseek_fields(cfg: dict, need, refuse) -> dict:
    """``DeepseekV3Config``'s own fields from a ``deepseek_v3`` config.json."""
    refuse("rope_interleave", (None, True), "the rotary dims are read in DeepSeek's interleaved order")
    refuse("scoring_func", (None, "sigmoid"), "DeepSeek-V3's router scores with a sigmoid")
    refuse("topk_method", (None, "noaux_tc"), "DeepSeek-V3's grouped top-k with correction biases is implemented")
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ValueError("no n_routed_experts (or num_local_experts)")
    return {
        "n_kv_heads": need("num_attention_heads"),  # MLA: every head its own keys and values
        "attn_head_dim": None,
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": need("kv_lora_rank"),
        "qk_nope_head_dim": need("qk_nope_head_dim"),
        "qk_rope_head_dim": need("qk_rope_head_dim"),
        "v_head_dim": need("v_head_dim"),
        "num_experts": experts,
        "experts_per_token": need("num_experts_per_tok"),
        "moe_hidden_dim": need("moe_intermediate_size"),
        "n_shared_experts": cfg.get("n_shared_experts") or 0,
        "first_dense_layers": cfg.get("first_k_dense_replace") or 0,
        "n_expert_groups": cfg.get("n_group") or 1,
        "n_limited_groups": cfg.get("topk_group") or 1,
        "route_norm": bool(cfg.get("norm_topk_prob", True)),
        "route_scale": float(cfg.get("routed_scaling_factor", 1.0)),
    }


def _deepseek_keys(cfg) -> dict:
    return {
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_hidden_dim,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.first_dense_layers,
        "n_group": cfg.n_expert_groups,
        "topk_group": cfg.n_limited_groups,
        "norm_topk_prob": cfg.route_norm,
        "routed_scaling_factor": cfg.route_scale,
        "rope_interleave": True,
        "attention_bias": False,
    }


MODEL_SPEC = ModelSpec(
    name="deepseek_v3",
    model_cls=DeepseekV3,
    config_cls=DeepseekV3Config,
    flavors=DEEPSEEK_V3_FLAVORS,
    description="DeepSeek-V3: multi-head latent attention, shared experts, grouped sigmoid routing, aux-loss-free balancing",
    flops_per_token=flops_per_token,
    hf=HFNames(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        config_fields=lambda cfg, need, refuse: _deepseek_fields(cfg, need, refuse),
        config_keys=lambda cfg: _deepseek_keys(cfg),
        buffers=("feed_forward.expert_bias",),  # the routing biases: transformers' e_score_correction_bias
    ),
    parallelize=parallelize_llama,
    post_optimizer_hooks=moe_post_optimizer_hooks,
    pipeline_stage=DeepseekV3.keep_stage,
)
