"""fully_shard's finer APIs, the same recipe through torch's fully_shard, ours and one process.

- ``register_fsdp_forward_method``: a method other than ``forward`` gathers and reshards as
  ``forward`` does (and without it, both engines refuse to mix sharded parameters with a plain
  input);
- explicit prefetch (``set_modules_to_forward_prefetch`` / ``_backward_prefetch``), gradient
  accumulation with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``:
  the same gradients and trained weights as torch and one process, the parameters left
  unsharded after backward exactly where torch leaves them;
- ``MixedPrecisionPolicy(param_dtype=bf16, cast_forward_inputs=...)``: outputs and dtypes as
  torch's, and a float32 input to bf16 parameters refused as torch refuses it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.dtensor import init_device_mesh
from hpservice.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from tests.fsdp._models import MLP, batch, local_slice


class Scored(MLP):
    def score(self, x):
        """A method that is not ``forward``: what ``generate`` is to a causal LM."""
        return self.forward(x).sum(-1)


def _engines():
    """(name, fully_shard, register_fsdp_forward_method, MixedPrecisionPolicy, mesh) per engine."""
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TMixed
    from torch.distributed.fsdp import fully_shard as t_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method as t_register

    world = dist.get_world_size()
    return [
        ("torch", t_fully_shard, t_register, TMixed, t_mesh("cpu", (world,))),
        ("ours", fully_shard, register_fsdp_forward_method, MixedPrecisionPolicy, init_device_mesh("cpu", (world,))),
    ]


def _shard(model, shard_fn, mesh, **kwargs):
    for block in model.blocks:
        shard_fn(block, mesh=mesh, **kwargs)
    shard_fn(model, mesh=mesh, **kwargs)
    return model


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _check_forward_method():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, _ = batch(0, world)
    torch.manual_seed(0)
    one = Scored()
    want = one.score(x)
    want.sum().backward()
    out = {}
    for name, shard_fn, register, _, mesh in _engines():
        unregistered = None
        try:  # a model of its own: the failed call leaves its inner states initialised
            _shard(Scored(), shard_fn, mesh).score(local_slice(x, rank, world))
        except Exception as e:  # sharded parameters and a plain input do not mix
            unregistered = type(e).__name__
        torch.manual_seed(0)
        model = _shard(Scored(), shard_fn, mesh)
        register(model, "score")
        register(nn.Linear(2, 2), "forward")  # not fully_shard-ed: a no-op in both
        with pytest.raises(ValueError, match="does not have a method"):
            register(model, "no_such_method")
        got = model.score(local_slice(x, rank, world))
        got.sum().backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        sharded_after = all(hasattr(p, "full_tensor") for p in model.parameters())
        out[name] = (unregistered, got.detach(), grads, sharded_after)
    for name, (unregistered, got, grads, sharded_after) in out.items():
        assert unregistered is not None and unregistered == out["torch"][0], (name, unregistered, out["torch"][0])
        torch.testing.assert_close(got, local_slice(want.detach(), rank, world), msg=name)
        for n, p in one.named_parameters():  # fully_shard averages over ranks
            torch.testing.assert_close(grads[n], p.grad / world, msg=f"{name}: {n}")
        assert sharded_after == out["torch"][3], name
    return True


def test_register_fsdp_forward_method_gathers_like_forward_as_torch(ranks):
    ranks(2).run(_check_forward_method)


def _check_prefetch_accumulation_and_reshard_after_backward():
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, steps = 3, 2
    results = {}
    for name, shard_fn, _, _, mesh in [(None, None, None, None, None), *_engines()]:
        torch.manual_seed(0)
        model = MLP()
        if shard_fn is not None:
            _shard(model, shard_fn, mesh)
            blocks = list(model.blocks)
            for a, b in itertools.pairwise(blocks):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        unsharded_after_backward = []
        for step in range(steps):
            for k in range(micro):
                x, y = batch(step * micro + k, world, per_rank=2)
                if shard_fn is not None:
                    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
                    last = k == micro - 1
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                (nn.functional.mse_loss(model(x), y) / micro).backward()
                if shard_fn is not None:
                    unsharded_after_backward.append(not hasattr(next(model.blocks[0].parameters()), "full_tensor"))
            opt.step()
            opt.zero_grad()
        results[name] = ({n: _full(p) for n, p in model.named_parameters()}, unsharded_after_backward)
    weights, _ = results[None]
    for name in ("torch", "ours"):
        for n, w in weights.items():
            torch.testing.assert_close(results[name][0][n], w, msg=f"{name} vs one process: {n}")
    assert results["ours"][1] == results["torch"][1], (results["ours"][1], results["torch"][1])
    return True


def test_prefetch_gradient_accumulation_and_reshard_after_backward_train_as_torch(ranks):
    ranks(2).run(_check_prefetch_accumulation_and_reshard_after_backward)


def _check_cast_forward_inputs():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, _ = batch(0, world)
    x = local_slice(x, rank, world)
    out = {}
    for name, shard_fn, _, mixed, mesh in _engines():
        for cast in (True, False):
            torch.manual_seed(0)
            model = _shard(MLP(), shard_fn, mesh, mp_policy=mixed(param_dtype=torch.bfloat16, cast_forward_inputs=cast))
            try:
                y = model(x)
                out[name, cast] = ("ran", y.dtype, y.detach().float())
            except RuntimeError as e:
                out[name, cast] = ("raised", type(e).__name__, None)
    for cast in (True, False):
        theirs, ours = out["torch", cast], out["ours", cast]
        assert ours[:2] == theirs[:2], (cast, ours[:2], theirs[:2])
        if theirs[0] == "ran":
            torch.testing.assert_close(ours[2], theirs[2], msg=f"cast_forward_inputs={cast}")
    return True


def test_cast_forward_inputs_as_torch(ranks):
    ranks(2).run(_check_cast_forward_inputs)
