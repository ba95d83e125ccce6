"""A rank whose shard is empty makes the same collectives as the others.

A tensor of one row sharded over 2 ranks leaves rank 1 an empty shard. An expanded gradient in the
backward of ``(x * y).sum(-1)`` used to take its strides from the local result, which for an
empty tensor always reads as contiguous: rank 1 then decided the next op without a
redistribution that rank 0 made, and rank 0 waited for it for good (found by torch's OpInfo
sweep on ``linalg.vecdot``). Output strides are now decided from global specs alone."""

import pytest
import torch
import torch.distributed as dist

import hpservice.dtensor as ours


def _backward_through_full_tensor(op_name):
    mesh = ours.init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 3, generator=g), torch.randn(1, 3, generator=g)
    op = {"mul-sum": lambda x, y: (x * y).sum(-1), "vecdot": torch.linalg.vecdot}[op_name]
    x, y = (ours.distribute_tensor(t, mesh, [ours.Shard(0)]).requires_grad_() for t in (a, b))
    loss = (op(x, y).full_tensor() * torch.tensor([0.5])).sum()
    gx, gy = torch.autograd.grad(loss, [x, y])
    pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch.autograd.grad((op(pa, pb) * torch.tensor([0.5])).sum(), [pa, pb])
    torch.testing.assert_close(gx.full_tensor(), want[0])
    torch.testing.assert_close(gy.full_tensor(), want[1])
    return True


@pytest.mark.parametrize("op_name", ["mul-sum", "vecdot"])
def test_a_backward_with_an_empty_shard_makes_every_ranks_collectives(ranks, op_name):
    ranks(2).run(_backward_through_full_tensor, op_name, timeout=60)
