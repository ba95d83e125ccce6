"""Small models and a single-process reference trainer for fully_shard tests."""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MLP(nn.Module):
    """Uneven on purpose: 7, 9 and 3 do not divide by 2 or 4."""

    def __init__(self, dim: int = 7, hidden: int = 9, out: int = 3, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batch(step: int, world: int, per_rank: int = 4, dim: int = 7, out: int = 3):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(per_rank * world, dim, generator=g), torch.randn(per_rank * world, out, generator=g)


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def global_mean(value: torch.Tensor) -> float:
    t = value.detach().clone().reshape(1).double()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def reference_run(model: nn.Module, steps: int, world: int, lr: float = 0.01, dtype: torch.dtype = torch.float32):
    """Single process on the concatenated global batch: the result every configuration must match."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = batch(step, world)
        loss = nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def sharded_run(model, steps, grad_accum=1, clip=None, dtype: torch.dtype = torch.float32, opt=None):
    """The same training as ``reference_run``, each rank on its slice of the global batch; returns
    the global mean loss per step. ``opt``: the optimizer to step (default a fresh AdamW as the
    reference's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = batch(step, world)
        x, y = local_slice(x, rank, world).to(dtype), local_slice(y, rank, world).to(dtype)
        total = 0.0
        for micro in range(grad_accum):
            last = micro == grad_accum - 1
            if grad_accum > 1:
                model.set_requires_gradient_sync(last)
            xm, ym = local_slice(x, micro, grad_accum), local_slice(y, micro, grad_accum)
            loss = nn.functional.mse_loss(model(xm), ym) / grad_accum
            loss.backward()
            total += global_mean(loss)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses
