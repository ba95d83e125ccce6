"""What one worker of a job must hold at the least, computed from the spec and the model's config.

A job whose sizes a tenant chooses (``hidden_size: 1e6``, ``num_hidden_layers: 1e5``,
``num_experts: 1e6``, ``max_position_embeddings: 1e9``, ``seq_len: 1e9``) must be refused before a
worker allocates anything, not after it has taken gigabytes. Everything here is arithmetic on the
config (nothing is built), and every number is a floor: the job needs at least this much, so
refusing a job whose floor exceeds what a worker may hold never refuses one that would fit.

Per worker, for its most loaded rank:

- parameters, gradients and optimizer state: the parameter count (``param_count``: every matrix
  of the blocks, the experts, the embedding and an untied head) x 4 bytes of fp32 weights, plus 4 of
  gradients and the optimizer's 8 (AdamW) or 4 (SGD with momentum) when nothing is frozen, divided
  by the most ranks any parameter can be split over (``world / dp_replicate``);
- the rotary table: ``max_seq_len x head_dim x 4`` bytes on every rank (not sharded);
- the micro-batch's token ids (inputs and targets, int64) and its logits (vocabulary / tp, 2 bytes
  under mixed precision, else 4);
- each block's input kept for the backward (what even full activation checkpointing keeps):
  tokens x dim x 2 bytes for the blocks of one pipeline stage.

Gathered parameters, communication buffers, attention's own activations and allocator slack
come on top; the memory planner issue estimates those. ``largest_tensor`` is the biggest single
allocation the model makes, for the operator's cap on one tensor.
"""

from __future__ import annotations

import math

from hpservice.models import LlamaConfig, MLPConfig
from hpservice.parallel_dims import ParallelDims

__all__ = ["MAX_TENSOR_ELEMENTS", "largest_tensor", "memory_floor", "micro_rows", "param_count", "token_floor"]

MAX_TENSOR_ELEMENTS = 1 << 33
"""The default cap on one tensor (8.6e9 elements, 32 GiB in fp32): DeepSeek-V3's stacked experts of
a layer are 3.8e9, Llama 3 405B's embedding 2.1e9."""


def param_count(cfg) -> int:
    """Parameters of a built-in model of config ``cfg``, from the config alone: every matrix (the
    norms' vectors and biases are left out, so this is a floor within a fraction of a percent)."""
    if isinstance(cfg, MLPConfig):
        return cfg.n_layers * 2 * cfg.dim * cfg.hidden + 2 * cfg.vocab_size * cfg.dim
    sparse = cfg.sparse_layers() if hasattr(cfg, "sparse_layers") else 0
    dense_ffn = 3 * cfg.dim * cfg.ffn_hidden_dim
    sparse_ffn = 0
    if sparse:
        experts = cfg.num_experts + getattr(cfg, "n_shared_experts", 0)
        sparse_ffn = experts * 3 * cfg.dim * cfg.moe_hidden_dim + cfg.dim * cfg.num_experts  # and the router
    head = 1 if cfg.tie_embeddings else 2
    return (
        cfg.n_layers * cfg.attention_matmul_params()
        + (cfg.n_layers - sparse) * dense_ffn
        + sparse * sparse_ffn
        + head * cfg.vocab_size * cfg.dim
    )


def largest_tensor(cfg) -> tuple[str, int]:
    """(what, elements) of the biggest single tensor a model of config ``cfg`` allocates."""
    if isinstance(cfg, MLPConfig):
        candidates = {"the embedding (vocab_size x dim)": cfg.vocab_size * cfg.dim, "a block's matrix": cfg.dim * cfg.hidden}
    else:
        candidates = {
            "the embedding (vocab_size x dim)": cfg.vocab_size * cfg.dim,
            "a feed-forward matrix (dim x hidden_dim)": cfg.dim * cfg.ffn_hidden_dim,
            "the query projection (dim x heads x head_dim)": cfg.dim * cfg.n_heads * cfg.head_dim,
            "the rotary table (max_seq_len x head_dim)": cfg.max_seq_len * cfg.head_dim,
        }
        if hasattr(cfg, "num_experts"):
            candidates["a layer's experts (num_experts x dim x moe_hidden_dim)"] = cfg.num_experts * cfg.dim * cfg.moe_hidden_dim
    return max(candidates.items(), key=lambda kv: kv[1])


def micro_rows(spec) -> int:
    """Rows (sequences) of one rank's micro-batch; a preference pair (DPO) is two."""
    p = spec.parallelism
    dims = ParallelDims.from_spec(p, spec.resources.workers)
    micro = p.microbatches(spec.training.grad_accum) if p.pp > 1 else spec.training.grad_accum
    rows = max(1, spec.data.global_batch // (dims.dp_size * micro))
    return 2 * rows if spec.objective.kind == "dpo" else rows


def _micro_tokens(spec) -> tuple[ParallelDims, int]:
    """The parallel dims, and the tokens of one rank's micro-batch."""
    p = spec.parallelism
    dims = ParallelDims.from_spec(p, spec.resources.workers)
    return dims, micro_rows(spec) * math.ceil(spec.data.seq_len / p.cp)


def token_floor(spec, vocab_size: int | None) -> dict[str, int]:
    """The micro-batch's token ids and logits (what any model, a factory's too, holds)."""
    _, tokens = _micro_tokens(spec)
    floor = {"the micro-batch's token ids (inputs and targets, int64)": tokens * 16}
    if vocab_size is not None:
        width = 2 if spec.parallelism.mixed_precision != "none" else 4
        floor["the micro-batch's logits"] = tokens * math.ceil(vocab_size / spec.parallelism.tp) * width
    return floor


def memory_floor(spec, cfg) -> dict[str, int]:
    """Bytes a worker of ``spec`` holds at the least, by component (see the module doc); ``cfg``
    is the built-in model's config, None for a factory (tokens only)."""
    if cfg is None:
        return token_floor(spec, spec.data.vocab_size)
    dims, tokens = _micro_tokens(spec)
    p = spec.parallelism
    shards = max(1, dims.world_size // p.dp_replicate)
    per_param = 4
    if not spec.training.freeze:
        per_param += 4 + {"adamw": 8, "sgd": 4 if spec.optimizer.momentum else 0}[spec.optimizer.name]
    floor = {"parameters, gradients and optimizer state": math.ceil(param_count(cfg) * per_param / shards)}
    if isinstance(cfg, LlamaConfig):
        floor["the rotary table"] = cfg.max_seq_len * cfg.head_dim * 4
    floor.update(token_floor(spec, spec.data.vocab_size or cfg.vocab_size))
    stage_blocks = math.ceil(cfg.n_layers / (p.pp * p.pp_virtual_stages)) * p.pp_virtual_stages
    seq_shards = p.tp if p.sequence_parallel else 1
    floor["each block's input, kept for the backward"] = stage_blocks * math.ceil(tokens / seq_shards) * cfg.dim * 2
    return floor
