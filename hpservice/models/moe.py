"""Mixture of experts: a token-choice top-k router, grouped experts, dispatch and combine, and
load balancing. The names are torchtitan's (``TokenChoiceTopKRouter``, ``GroupedExperts``, ``MoE``).

One MoE layer on the tokens ``x [T, dim]`` (T = batch x sequence)::

    weights, experts = router(x)                 # [T, top_k] each: which experts, how much
    order = argsort(experts.flatten())           # the T * top_k (token, expert) pairs, by expert
    routed = x[order // top_k]                   # dispatch: each expert's tokens, contiguous
    out = grouped_experts(routed, counts)        # one SwiGLU per expert on its slice of rows
    y = zeros.index_add(order // top_k, out * weights.flatten()[order])     # combine
    y += shared_experts(x)                       # DeepSeek's always-on experts, when it has them

Dropless by default: every token reaches its top_k experts, however uneven the load. With a
``capacity_factor`` each expert takes at most ``ceil(capacity_factor * T * top_k / E)`` of a
forward's (token, expert) pairs, the earliest tokens first; the others are dropped (the token
keeps its other experts and the residual) and counted (``dropped``; the step's ``moe_dropped``).

**Routing** (``TokenChoiceTopKRouter``): scores are ``softmax`` of the gate's logits (Qwen3-MoE,
Mixtral) or their ``sigmoid`` (DeepSeek-V3). The top_k experts are chosen on the scores plus the
layer's ``expert_bias`` (the aux-loss-free balancing of DeepSeek-V3; zero otherwise), optionally
only among the ``num_limited_groups`` best of ``num_expert_groups`` groups (a group's score: the
sum of its two best). The weights are the chosen experts' scores (without the bias), divided by
their sum with ``route_norm`` and multiplied by ``route_scale``.

**Load balancing**:

- an auxiliary loss (``aux_loss_coef`` > 0): per layer, ``coef * E * sum_e f_e * P_e`` with
  ``f_e`` the fraction of the (token, expert) pairs routed to expert e and ``P_e`` its mean score
  (Switch Transformer; over each sequence with ``aux_loss="sequence"``, DeepSeek-V3's
  sequence-wise loss, over the whole micro-batch with ``"batch"``). It is not added to the
  model's output: its gradient joins the backward through the layer's output (Megatron's
  ``MoEAuxLossAutoScaler``), scaled by ``aux_loss_scale`` (the trainer sets 1 / micro-batches), so
  a training loop that only backpropagates the cross entropy trains it too.
- aux-loss-free (``bias_update_rate`` > 0): after each optimizer step
  ``update_expert_biases`` moves each layer's ``expert_bias`` by ``rate * sign(mean load - load)``
  (DeepSeek-V3), with the loads summed over every rank that saw other tokens.

Each layer counts the tokens each expert received (``tokens_per_expert``, summed over the
forwards since the last ``expert_loads``), for the step's metrics and the bias update.

**Grouped experts**: all experts' weights in one tensor per projection (``w1``, ``w3``
``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``); ``torch._grouped_mm`` where the device has
it (CUDA, bfloat16), else one matmul per expert on its slice of rows (exact, any device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._graph_break import eager_under_compile
from .llama import LlamaConfig

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoEUpkeep",
    "PostOptimizerHook",
    "TokenChoiceTopKRouter",
    "dropped_pairs",
    "expert_loads",
    "mean_aux_loss",
    "moe_layers",
    "moe_post_optimizer_hooks",
    "update_expert_biases",
]


@dataclass
class MoEConfig(LlamaConfig):
    """A ``LlamaConfig`` (``hidden_dim``: the dense layers' SwiGLU) with the experts' fields every
    mixture-of-experts family shares (``qwen3_moe.py``, ``deepseek_v3.py`` add their own)."""

    num_experts: int = 8
    """Routed experts per sparse layer."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k)."""
    moe_hidden_dim: int = 32
    """Each expert's SwiGLU hidden size (Hugging Face's ``moe_intermediate_size``)."""
    first_dense_layers: int = 0
    """The first layers stay dense."""
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
        name = type(self).__name__
        for field in ("num_experts", "experts_per_token", "moe_hidden_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"{name}.experts_per_token ({self.experts_per_token}) must be at most num_experts ({self.num_experts})"
            )
        if self.first_dense_layers < 0 or self.aux_loss_coef < 0 or self.bias_update_rate < 0:
            raise ValueError(f"{name}: first_dense_layers, aux_loss_coef and bias_update_rate must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"{name}.capacity_factor must be positive or None (dropless), got {self.capacity_factor!r}")

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense_layers

    def sparse_layers(self) -> int:
        """How many of the ``n_layers`` blocks are mixture-of-experts layers (counted, not listed)."""
        return max(0, self.n_layers - self.first_dense_layers)

    def active_experts(self) -> int:
        """The experts of moe_hidden_dim each token runs through in a sparse layer (DeepSeek adds
        its shared ones)."""
        return self.experts_per_token

    def ffn_matmul_params(self, layer_id: int) -> int:
        """A sparse layer's active ones: the router and the experts a token runs through."""
        if not self.is_sparse(layer_id):
            return super().ffn_matmul_params(layer_id)
        return self.dim * self.num_experts + self.active_experts() * 3 * self.dim * self.moe_hidden_dim


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts (see the module doc for the scoring rules)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
    ):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"TokenChoiceTopKRouter: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TokenChoiceTopKRouter: top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
        if num_expert_groups is not None and (
            num_experts % num_expert_groups or not 1 <= (num_limited_groups or 0) <= num_expert_groups
        ):
            raise ValueError(
                f"TokenChoiceTopKRouter: num_expert_groups ({num_expert_groups}) must divide num_experts "
                f"({num_experts}) and num_limited_groups ({num_limited_groups}) be between 1 and it"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, dim]`` -> (weights ``[T, top_k]`` in x's dtype, experts ``[T, top_k]`` int64,
        scores ``[T, E]`` float32: every expert's score, for the auxiliary loss)."""
        logits = self.gate(x)
        scores = logits.float().softmax(-1) if self.score_func == "softmax" else logits.float().sigmoid()
        choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None:
            choice = self._best_groups_only(choice)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        return (weights * self.route_scale).to(x.dtype), experts, scores

    def _best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's ``num_limited_groups`` best groups at -inf
        (DeepSeek-V3's node-limited routing; a group's score is the sum of its two best)."""
        T = choice.shape[0]
        groups = choice.view(T, self.num_expert_groups, -1)
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        best = group_scores.topk(self.num_limited_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~keep[..., None], float("-inf")).view(T, -1)

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate.weight, std=std)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts, ``w2(silu(w1 x) * w3 x)`` each, weights stacked per projection."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, init_std: float = 0.02):
        super().__init__()
        self.num_experts, self.init_std = num_experts, init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=self.init_std)
        nn.init.normal_(self.w3, std=self.init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [N, dim]``: rows sorted by expert, ``counts[e]`` of them for expert e -> ``[N, dim]``."""
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        if _grouped_mm_works(x):
            offsets = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        outs = []
        for e, rows in enumerate(x.split(counts.tolist())):
            outs.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def _grouped_mm_works(x: torch.Tensor) -> bool:
    # torch's grouped GEMM: CUDA (sm90+ kernels), bfloat16, 16-byte aligned rows
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer's output; in the backward, the auxiliary loss gets gradient ``scale``
    (as if ``scale * aux_loss`` had been added to the loss being backpropagated)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class MoE(nn.Module):
    """A routed mixture of ``num_experts`` SwiGLU experts, ``top_k`` per token, optionally with
    always-on shared experts (``shared_hidden_dim`` > 0: one SwiGLU of that hidden size).

    Buffers: ``expert_bias [E]`` (persistent: the aux-loss-free balancing state, checkpointed),
    ``tokens_per_expert [E]`` (not persistent: the load since the last ``expert_loads``).
    ``aux_loss_sum`` / ``aux_loss_count``: the auxiliary losses of the training forwards since
    the last ``mean_aux_loss`` (activation checkpointing's recomputations are not counted twice,
    nor are their tokens).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        shared_hidden_dim: int = 0,
        aux_loss_coef: float = 0.0,
        aux_loss: str = "batch",
        capacity_factor: float | None = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        if aux_loss not in ("batch", "sequence"):
            raise ValueError(f"MoE: aux_loss must be 'batch' or 'sequence', got {aux_loss!r}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor must be positive or None (dropless), got {capacity_factor!r}")
        self.capacity_factor = capacity_factor
        self.num_experts, self.top_k = num_experts, top_k
        self.router = TokenChoiceTopKRouter(
            dim, num_experts, top_k, score_func=score_func, route_norm=route_norm, route_scale=route_scale,
            num_expert_groups=num_expert_groups, num_limited_groups=num_limited_groups,
        )  # fmt: skip
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, init_std)
        if shared_hidden_dim:
            from .llama import FeedForward

            self.shared_experts = FeedForward(dim, shared_hidden_dim, init_std)
        else:
            self.shared_experts = None
        self.aux_loss_coef, self.aux_loss_kind = aux_loss_coef, aux_loss
        self.aux_loss_scale = 1.0  # set by the trainer: 1 / the step's micro-batches
        self.aux_loss_sum, self.aux_loss_count = 0.0, 0  # since the last mean_aux_loss
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero routing biases and load counts, on the parameters' device (after ``to_empty`` or
        ``fully_shard`` of a meta-built model; a checkpoint's biases are loaded afterwards)."""
        device = self.router.gate.weight.device
        self.expert_bias = torch.zeros(self.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device)
        self.dropped = torch.zeros((), device=device)

    @eager_under_compile  # data-dependent shapes (each expert's rows); a compiled block runs it eagerly
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, dim]`` -> ``[B, S, dim]``."""
        B, S, D = x.shape
        tokens = x.reshape(-1, D)
        weights, experts, scores = self.router(tokens, self.expert_bias)
        flat = experts.flatten()
        counts = torch.bincount(flat, minlength=self.num_experts)
        recomputing = torch._C._current_graph_task_id() != -1  # activation checkpointing's second forward
        if not recomputing:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        order = flat.argsort(stable=True)  # the (token, expert) pairs, grouped by expert, in token order
        if self.capacity_factor is not None:
            order, counts = self._within_capacity(order, counts, tokens.shape[0], recomputing)
        token_of = order // self.top_k
        routed = self.experts(tokens[token_of], counts)
        routed = routed * weights.flatten()[order, None]
        out = torch.zeros_like(tokens).index_add_(0, token_of, routed.to(tokens.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(B, S, D)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = self._aux_loss(scores, experts, B, S)
            if not recomputing:
                self.aux_loss_sum, self.aux_loss_count = self.aux_loss_sum + aux.detach(), self.aux_loss_count + 1
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out

    def _within_capacity(
        self, order: torch.Tensor, counts: torch.Tensor, n_tokens: int, recomputing: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sorted pairs each expert takes: at most ``ceil(capacity_factor * T * top_k / E)``,
        the earliest tokens first (Switch Transformer's rule); the rest are dropped (the token
        keeps its other experts, and the residual) and counted in ``dropped``."""
        capacity = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.num_experts)
        starts = counts.cumsum(0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(counts)
        kept = position < capacity
        if not recomputing:
            with torch.no_grad():
                self.dropped += (~kept).sum().to(self.dropped.dtype)
        return order[kept], counts.clamp(max=capacity)

    def _aux_loss(self, scores: torch.Tensor, experts: torch.Tensor, B: int, S: int) -> torch.Tensor:
        """``coef * E * sum_e f_e * P_e`` (module doc), over the micro-batch or over each sequence."""
        E, k = self.num_experts, self.top_k
        groups = B if self.aux_loss_kind == "sequence" else 1
        if self.router.score_func == "sigmoid":  # DeepSeek-V3 normalises the scores per token first
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(scores).scatter_(1, experts, 1.0)  # [T, E]: 1 where routed
        f = chosen.view(groups, -1, E).mean(1) / k  # fraction of the pairs, per group
        p = scores.view(groups, -1, E).mean(1)
        return self.aux_loss_coef * E * (f * p).sum(-1).mean()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every ``MoE`` of ``model`` by its block key (``"3"`` for ``layers.3.feed_forward``), or by module name."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            parts = name.split(".")
            found[parts[1] if parts[0] == "layers" and len(parts) > 1 else name] = module
    return found


@torch.no_grad()
def expert_loads(layers: dict[str, MoE], reduce=None) -> dict[str, list[float]]:
    """Tokens each expert received per layer since the last call (then zeroed), summed over the
    ranks ``reduce(tensor)`` sums over in place (None: this rank's only)."""
    if not layers:
        return {}
    names = list(layers)
    counts = torch.stack([layers[n].tokens_per_expert for n in names])
    if reduce is not None:
        reduce(counts)
    for n in names:
        layers[n].tokens_per_expert.zero_()
    return {n: row.tolist() for n, row in zip(names, counts, strict=True)}


def mean_aux_loss(layers: dict[str, MoE]) -> float | None:
    """The auxiliary loss of the forwards since the last call, summed over ``layers`` (each
    layer's mean over its forwards; then zeroed); None when no layer has one."""
    total, any_loss = 0.0, False
    for layer in layers.values():
        if layer.aux_loss_count:
            total += float(layer.aux_loss_sum) / layer.aux_loss_count
            any_loss = True
        layer.aux_loss_sum, layer.aux_loss_count = 0.0, 0
    return total if any_loss else None


@torch.no_grad()
def dropped_pairs(layers: dict[str, MoE], reduce=None) -> float | None:
    """(token, expert) pairs past their expert's capacity since the last call, over ``layers``
    (then zeroed) and the ranks ``reduce`` sums over; None when no layer has a capacity."""
    capped = [layer for layer in layers.values() if layer.capacity_factor is not None]
    if not capped:
        return None
    total = torch.stack([layer.dropped for layer in capped]).sum().reshape(1)
    if reduce is not None:
        reduce(total)
    for layer in capped:
        layer.dropped.zero_()
    return float(total)


@torch.no_grad()
def update_expert_biases(layers: dict[str, MoE], loads: dict[str, list[float]], rate: float) -> None:
    """DeepSeek-V3's aux-loss-free balancing: each layer's ``expert_bias`` += ``rate`` *
    sign(mean load - expert's load): an overloaded expert is chosen less next step."""
    for name, layer in layers.items():
        load = torch.tensor(loads[name], device=layer.expert_bias.device)
        layer.expert_bias += rate * torch.sign(load.mean() - load)


# ---- post-optimizer upkeep: after each optimizer step, the step's loads, the biases, the metrics ----
class PostOptimizerHook:
    """Runs after each optimizer step (the trainer calls it); returns metrics for the step's record."""

    def __call__(self) -> dict:
        raise NotImplementedError


class MoEUpkeep(PostOptimizerHook):
    """``expert_load`` (layer -> tokens per expert, summed over the ranks that saw other tokens),
    ``expert_imbalance`` (the largest max / mean load of a layer), ``moe_aux_loss`` (this rank's)
    and ``moe_dropped`` (with a capacity factor: the (token, expert) pairs dropped, over all layers
    and data ranks). Under pipeline parallelism every stage's layers, gathered over the pp ranks
    (a stage of dense blocks contributes none)."""

    def __init__(self, layers: dict, dims, bias_update_rate: float):
        self.layers, self.dims, self.bias_update_rate = layers, dims, bias_update_rate

    def _sum_over_token_ranks(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the ranks that see other tokens (data-parallel and context-
        parallel; tensor-parallel ranks see the same ones)."""
        if dist.get_world_size() == 1:
            return
        for name in self.dims.fsdp_dim_names:
            dist.all_reduce(t, group=self.dims.world_mesh[name].get_group())

    def __call__(self) -> dict:
        loads = expert_loads(self.layers, reduce=self._sum_over_token_ranks)
        if self.bias_update_rate:
            update_expert_biases(self.layers, loads, self.bias_update_rate)
        aux = mean_aux_loss(self.layers)
        dropped = dropped_pairs(self.layers, reduce=self._sum_over_token_ranks)
        if self.dims.pp > 1:
            stages = [None] * self.dims.pp
            dist.all_gather_object(stages, (loads, aux, dropped), group=self.dims.pp_mesh.get_group())
            loads = dict(sorted(((k, v) for stage in stages for k, v in stage[0].items()), key=lambda kv: int(kv[0])))
            auxes, drops = [s[1] for s in stages if s[1] is not None], [s[2] for s in stages if s[2] is not None]
            aux, dropped = (sum(auxes) if auxes else None), (sum(drops) if drops else None)
        record = {"expert_load": loads}
        if loads:
            record["expert_imbalance"] = max(max(row) / max(sum(row) / len(row), 1e-9) for row in loads.values())
        if aux is not None:
            record["moe_aux_loss"] = aux
        if dropped is not None:
            record["moe_dropped"] = dropped
        return record


def moe_post_optimizer_hooks(
    model: nn.Module, model_parts: list[nn.Module], dims, *, microbatches: int, bias_update_rate: float
) -> list[PostOptimizerHook]:
    """The MoE families' post-optimizer hooks (their ``ModelSpec``'s): ``MoEUpkeep`` where the
    model has MoE layers. ``model``: the whole (meta) model, which says whether any stage has them
    (every pp rank joins the gather); ``model_parts``: this rank's; ``dims``: the job's
    ``ParallelDims``; ``microbatches``: how many micro-batch backwards a step's aux loss gradient
    is spread over (1 in a pipeline, which divides its own)."""
    layers = {k: v for part in model_parts for k, v in moe_layers(part).items()}
    for layer in layers.values():
        layer.aux_loss_scale = 1.0 / microbatches
    if not layers and not moe_layers(model):
        return []
    return [MoEUpkeep(layers, dims, bias_update_rate)]
