"""Tensor parallelism: sharding rules in DTensor dispatch and Colwise/Rowwise nn.Linear styles,
compared with the single-device computation (forward and backward), uneven shards included."""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpservice.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ._compare import _compare, _randn

R, P = Replicate(), Partial()


def _check_mm_rules(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    a, b, bias = _randn(5, 37, seed=1), _randn(37, 7, seed=2), _randn(7, seed=3)
    choices = [R, Shard(0), Shard(1), P]
    per_dim = list(itertools.product(choices, repeat=2))
    combos = per_dim if len(mesh_shape) == 1 else [(x, y) for x, y in itertools.product(per_dim, repeat=2)][::3]
    for combo in combos:
        if len(mesh_shape) == 1:
            pa, pb = [combo[0]], [combo[1]]
        else:
            pa, pb = [combo[0][0], combo[1][0]], [combo[0][1], combo[1][1]]
        _compare(torch.mm, [a, b], [pa, pb], mesh)
        _compare(lambda x, y, z: torch.addmm(z, x, y), [a, b, bias], [pa, pb, [R] * len(mesh_shape)], mesh)
    # The contraction over the odd K=37 gives a Partial; the bias is added once.
    k = [Shard(1)] + [R] * (len(mesh_shape) - 1)
    out = _compare(lambda x, y, z: torch.addmm(z, x, y), [a, b, bias], [k, [Shard(0)] + k[1:], [R] * len(k)], mesh)
    assert out.placements[0] == P
    # Column-parallel: bias [7] follows the output's Shard(1) as Shard(0).
    out = _compare(lambda x, y, z: torch.addmm(z, x, y), [a, b, bias], [[R] * len(k), k, [Shard(0)] + k[1:]], mesh)
    assert out.placements[0] == Shard(1)
    # bmm
    x, y = _randn(3, 5, 37, seed=4), _randn(3, 37, 6, seed=5)
    for px, py in [(Shard(0), Shard(0)), (Shard(2), Shard(1)), (Shard(1), R), (R, Shard(2)), (Shard(1), Shard(1))]:
        _compare(torch.bmm, [x, y], [[px] + [R] * (len(mesh_shape) - 1), [py] + [R] * (len(mesh_shape) - 1)], mesh)
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_mm_addmm_bmm_rules(ranks, mesh_shape):
    ranks(4 if len(mesh_shape) == 2 or mesh_shape[0] == 4 else 2).run(_check_mm_rules, mesh_shape)


def _check_view_rules(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    extra = [R] * (len(mesh_shape) - 1)
    x = _randn(3, 5, 37, seed=6)
    out = _compare(lambda t: t.t(), [x[0]], [[Shard(1)] + extra], mesh)
    assert out.placements[0] == Shard(0)
    out = _compare(lambda t: t.transpose(0, 2), [x], [[Shard(2)] + extra], mesh)
    assert out.placements[0] == Shard(0)
    out = _compare(lambda t: t.permute(2, 0, 1), [x], [[Shard(1)] + extra], mesh)
    assert out.placements[0] == Shard(2)
    out = _compare(lambda t: t.view(15, 37), [x], [[Shard(2)] + extra], mesh)
    assert out.placements[0] == Shard(1)
    out = _compare(lambda t: t.view(15, 37), [x], [[Shard(1)] + extra], mesh)  # not one-to-one: gathered
    assert out.placements[0] == R
    out = _compare(lambda t: t.reshape(3, 5, 37), [x.reshape(15, 37)], [[Shard(1)] + extra], mesh)
    assert out.placements[0] == Shard(2)
    out = _compare(lambda t: t.view(-1, 37), [x], [[Shard(0)] + extra], mesh)  # 3 rows x 5 != chunks of 15
    assert out.placements[0] == R
    out = _compare(lambda t: t.unsqueeze(0).view(37), [x[0, 0]], [[Shard(0)] + extra], mesh)
    assert out.placements[0] == Shard(0)
    # A transposed local piece viewed (the spec says contiguous): falls back to a copy.
    _compare(lambda t: t.t().reshape(-1), [x[0]], [[Shard(1)] + extra], mesh)
    out = _compare(lambda t: t.expand(4, 5, 37), [x[:1]], [[Shard(2)] + extra], mesh)
    assert out.placements[0] == Shard(2)
    if len(mesh_shape) == 2:  # two mesh dims, nested
        out = _compare(lambda t: t.view(15, 37), [x], [[Shard(2), Shard(2)]], mesh)
        assert out.placements == (Shard(1), Shard(1))
        out = _compare(lambda t: t.permute(2, 1, 0), [x], [[Shard(1), Shard(2)]], mesh)
        assert out.placements == (Shard(1), Shard(0))
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_view_and_transpose_rules(ranks, mesh_shape):
    ranks(4 if len(mesh_shape) == 2 or mesh_shape[0] == 4 else 2).run(_check_view_rules, mesh_shape)


def _check_reduction_and_pointwise_rules(world):
    mesh = init_device_mesh("cpu", (world,))
    x = _randn(5, 37, seed=7)
    out = _compare(lambda t: t.sum(1), [x], [[Shard(1)]], mesh)
    assert out.placements == (P,)
    out = _compare(lambda t: t.sum(0), [x], [[Shard(1)]], mesh)
    assert out.placements == (Shard(0),)
    out = _compare(lambda t: t.sum(0, keepdim=True), [x], [[Shard(1)]], mesh)
    assert out.placements == (Shard(1),)
    out = _compare(lambda t: t.sum(), [x], [[Shard(0)]], mesh)
    assert out.placements == (P,)
    out = _compare(lambda t: t.mean(1), [x], [[Shard(1)]], mesh)  # global count, not the local one
    assert out.placements == (P,)
    _compare(lambda t: t.mean(), [x], [[Shard(1)]], mesh)
    _compare(lambda t: t.mean(0), [x], [[Shard(1)]], mesh)
    _compare(lambda t: t.sum(1), [x], [[P]], mesh)
    # Broadcasting between different placements.
    y, bias = _randn(2, 3, 37, seed=8), _randn(37, seed=9)
    out = _compare(torch.add, [y, bias], [[Shard(2)], [R]], mesh)
    assert out.placements == (Shard(2),)
    out = _compare(torch.mul, [bias, y], [[Shard(0)], [Shard(1)]], mesh)
    assert out.placements == (Shard(1),)
    out = _compare(torch.add, [y, y[:, :1]], [[Shard(1)], [Shard(1)]], mesh)  # size-1 dim: replicated
    assert out.placements == (Shard(1),)
    out = _compare(torch.add, [y, bias], [[P], [P]], mesh)
    assert out.placements == (P,)
    out = _compare(torch.mul, [y, bias], [[P], [Shard(0)]], mesh)  # Partial reduce-scattered to the shard
    assert out.placements == (Shard(2),)
    out = _compare(torch.add, [x, x], [[P], [R]], mesh)  # same shape, Partial + Replicate
    assert out.placements == (R,)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_reduction_and_broadcast_rules(ranks, world):
    ranks(world).run(_check_reduction_and_pointwise_rules, world)


def _check_errors_and_no_mutation():
    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(_randn(4, 5, seed=1), mesh, [Shard(0)])
    # ops without a rule run on whole tensors (torch's replicate strategy): gathered, Replicate
    for op in (lambda t: torch.cumprod(t, 0), lambda t: torch.cummax(t, 0).values, torch.linalg.matrix_exp):
        out = op(a if op is not torch.linalg.matrix_exp else a[:, :4])
        assert out.placements == (Replicate(),)
        plain = op(a.full_tensor() if op is not torch.linalg.matrix_exp else a.full_tensor()[:, :4])
        torch.testing.assert_close(out.full_tensor(), plain)
    # ...except in place (a shard cannot hold the gathered result) and random ops; they name themselves
    with pytest.raises(NotImplementedError, match=r"aten.cumprod_.default on DTensor placements \[\(S\(0\)\)\].*in place"):
        a.clone().cumprod_(0)
    torch.testing.assert_close(torch.median(a, 0).values.full_tensor(), torch.median(a.full_tensor(), 0).values)
    # kthvalue and roll have rules now: the sharded dim is gathered, the values are the plain op's
    torch.testing.assert_close(torch.kthvalue(a, 2, 0).values.full_tensor(), torch.kthvalue(a.full_tensor(), 2, 0).values)
    torch.testing.assert_close(torch.roll(a, 1, 0).full_tensor(), torch.roll(a.full_tensor(), 1, 0))
    # Same shape, different shard placements: b is redistributed to a's layout (a new DTensor).
    b = distribute_tensor(_randn(4, 5, seed=2), mesh, [Shard(1)])
    ab = a + b
    assert ab.placements == (Shard(0),)
    torch.testing.assert_close(ab.full_tensor(), a.full_tensor() + b.full_tensor())
    with pytest.raises(NotImplementedError, match="in-place"):
        distribute_tensor(_randn(4, 5, seed=3), mesh, [P]).add_(distribute_tensor(_randn(5), mesh, [R]))
    # Automatic redistribution never writes or re-places the operands.
    la, lb = a.to_local().clone(), b.to_local().clone()
    c = distribute_tensor(_randn(5, 4, seed=4), mesh, [Shard(0)])
    lc = c.to_local().clone()
    out = a @ c  # c is redistributed (S(0) -> R or S(1)), a kept
    torch.testing.assert_close(out.full_tensor(), a.full_tensor() @ c.full_tensor())
    assert a.placements == (Shard(0),) and c.placements == (Shard(0),)
    assert torch.equal(a.to_local(), la) and torch.equal(c.to_local(), lc) and torch.equal(b.to_local(), lb)
    return True


def test_unsupported_ops_and_no_mutation(ranks):
    ranks(2).run(_check_errors_and_no_mutation)


class _MLP(nn.Module):
    def __init__(self, dim=16, hidden=37):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _check_mlp(batch_shape):
    torch.manual_seed(0)
    ref = _MLP()
    with torch.no_grad():
        ref.down.bias.normal_()  # a visible bias: added once, not once per rank
    model = copy.deepcopy(ref)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert model.up.weight.placements == (Shard(0),) and model.up.bias.placements == (Shard(0),)
    assert model.down.weight.placements == (Shard(1),) and model.down.bias.placements == (R,)
    assert isinstance(model.up.weight, nn.Parameter)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x = _randn(*batch_shape, 16, seed=10 + step)
        out_ref = ref(x)
        out = model(x)
        assert type(out) is torch.Tensor  # use_local_output: the replicated output as a plain tensor
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        loss_ref = (out_ref**2).mean()
        loss = (out**2).mean()
        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
        loss_ref.backward()
        loss.backward()
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, atol=1e-5, rtol=1e-5)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), p_ref.detach(), atol=1e-5, rtol=1e-5)
    # Bias added once: zero input -> the rowwise output is the global bias path, not world x bias.
    with torch.no_grad():
        torch.testing.assert_close(model(torch.zeros(2, 16)), ref(torch.zeros(2, 16)), atol=1e-5, rtol=1e-5)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch_shape", [(4,), (2, 3)])
def test_colwise_rowwise_mlp_matches_single_device(ranks, world, batch_shape):
    ranks(world).run(_check_mlp, batch_shape)


def _check_styles_options():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    lin = nn.Linear(8, 5)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, ColwiseParallel(use_local_output=False, output_layouts=Replicate()))
    x = _randn(3, 8)
    out = lin(x)
    assert isinstance(out, DTensor) and out.placements == (R,)
    torch.testing.assert_close(out.full_tensor(), ref(x))
    with pytest.raises(NotImplementedError, match=r"nn\.Linear and nn\.Embedding only"):
        parallelize_module(nn.LayerNorm(4), mesh, ColwiseParallel())
    with pytest.raises(ValueError, match="no submodule matches"):
        parallelize_module(nn.Sequential(nn.Linear(2, 2)), mesh, {"x.*": ColwiseParallel()})
    seq = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    parallelize_module(seq, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    assert seq[0].weight.placements == (Shard(0),)
    return True


def test_style_options(ranks):
    ranks(2).run(_check_styles_options)
