"""torch.optim's foreach and fused paths on sharded and tensor-parallel parameters, and activation
checkpointing (torch.utils.checkpoint) around fully_shard modules: equal to the per-tensor path
and to one process."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import hpservice.dtensor as ours
from hpservice.fsdp import fully_shard
from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _fsdp(model, mesh):
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tp(model, mesh):
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _steps(model, opt, rank, steps=3):
    for step in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def _check_optimizers(wrap: str, path: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ours.init_device_mesh("cpu", (world,))
    base = _mlp()
    apply = _fsdp if wrap == "fsdp" else _tp
    for cls, extra in ((torch.optim.AdamW, {}), (torch.optim.Adam, {}), (torch.optim.SGD, {"momentum": 0.9})):
        results = []
        for kwargs in ({path: True}, {"foreach": False}):
            model = apply(copy.deepcopy(base), mesh)
            opt = cls(model.parameters(), lr=0.01, **extra, **kwargs)
            results.append(_steps(model, opt, rank if wrap == "fsdp" else 0))
            assert all(isinstance(v, ours.DTensor) for s in opt.state.values() for k, v in s.items() if k != "step")
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    return True


@pytest.mark.parametrize("wrap", ["fsdp", "tp"])
@pytest.mark.parametrize("path", ["foreach", "fused"])
def test_foreach_and_fused_optimizers_equal_the_per_tensor_path(ranks, wrap, path):
    ranks(2).run(_check_optimizers, wrap, path)


class _Checkpointed(nn.Module):
    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _check_activation_checkpointing(reentrant: bool, early_stop: bool):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ours.init_device_mesh("cpu", (world,))
    base = _mlp()
    model = nn.Sequential(
        _Checkpointed(copy.deepcopy(base[0]), reentrant), nn.ReLU(), _Checkpointed(copy.deepcopy(base[2]), reentrant)
    )
    fully_shard(model[0].inner, mesh=mesh)
    fully_shard(model[2].inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ref = copy.deepcopy(base)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with set_checkpoint_early_stop(early_stop):
        for step in range(2):
            x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(step))
            local = x[rank * 2 : rank * 2 + 2].requires_grad_(reentrant)  # reentrant needs an input that requires grad
            model(local).pow(2).mean().backward()
            ref(x).pow(2).mean().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=1e-6)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    return True


@pytest.mark.parametrize("reentrant,early_stop", [(False, True), (False, False), (True, True)])
def test_activation_checkpointing_around_fully_shard_equals_one_process(ranks, reentrant, early_stop):
    ranks(2).run(_check_activation_checkpointing, reentrant, early_stop)
