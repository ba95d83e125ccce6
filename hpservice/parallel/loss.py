"""Vocab-parallel cross-entropy: the loss of logits sharded on the vocabulary dim, computed from the
local logits with three all-reduces of ``[N]`` vectors (max, sum of exponentials, target logit);
the logits are never gathered. The backward is ``softmax - one_hot`` on the local vocabulary slice.

``loss_parallel()`` is torch's context manager of that name: inside it, ``F.cross_entropy`` (and
``nn.CrossEntropyLoss``) of logits sharded on the class dim computes this loss and returns it as a
``Replicate`` DTensor, as torch's does. The cases it does not cover yet (a class weight, label
smoothing, class probabilities as targets, logits also sharded on another dim) raise naming the
argument, where torch's would compute them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..dtensor import DTensor, Replicate

__all__ = ["loss_parallel", "vocab_parallel_cross_entropy"]


@contextlib.contextmanager
def loss_parallel():
    """``F.cross_entropy(logits, target)`` of ``logits`` sharded on the class dim (dim 1, or 0 for
    1-D input) on one mesh dim and replicated on the others: the vocab-parallel loss, without
    gathering the logits; a ``Replicate`` DTensor. ``target``: class indices, a plain tensor (or a
    replicated DTensor) equal on every rank. Outside a DTensor input, ``cross_entropy`` is torch's."""
    with _LossParallel():
        yield


class _LossParallel(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and isinstance(args[0] if args else kwargs.get("input"), DTensor):
            return _parallel_cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


def _parallel_cross_entropy(
    input: DTensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average=None,
    ignore_index: int = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> DTensor:
    unsupported = {
        "weight": weight is not None,
        "label_smoothing": label_smoothing != 0.0,
        "size_average / reduce (deprecated; use reduction)": size_average is not None or reduce is not None,
        "class probabilities as target (a floating target)": torch.is_floating_point(target),
    }
    for name, given in unsupported.items():
        if given:
            raise NotImplementedError(f"hpservice loss_parallel(): cross_entropy with {name} is not supported yet")
    class_dim = 1 if input.ndim >= 2 else 0
    shards = [i for i, p in enumerate(input.placements) if p.is_shard() and p.dim == class_dim]
    others = [p for i, p in enumerate(input.placements) if i not in shards and not p.is_replicate()]
    if len(shards) != 1 or others:
        raise NotImplementedError(
            f"hpservice loss_parallel(): the logits must be sharded on the class dim ({class_dim}) on exactly one mesh "
            f"dim and replicated on the others, got {tuple(input.placements)}"
        )
    logits = input.movedim(class_dim, -1) if input.ndim > 2 else input
    loss = vocab_parallel_cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    mesh = input.device_mesh
    return DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim, shape=loss.shape, stride=loss.stride())


def vocab_parallel_cross_entropy(
    logits: DTensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """``F.cross_entropy(logits.full_tensor().flatten(0, -2), target.flatten(), ...)`` without the gather.

    ``logits``: a DTensor ``[..., V]`` sharded on its last dim (``Shard(-1)``) on some mesh dims and
    replicated on the others (uneven ``torch.chunk`` vocab pieces are fine); ``target``: a plain
    LongTensor ``[...]`` with the same value on every rank. Returns a plain tensor (a scalar for
    ``reduction="mean"``/``"sum"``, ``target``'s shape for ``"none"``), the same on every rank.
    """
    if not isinstance(logits, DTensor):
        raise TypeError(f"vocab_parallel_cross_entropy: logits must be a DTensor, got {type(logits).__name__}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: unknown reduction {reduction!r}")
    if isinstance(target, DTensor):
        if not target._spec.is_replicated():
            raise ValueError("vocab_parallel_cross_entropy: target must be replicated")
        target = target.to_local()
    last = logits.ndim - 1
    for p in logits.placements:
        if not (p.is_replicate() or (p.is_shard() and p.dim == last)):
            raise ValueError(
                f"vocab_parallel_cross_entropy: logits must be Shard(-1) or Replicate on every mesh dim, "
                f"got {logits.placements}"
            )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} != logits shape[:-1] "
            f"{tuple(logits.shape[:-1])}"
        )
    bad = (target != ignore_index) & ((target < 0) | (target >= logits.shape[-1]))
    if bool(bad.any()):
        raise IndexError(f"vocab_parallel_cross_entropy: target {int(target[bad][0])} is out of bounds")
    return _VocabParallelCE.apply(logits, target, ignore_index, reduction)


def _groups(logits: DTensor) -> list:
    mesh = logits._spec.mesh
    last = logits.ndim - 1
    return [mesh.get_group(i) for i, p in enumerate(logits.placements) if p.is_shard() and p.dim == last]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: DTensor, target: torch.Tensor, ignore_index: int, reduction: str):
        # a plain tensor is one rank's piece computed alone (no collective): the memory estimate
        # runs this on fake tensors to count what the loss allocates (hpservice/memory)
        spec = logits._spec if isinstance(logits, DTensor) else None
        groups = _groups(logits) if spec is not None else []
        local = logits._wait_local() if spec is not None else logits
        vocab = local.shape[-1]
        lo = spec.local_offset[-1] if spec is not None else 0
        t = target.reshape(-1).to(local.device)
        n = t.numel()
        x = local.reshape(n, vocab).float()
        valid = t != ignore_index
        if vocab:
            row_max = x.max(dim=-1).values
        else:  # an empty vocabulary chunk
            row_max = x.new_full((n,), float("-inf"))
        for g in groups:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=g)
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_t = t - lo
        mine = valid & (local_t >= 0) & (local_t < vocab)
        safe_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        if vocab:
            picked = shifted.gather(1, safe_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        else:
            picked = x.new_zeros((n,))
        stats = torch.stack([sum_exp, picked])  # one all-reduce for both sums
        for g in groups:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=g)
        sum_exp, picked = stats[0], stats[1]
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), safe_t, mine, valid, count)
        ctx.spec, ctx.dtype, ctx.reduction, ctx.shape = spec, local.dtype, reduction, tuple(target.shape)
        ctx.local_shape = tuple(local.shape)
        if reduction == "mean":
            out = loss.sum() / count
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.reshape(target.shape)
        return out.to(local.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        softmax, safe_t, mine, valid, count = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[-1]:  # minus one at each row's own target (adding -0.0 elsewhere): no host sync
            grad.scatter_add_(1, safe_t.unsqueeze(-1), mine.to(grad.dtype).neg().unsqueeze(-1))
        grad.masked_fill_(~valid.unsqueeze(-1), 0.0)
        if ctx.reduction == "mean":
            grad.mul_(grad_out.float() / count)
        elif ctx.reduction == "sum":
            grad.mul_(grad_out.float())
        else:
            grad.mul_(grad_out.float().reshape(-1, 1))
        if ctx.spec is None:
            return grad.to(ctx.dtype).reshape(ctx.local_shape), None, None, None
        local = grad.to(ctx.dtype).reshape(ctx.spec.local_shape)
        return DTensor(local, ctx.spec, requires_grad=False), None, None, None
