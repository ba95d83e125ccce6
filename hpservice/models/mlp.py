"""A residual MLP language model for benchmarks: no attention, only matmuls.

    tokens [B, S] -> embedding -> n_layers x Block -> RMSNorm -> head -> logits [B, S, vocab]

    Block (pre-norm residual):  x + w2(gelu(w1(norm(x))))

Each position is processed independently (the model predicts the next token from the current one),
which is all a throughput benchmark needs and still gives a falling loss on patterned data.

It follows the same contract as ``hpservice.models.llama``: ``MLPModel(cfg)`` builds and
initialises; ``init_weights()`` re-initialises every parameter in place with ``torch.nn.init.*``
(so it works on the meta device after ``to_empty`` and on sharded DTensor parameters); the blocks
are ``model.layers`` (an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...), the unit to wrap with
``fully_shard``; ``keep_stage`` trims it to one pipeline stage, as Llama's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._spec import ModelSpec
from .llama import RMSNorm, keep_blocks


@dataclass
class MLPConfig:
    """Shape of an MLP model. The defaults are the ``"tiny"`` flavor."""

    dim: int = 64
    """Width of the residual stream."""
    hidden: int = 256
    """Hidden width inside each block."""
    n_layers: int = 2
    """Number of residual blocks."""
    vocab_size: int = 256
    """Number of token ids (256: byte-level)."""

    def __post_init__(self) -> None:
        for name in ("dim", "hidden", "n_layers", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MLPConfig.{name} must be a positive int, got {value!r}")


MLP_FLAVORS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(),
    "small": MLPConfig(dim=256, hidden=1024, n_layers=4, vocab_size=256),
}


class MLPBlock(nn.Module):
    """x + w2(gelu(w1(norm(x))))."""

    def __init__(self, layer_id: int, cfg: MLPConfig):
        super().__init__()
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # residual output: smaller the deeper
        self.norm = RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.normal_(self.w2.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class MLPModel(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MLPBlock(i, cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.init_weights()

    def blocks(self) -> list[nn.Module]:
        """The residual blocks (``self.layers``' values), the unit the trainer shards / checkpoints."""
        return list(self.layers.values())

    def keep_stage(self, layers: list[str], *, first: bool, last: bool) -> None:
        """Trim this model, in place, to one pipeline stage (see ``Llama.keep_stage``)."""
        keep_blocks(self.layers, layers)
        if not first:
            self.embedding = None
        if not last:
            self.norm = self.head = None

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter in place (``torch.nn.init.normal_`` / ``ones_`` on whole
        parameters only; no ``trunc_normal_``, whose rejection loop sharded DTensors do not support)."""
        if self.embedding is not None:
            nn.init.normal_(self.embedding.weight, std=1.0)
        for layer in self.layers.values():
            layer.reset_parameters()
        if self.head is not None:
            self.norm.reset_parameters()
            nn.init.normal_(self.head.weight, std=self.cfg.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: LongTensor [B, S] -> logits [B, S, vocab_size] (a pipeline stage: hidden states
        in without the embedding, out without the head)."""
        h = self.embedding(tokens) if self.embedding is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


def flops_per_token(cfg: MLPConfig, seq_len: int | None = None, *, attention: bool = True) -> int:
    """Training FLOPs per token: 6 * N with N the matmul parameters (blocks + head; the embedding
    is a lookup). No attention, so ``seq_len`` does not matter; it is accepted for symmetry with
    ``llama.flops_per_token`` (as is ``attention``)."""
    return 6 * (cfg.n_layers * 2 * cfg.dim * cfg.hidden + cfg.dim * cfg.vocab_size)


MODEL_SPEC = ModelSpec(
    name="mlp",
    model_cls=MLPModel,
    config_cls=MLPConfig,
    flavors=MLP_FLAVORS,
    description="a residual MLP on token embeddings, for benchmarks (no attention, no tensor-parallel plan)",
    flops_per_token=flops_per_token,
    pipeline_stage=MLPModel.keep_stage,
)
