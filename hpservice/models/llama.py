"""A Llama-style decoder-only transformer, written to be read top to bottom.

    tokens [B, S] -> tok_embeddings -> n_layers x TransformerBlock -> RMSNorm -> output -> logits [B, S, vocab]

    TransformerBlock (pre-norm residual):
        h   = x + Attention(RMSNorm(x))        # grouped-query causal self-attention with rotary positions
        out = h + FeedForward(RMSNorm(h))      # SwiGLU MLP

The same shapes as Meta's Llama 3 (``LLAMA_FLAVORS["1B"]`` / ``["8B"]``), in the style of nanoGPT /
torchtitan; Llama 3.1's long-context rope scaling included. Generation's key/value cache is
``generate.py``'s. The Qwen2, Qwen3 and Mistral families are this decoder with the variants at the
end of ``LlamaConfig`` (their files hold their flavors); Qwen3-MoE and DeepSeek-V3 replace its
feed-forward (and DeepSeek its attention) through ``Llama.build_block``.

Initialisation contract (what the trainer relies on):

- ``Llama(cfg)`` builds *and* initialises, so a normal build is ready to train.
- ``Llama.init_weights()`` (re)initialises every parameter **in place** with ``torch.nn.init.*``
  (``normal_``, ``ones_``) and never takes views or reshapes of a parameter, so
  it works when the parameters are sharded DTensors (after ``fully_shard``). It also recomputes
  the rotary buffer on the parameters' device. That allows building on the meta device::

      with torch.device("meta"):
          model = Llama(cfg)               # no memory, no compute

      # single device:
      model.to_empty(device="cuda")        # allocate (uninitialised; breaks a tie, init_weights re-ties)
      model.init_weights()                 # fill params, recompute the rotary buffer

      # hpservice.fsdp: fully_shard allocates each rank's (zero) shards on the mesh device itself,
      # so no to_empty; init_weights then fills the DTensor shards (sharding-independent values).
      for block in model.layers.values():
          fully_shard(block, mesh=mesh)
      fully_shard(model, mesh=mesh)
      model.init_weights()

- The transformer blocks are ``model.layers``, an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...
  (torchtitan's choice): the parameter names are those of a list (``layers.3.attention.wq.weight``),
  and a pipeline stage that drops blocks (``keep_stage``) keeps the others' names. Wrap each with
  ``fully_shard`` (or activation checkpointing), then the root.
- Pipeline stages: ``keep_stage(layers, first=, last=)`` trims a (meta) model in place to the
  blocks ``layers`` and, on the first stage, the embedding, on the last the final norm and head;
  ``forward`` then takes what the previous stage returned and returns the hidden states (not the
  logits) unless it is the last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ._spec import HFNames, ModelSpec
from .attention import scaled_dot_product_attention


@dataclass
class LlamaConfig:
    """Shape of a Llama model. The defaults are the ``"tiny"`` flavor."""

    dim: int = 64
    """Width of the residual stream (model dimension)."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads; head_dim = dim // n_heads (must be even for rotary embeddings)."""
    n_kv_heads: int = 2
    """Number of key/value heads (grouped-query attention); must divide n_heads. Equal to n_heads: plain multi-head."""
    vocab_size: int = 256
    """Number of token ids (256: byte-level)."""
    multiple_of: int = 16
    """The SwiGLU hidden size is rounded up to a multiple of this (hardware-friendly shapes)."""
    ffn_dim_multiplier: float | None = None
    """Optional scale of the SwiGLU hidden size before rounding (Llama 3: 1.5 for 1B, 1.3 for 8B)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies (Llama 3: 500000)."""
    max_seq_len: int = 128
    """Longest sequence the model accepts (length of the precomputed rotary table)."""
    tie_embeddings: bool = False
    """Share one weight between the token embedding and the output head."""
    hidden_dim: int | None = None
    """The SwiGLU hidden size itself (Hugging Face's ``intermediate_size``); None: derived from
    dim, ffn_dim_multiplier and multiple_of as in Meta's reference."""
    rope_scaling: dict | None = None
    """Long-context frequency scaling: Llama 3.1's ``{"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``, or YaRN's
    ``{"rope_type": "yarn", "factor", "original_max_position_embeddings"}`` (plus its optional
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``,
    ``truncate``: Qwen3's and DeepSeek-V3's long-context configs); None: plain."""
    # The variants of the same decoder that other families use (``qwen2.py``, ``qwen3.py``,
    # ``mistral.py``); a Llama leaves them at their defaults.
    attn_head_dim: int | None = None
    """Width of one attention head when it is not dim // n_heads (Hugging Face's ``head_dim``: Qwen3, Mistral)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    qk_norm: bool = False
    """An RMSNorm over each head of the queries and keys, before the rotary embedding (Qwen3)."""
    sliding_window: int | None = None
    """Each token attends to itself and the sliding_window - 1 tokens before it (Mistral); None: all."""

    # Not a field: Hugging Face's query/key rows are in rotate_half order (``hf.py`` reorders them).
    hf_rotate_half: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.attn_head_dim is None and self.dim % self.n_heads != 0:
            raise ValueError(f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.attn_head_dim is not None and (
            not isinstance(self.attn_head_dim, int) or isinstance(self.attn_head_dim, bool) or self.attn_head_dim <= 0
        ):
            raise ValueError(f"LlamaConfig.attn_head_dim must be a positive int or None, got {self.attn_head_dim!r}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig: the head width ({self.head_dim}) must be even for rotary embeddings")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window <= 0
        ):
            raise ValueError(f"LlamaConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.hidden_dim is not None and (not isinstance(self.hidden_dim, int) or self.hidden_dim <= 0):
            raise ValueError(f"LlamaConfig.hidden_dim must be a positive int or None, got {self.hidden_dim!r}")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(f"LlamaConfig.ffn_dim_multiplier must be positive or None, got {self.ffn_dim_multiplier}")
        if self.norm_eps <= 0:
            raise ValueError(f"LlamaConfig.norm_eps must be positive, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be positive, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            keys = _ROPE_KEYS.get(kind)
            if keys is None or not keys <= set(self.rope_scaling):
                raise ValueError(
                    "LlamaConfig.rope_scaling: implemented are {'rope_type': 'llama3', "
                    f"{', '.join(sorted(_ROPE_KEYS['llama3']))}}} and {{'rope_type': 'yarn', "
                    f"{', '.join(sorted(_ROPE_KEYS['yarn']))}, optional beta_fast, beta_slow, mscale, mscale_all_dim, "
                    f"attention_factor, truncate}}; got {self.rope_scaling!r}"
                )

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: ``hidden_dim`` when set, else as in Meta's reference (2/3 of 4*dim,
        scaled, rounded up to multiple_of)."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def ffn_matmul_params(self, layer_id: int) -> int:
        """Matmul parameters block ``layer_id``'s feed-forward applies to each token (SwiGLU: 3 matrices)."""
        return 3 * self.dim * self.ffn_hidden_dim

    def attention_matmul_params(self) -> int:
        """Matmul parameters of one block's attention: wq, wo, and wk, wv."""
        hd = self.head_dim
        return self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2

    def attention_width(self) -> int:
        """Query/key (and value) width over all heads, for the attention FLOPs: n_heads x head_dim."""
        return self.n_heads * self.head_dim


_ROPE_KEYS = {
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings"},
}

LLAMA_FLAVORS: dict[str, LlamaConfig] = {
    # Runs in well under a second on a laptop CPU: for tests.
    "tiny": LlamaConfig(),
    # Still CPU-friendly; for examples and small benchmarks.
    "small": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, max_seq_len=512),
    # Llama 3.2 1B (about 1.24e9 parameters, tied embeddings).
    "1B": LlamaConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # Llama 3.1 8B (about 8.03e9 parameters). Meta's params.json uses multiple_of 1024; the result,
    # 14336, is the same with 256.
    "8B": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
        tie_embeddings=False,
    ),
}


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device=None, scaling: dict | None = None
) -> torch.Tensor:
    """Rotary table: ``[max_seq_len, head_dim // 2, 2]`` float32, last dim = (cos, sin).

    Channel pair i of position p is rotated by angle p * theta ** (-2i / head_dim); with Llama 3.1's
    ``scaling``, low frequencies (wavelengths past the original context) are divided by
    ``factor``, high ones kept, and the band between interpolated smoothly.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    magnitude = 1.0
    if scaling is not None and scaling["rope_type"] == "yarn":
        freqs, magnitude = _yarn_scaled(freqs, head_dim, theta, scaling)
    elif scaling is not None:
        freqs = _llama3_scaled(freqs, scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)  # [max_seq_len, head_dim // 2]
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    return table * magnitude if magnitude != 1.0 else table


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaled(freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): the high frequencies (dims that turn more than ``beta_fast`` times
    over the original context) kept, the low ones (fewer than ``beta_slow``) divided by ``factor``,
    a linear ramp between; and the rotation's magnitude, which scales q.k (``attention_factor``,
    by default ``yarn_mscale`` of the factor, or the ratio of ``mscale`` to ``mscale_all_dim``'s)."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    magnitude = scaling.get("attention_factor")
    if magnitude is None:
        magnitude = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim else yarn_mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns ``rotations`` times over the old context
        return head_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=freqs.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as it is), 0: interpolate (divided by the factor)
    return freqs / factor * (1 - keep) + freqs * keep, float(magnitude)


def _llama3_scaled(freqs: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > old_context / low, freqs / factor, freqs)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs (x0, x1) of ``x [B, S, H, head_dim]`` by the angles in
    ``rope [S, head_dim // 2, 2]``, or ``[B, S, head_dim // 2, 2]`` where each row has its own
    positions (packed sequences) (Meta's interleaved layout)."""
    x_pairs = x.float().unflatten(-1, (-1, 2))  # [B, S, H, head_dim // 2, 2]
    x0, x1 = x_pairs[..., 0], x_pairs[..., 1]
    cos = rope[..., None, :, 0]  # [(B,) S, 1, head_dim // 2]: broadcast over heads (and batch)
    sin = rope[..., None, :, 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def _init_linear(linear: nn.Linear, std: float) -> None:
    # Plain normal_, not trunc_normal_: recent torch implements trunc_normal_ by rejection sampling
    # with a data-dependent ``.any()`` loop, which sharded DTensor parameters do not support.
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class Attention(nn.Module):
    """Causal self-attention with grouped-query attention (n_kv_heads key/value heads shared by
    groups of n_heads // n_kv_heads query heads) and rotary positions on q and k; optionally
    q/k/v biases (``qkv_bias``), a per-head RMSNorm of q and k (``qk_norm``) and a sliding window."""

    def __init__(self, cfg: LlamaConfig, init_std: float = 0.02):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.init_std = init_std  # std of the output projection (scaled down with depth)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # over each head's channels: the same weights for every head
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def reset_parameters(self) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _init_linear(linear, 0.02)
        _init_linear(self.wo, self.init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def qkv(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, and values, ``[B, H, S, head_dim]`` (keys/values with the
        n_kv_heads heads); ``rope`` holds the angles of x's positions."""
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # [B, S, H, D] -> [B, H, S, D], the layout scaled_dot_product_attention expects.
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def expand_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Grouped-query attention: each key/value head serves n_heads // n_kv_heads query heads.
        # Repeating them explicitly works with every SDPA backend (flash, efficient, cuDNN, math).
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        return k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, H, S, head_dim]`` attention output -> ``[B, S, dim]``."""
        B, _, S, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x, rope)
        k, v = self.expand_kv(k, v)
        # F.scaled_dot_product_attention, or ring attention inside context_parallel (no mask is ever materialised)
        out = scaled_dot_product_attention(q, k, v, is_causal=True, window=self.sliding_window)
        return self.project_out(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int, init_std: float = 0.02):
        super().__init__()
        self.init_std = init_std  # std of w2 and w3 (scaled down with depth)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def reset_parameters(self) -> None:
        _init_linear(self.w1, 0.02)
        _init_linear(self.w2, self.init_std)
        _init_linear(self.w3, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, layer_id: int, cfg: LlamaConfig):
        super().__init__()
        # Residual-branch outputs get a smaller init the deeper the block (as in torchtitan).
        init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, init_std)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim, init_std)

    def reset_parameters(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


def keep_blocks(blocks: nn.ModuleDict, names: list[str]) -> None:
    """Delete every block of ``blocks`` not in ``names`` (a pipeline stage's, ``keep_stage``); the
    kept ones keep their keys, so their parameter names stay the whole model's."""
    unknown = sorted(set(names) - set(blocks.keys()))
    if unknown:
        raise ValueError(f"keep_stage: no blocks {unknown} (the model has {list(blocks.keys())})")
    for name in list(blocks.keys()):
        if name not in names:
            del blocks[name]


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i, cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, two uses
        # Not saved in state_dict (persistent=False): it is a function of the config.
        self.register_buffer(
            "rope_cache",
            precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling=cfg.rope_scaling),
            persistent=False,
        )
        self.init_weights()

    def build_block(self, layer_id: int, cfg: LlamaConfig) -> nn.Module:
        """Block ``layer_id`` (a family with other blocks, e.g. mixture-of-experts ones, overrides this)."""
        return TransformerBlock(layer_id, cfg)

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks (``self.layers``' values), the unit the trainer shards / checkpoints."""
        return list(self.layers.values())

    def keep_stage(self, layers: list[str], *, first: bool, last: bool) -> None:
        """Trim this model, in place, to one pipeline stage: the blocks named ``layers`` (keys of
        ``self.layers``), the embedding if ``first``, the final norm and head if ``last``. Names
        stay global (a checkpoint of the stages is a checkpoint of the model)."""
        if self.cfg.tie_embeddings and first != last:
            raise ValueError(
                "a Llama with tie_embeddings cannot be split into pipeline stages: the head and the embedding "
                "are one parameter, and they would live on different stages"
            )
        keep_blocks(self.layers, layers)
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = self.output = None

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the rotary table (and the submodules' buffers: ``init_buffers``) on the
        parameters' device (after ``to_empty`` / ``fully_shard`` of a meta-built model whose
        weights come from elsewhere, e.g. a Hugging Face checkpoint)."""
        device = next(self.parameters()).device
        self.rope_cache = precompute_rope(
            self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device, self.cfg.rope_scaling
        )
        for module in self.modules():  # e.g. a mixture of experts' routing biases
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter in place and recompute the rotary buffer on the parameters' device.

        Only ``torch.nn.init.*`` in-place calls on whole parameters, so sharded DTensor parameters work.
        """
        self.init_buffers()
        std_out = self.cfg.dim**-0.5  # keeps the initial logits at unit scale
        if self.tok_embeddings is None or self.output is None:  # a pipeline stage (never tied)
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight, std=1.0)
            if self.output is not None:
                nn.init.normal_(self.output.weight, std=std_out)
        elif self.cfg.tie_embeddings:
            if self.output.weight is not self.tok_embeddings.weight:
                # ``to_empty`` from the meta device gives each use its own Parameter: tie again.
                self.output.weight = self.tok_embeddings.weight
            # The shared weight gets the output head's scale: std 1.0 would make the logits sqrt(dim)
            # times too large. The blocks' RMSNorms make the small embedding scale harmless.
            nn.init.normal_(self.tok_embeddings.weight, std=std_out)
        else:
            nn.init.normal_(self.tok_embeddings.weight, std=1.0)
            nn.init.normal_(self.output.weight, std=std_out)
        for layer in self.layers.values():
            layer.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()

    def parallelize(self, tp_mesh, *, sequence_parallel: bool = False) -> None:
        """Tensor (and sequence) parallelism on the 1-d ``tp_mesh``, in place: this model's plan,
        ``hpservice.parallel.apply_llama_tp`` (torchtitan's ``parallelize_llama``). The trainer calls
        ``model.parallelize`` for ``parallelism.tp > 1``; a custom model brings its own."""
        parallelize_llama(self, tp_mesh, sequence_parallel)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: LongTensor [B, S] with S <= max_seq_len -> logits [B, S, vocab_size].
        ``positions`` ([S], default ``0..S-1``): the global position of each token, for a shard of a
        longer sequence (context parallelism: ``hpservice.parallel.context_parallel.positions``);
        or ``[B, S]``, each row's own (packed sequences restart them per document).
        A pipeline stage (``keep_stage``) without the embedding takes hidden states ``[B, S, dim]``
        instead of tokens; one without the head returns hidden states."""
        seq_len = tokens.shape[1]
        last = seq_len if positions is None else int(positions.max()) + 1
        if last > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {last} is longer than LlamaConfig.max_seq_len ({self.cfg.max_seq_len})"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cache[:seq_len] if positions is None else self.rope_cache[positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h)) if self.output is not None else h


# ----------------------------------------------------------------------------------------------
# Accounting for MFU
# ----------------------------------------------------------------------------------------------


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters (a shared/tied parameter counts once; works on the meta device and on
    DTensors, whose ``numel()`` is the global size). ``exclude_embedding`` leaves out
    ``tok_embeddings`` when it exists (but not a head tied to it)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and isinstance(getattr(model, "tok_embeddings", None), nn.Embedding):
        emb = model.tok_embeddings.weight
        if not any(
            p is emb for name, p in model.named_parameters(remove_duplicate=False) if "tok_embeddings" not in name
        ):
            total -= emb.numel()
    return total


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that take part in a matmul for every token: all Linear weights of the blocks plus
    the output head (counted even when tied to the embedding: the head matmul still runs). The
    embedding lookup is a gather and the norms are elementwise, so neither costs matmul FLOPs.
    A mixture-of-experts layer counts its router and the experts a token is routed to (the active
    parameters: ``cfg.ffn_matmul_params``)."""
    ffn = sum(cfg.ffn_matmul_params(i) for i in range(cfg.n_layers))
    return cfg.n_layers * cfg.attention_matmul_params() + ffn + cfg.dim * cfg.vocab_size


def flops_per_token(cfg: LlamaConfig, seq_len: int, *, attention: bool = True) -> int:
    """Training FLOPs per token (forward + backward), the standard estimate used for MFU
    (Kaplan et al. 2020; PaLM appendix B; nanoGPT, torchtitan)::

        6 * N  +  12 * n_layers * dim * seq_len

    - ``6 * N``: each of the N matmul parameters (``matmul_params``) does one multiply-add (2 FLOPs)
      per token in the forward pass and two in the backward pass (gradients for input and weight).
    - ``12 * n_layers * dim * seq_len``: attention scores (q @ k^T) and the weighted sum (p @ v),
      2 * 2 * dim * seq_len FLOPs (``n_heads * head_dim`` in place of dim where they differ) per token and layer forward, times 3 with the backward. This counts
      the full seq_len x seq_len score matrix even though causal attention needs about half.

    MFU = tokens_per_second * flops_per_token / peak_flops_per_second. ``attention=False`` leaves
    the attention term out (the ``6 * N`` convention some reports use, e.g. nanoGPT's ``6N`` MFU
    before its attention correction); both are reported in the step metrics.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    width = cfg.attention_width()  # dim for a Llama; Qwen3, Mistral and DeepSeek's MLA may differ
    return 6 * matmul_params(cfg) + (12 * cfg.n_layers * width * seq_len if attention else 0)


def parallelize_llama(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """The decoder families' tensor (and sequence) parallelism: ``hpservice.parallel.apply_llama_tp``
    (torchtitan's ``parallelize_llama``), in place on the 1-d ``tp_mesh``."""
    from hpservice.parallel import apply_llama_tp

    apply_llama_tp(model, tp_mesh, sequence_parallel=sequence_parallel)


MODEL_SPEC = ModelSpec(
    name="llama",
    model_cls=Llama,
    config_cls=LlamaConfig,
    flavors=LLAMA_FLAVORS,
    description="Llama 2/3 decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU",
    flops_per_token=flops_per_token,
    hf=HFNames("llama", "LlamaForCausalLM", config_keys=lambda cfg: {"attention_bias": False, "mlp_bias": False}),
    parallelize=parallelize_llama,
    pipeline_stage=Llama.keep_stage,
)
