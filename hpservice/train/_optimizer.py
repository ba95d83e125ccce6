"""The optimizer, its parameter groups and the learning-rate schedule; which parameters train.

``parameter_groups`` decides what each optimizer sees: today one group of every parameter that
requires gradients (``training.freeze`` and, later, converters such as LoRA turn the others off
before this runs). A second optimizer for some parameters (Muon for matrices, AdamW for the
rest) or per-group settings are a change to that function and to ``build_optimizer``'s table.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable

import torch
import torch.nn as nn

from hpservice.spec import JobSpec

from ._errors import TrainingError

__all__ = ["build_lr_scheduler", "build_optimizer", "freeze", "lr_lambda", "parameter_groups"]

_FREEZE_ALIASES = {"embeddings": ("tok_embeddings.*",), "output": ("output.*",), "norm": ("norm.*",)}


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """``requires_grad_(False)`` on the parameters ``patterns`` name (fine-tuning part of a model);
    returns their names. A pattern that matches nothing is an error naming it (a typo must not
    train what was meant to stay fixed)."""
    names = [n for n, _ in model.named_parameters()]
    frozen: set[str] = set()
    for pattern in patterns:
        blocks = re.fullmatch(r"layers\.(\d+)(?:-(\d+))?", pattern)
        if blocks:
            lo, hi = int(blocks[1]), int(blocks[2] or blocks[1])
            globs = tuple(f"layers.{i}.*" for i in range(lo, hi + 1))
        else:
            globs = _FREEZE_ALIASES.get(pattern, (pattern,))
        matched = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)]
        if not matched or (blocks and len({n.split(".")[1] for n in matched}) != hi - lo + 1):
            raise TrainingError(
                f"training.freeze: {pattern!r} matches no parameter (or not every block it names); parameter names "
                f"look like {', '.join(names[:3])}, ..."
            )
        frozen.update(matched)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return sorted(frozen)


def parameter_groups(parts: list[nn.Module]) -> list[dict]:
    """The optimizer's groups over the model's parts: the trainable parameters, in the model's
    order (frozen ones get no optimizer state)."""
    return [{"params": [p for part in parts for p in part.parameters() if p.requires_grad]}]


def build_optimizer(model: nn.Module | list[nn.Module], spec: JobSpec) -> torch.optim.Optimizer:
    """``optimizer.name`` over ``parameter_groups`` of the model (or all its parts)."""
    o = spec.optimizer
    groups = parameter_groups(model if isinstance(model, list) else [model])
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def lr_lambda(spec: JobSpec) -> Callable[[int], float]:
    """Multiplier of optimizer.lr at a step: linear warm-up, then cosine/linear decay or constant."""
    s, steps = spec.lr_scheduler, spec.training.steps

    def factor(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.decay == "constant":
            return 1.0
        progress = min(1.0, (step - s.warmup_steps) / max(1, steps - s.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if s.decay == "cosine" else 1 - progress
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape

    return factor


def build_lr_scheduler(optimizer: torch.optim.Optimizer, spec: JobSpec) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
