"""Pointwise ops whose DTensor operands have the same shape but different layouts redistribute the
other operands (to ``self``'s layout for in-place ops), as torch's DTensor does: an optimizer
stepping a sharded parameter whose gradient came back replicated equals a single device."""

import pytest
import torch

from hpservice.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh


def _mixed_layouts(world):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Replicate()])
    out = da * db + db.redistribute(mesh, [Shard(1)])
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), a * b + b)
    # In place: self keeps its layout; a Partial operand is reduced into it.
    dpart = DTensor.from_local(b / world, mesh, [Partial()])
    da.lerp_(db, 0.25).add_(dpart)
    assert da.placements == (Shard(0),)
    torch.testing.assert_close(da.full_tensor(), a.lerp(b, 0.25) + b)
    # A replicated self takes a sharded operand in place by gathering the operand, never itself.
    db.add_(distribute_tensor(a, mesh, [Shard(0)]))
    assert db.placements == (Replicate(),)
    torch.testing.assert_close(db.to_local(), b + a)


def _adamw_with_replicated_grad(world):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    w, grad = torch.randn(9, 4, generator=g), torch.randn(9, 4, generator=g)
    ref = torch.nn.Parameter(w.clone())
    param = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    opt = torch.optim.AdamW([param], lr=0.1, foreach=False)
    ref_opt = torch.optim.AdamW([ref], lr=0.1, foreach=False)
    for _ in range(2):
        param.grad = distribute_tensor(grad, mesh, [Replicate()])
        ref.grad = grad.clone()
        opt.step()
        ref_opt.step()
    assert param.placements == (Shard(0),)
    torch.testing.assert_close(param.full_tensor(), ref.detach())


@pytest.mark.parametrize("world", [2, 4])
def test_pointwise_operands_with_different_layouts_are_redistributed(ranks, world):
    ranks(world).run(_mixed_layouts, world)


def test_optimizer_steps_sharded_param_with_replicated_grad(ranks):
    ranks(2).run(_adamw_with_replicated_grad, 2)
