"""DTensor API on real gloo ranks: construction, autograd, local ops, optimizers."""

import pytest
import torch
import torch.distributed as dist

from hpservice.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh


def _check_audit_08():
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    # 5 rows over 4 ranks: torch.chunk sizes 2, 2, 1, 0; global shape found exactly.
    local = torch.ones([2, 2, 1, 0][rank], 3)
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    assert dt.shape == (5, 3)  # never local x ranks (which would be 8 or 0)
    assert torch.equal(dt.full_tensor(), torch.ones(5, 3))
    # 7 over 2-way nested sharding: (4, 3) then (2, 2 | 2, 1).
    mesh2 = init_device_mesh("cpu", (2, 2))
    full = torch.arange(7.0)
    x = distribute_tensor(full, mesh2, [Shard(0), Shard(0)])
    assert x.to_local().numel() == [2, 2, 2, 1][rank]
    y = DTensor.from_local(x.to_local(), mesh2, [Shard(0), Shard(0)])
    assert y.shape == (7,) and torch.equal(y.full_tensor(), full)
    # Sizes that are not torch.chunk pieces are rejected with the expected sizes.
    with pytest.raises(ValueError, match=r"not torch.chunk pieces of 7 \(expected \[2, 2, 2, 1\]\)"):
        DTensor.from_local(torch.ones([1, 2, 2, 2][rank]), mesh, [Shard(0)])
    return True


def test_audit_08_uneven_shards_exact_global_shape(ranks):
    ranks(4).run(_check_audit_08)


def _check_distribute_src_data_rank():
    mesh = init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    mine = torch.full((4, 4), float(rank))  # every rank passes different data
    x = distribute_tensor(mine, mesh, [Shard(0), Replicate()])  # rank 0's data wins
    assert torch.equal(x.full_tensor(), torch.zeros(4, 4))
    y = distribute_tensor(mine, mesh, [Shard(0), Replicate()], src_data_rank=None)  # local slice only
    assert torch.equal(y.to_local(), torch.full((2, 4), float(rank)))
    z = distribute_tensor(mine, mesh, [Replicate(), Shard(1)], src_data_rank=1)  # coordinate (1, 1) = rank 3
    assert torch.equal(z.full_tensor(), torch.full((4, 4), 3.0))
    # The caller's tensor is never aliased or written.
    w = distribute_tensor(mine, mesh, [Replicate(), Replicate()], src_data_rank=None)
    w.add_(1)
    assert torch.equal(mine, torch.full((4, 4), float(rank)))
    p = distribute_tensor(torch.ones(3), mesh, [Partial(), Replicate()])
    assert torch.equal(p.full_tensor(), torch.ones(3))
    return True


def test_distribute_tensor_src_data_rank(ranks):
    ranks(4).run(_check_distribute_src_data_rank)


def _grads_ours(full, placements):
    mesh = init_device_mesh("cpu", (2, 2))
    ours = distribute_tensor(full, mesh, placements).requires_grad_()
    weight = torch.arange(float(full.numel())).reshape(full.shape)
    out = ours.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    (out * weight).sum().backward()
    assert isinstance(ours.grad, DTensor) and ours.grad.placements == ours.placements
    g1 = ours.grad.full_tensor()
    # from_local / to_local / full_tensor chain: the local gradient is the slice of the global one.
    local = ours.to_local().detach().clone().requires_grad_()
    dt = DTensor.from_local(local, mesh, placements, shape=full.shape)
    (dt.full_tensor() * weight).sum().backward()
    return g1, local.grad, weight


def _grads_torch(full, placements):
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor as tdistribute
    from torch.distributed.tensor import init_device_mesh as tmesh

    conv = {Shard(0): TS(0), Shard(1): TS(1), Replicate(): TR()}
    mesh = tmesh("cpu", (2, 2))
    theirs = tdistribute(full, mesh, [conv[p] for p in placements]).requires_grad_()
    weight = torch.arange(float(full.numel())).reshape(full.shape)
    (theirs.redistribute(mesh, [TR(), TR()]).to_local() * weight).sum().backward()
    return theirs.grad.full_tensor(), theirs.grad.to_local()


def _check_autograd_vs_torch():
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    for placements in ([Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate(), Shard(0)]):
        g_ours, g_local, weight = _grads_ours(full, placements)
        g_torch, g_torch_local = _grads_torch(full, placements)
        assert torch.equal(g_ours, weight) and torch.equal(g_ours, g_torch)
        assert torch.equal(g_local, g_torch_local)
    # Partial input: the gradient of each rank's partial value is the full (replicated) gradient.
    mesh = init_device_mesh("cpu", (4,))
    local = torch.ones(3, requires_grad=True)
    DTensor.from_local(local, mesh, [Partial()]).full_tensor().mul(torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(local.grad, torch.tensor([1.0, 2.0, 3.0]))
    # to_local(grad_placements=...): the local gradient is declared Partial and summed on the way back.
    x = distribute_tensor(torch.ones(4), mesh, [Replicate()]).requires_grad_()
    x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]).sum().backward()
    assert torch.equal(x.grad.full_tensor(), torch.full((4,), 4.0))
    return True


def test_autograd_matches_torch_dtensor(ranks):
    ranks(4).run(_check_autograd_vs_torch)


def _check_pointwise_and_foreach():
    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    a_full, b_full = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    pl = [Shard(0), Shard(1)]
    a, b = distribute_tensor(a_full, mesh, pl), distribute_tensor(b_full, mesh, pl)
    checks = {
        "add": (a + b, a_full + b_full),
        "mul_scalar": (a * 3, a_full * 3),
        "div_0d": (a / torch.tensor(2.0), a_full / 2),
        "where": (torch.where(a > 0, a, b), torch.where(a_full > 0, a_full, b_full)),
        "sqrt_abs": (a.abs().sqrt(), a_full.abs().sqrt()),
        "to_bf16": (a.to(torch.bfloat16), a_full.to(torch.bfloat16)),
        "zeros_like": (torch.zeros_like(a), torch.zeros_like(a_full)),
        "clone": (a.clone(), a_full),
    }
    for name, (got, want) in checks.items():
        assert isinstance(got, DTensor) and got.placements == tuple(pl), name
        assert torch.equal(got.full_tensor(), want), name
    c = a.clone()
    c.mul_(2).add_(b, alpha=0.5)
    assert torch.equal(c.full_tensor(), a_full * 2 + b_full * 0.5)
    xs = [a.clone(), b.clone()]
    torch._foreach_mul_(xs, 2.0)
    torch._foreach_addcmul_(xs, [a, b], [b, a], value=0.5)
    ref = [a_full.clone(), b_full.clone()]
    torch._foreach_mul_(ref, 2.0)
    torch._foreach_addcmul_(ref, [a_full, b_full], [b_full, a_full], value=0.5)
    assert torch.equal(xs[0].full_tensor(), ref[0]) and torch.equal(xs[1].full_tensor(), ref[1])
    outs = torch._foreach_sqrt(torch._foreach_abs([a, b]))
    assert torch.equal(outs[1].full_tensor(), b_full.abs().sqrt())
    # Fully replicated operands may broadcast.
    r = distribute_tensor(a_full, mesh, [Replicate(), Replicate()])
    row = distribute_tensor(b_full[0], mesh, [Replicate(), Replicate()])
    assert torch.equal((r + row).full_tensor(), a_full + b_full[0])
    # R * S: the sharded layout wins whatever the operand order, with no communication (the
    # replicated operand is sliced locally), as torch's DTensor does; a replicated row broadcast
    # against a sharded operand keeps the shards too. foreach over mixed layouts: element j keeps
    # self[j]'s layout.
    from hpservice.bench._harness import count_profiled

    with count_profiled() as collectives:
        rs, sr, bias = r * a, a * r, a + row
        ys = [a.clone(), r.clone()]
        torch._foreach_add_(ys, [r, a])  # a is redistributed to R for element 1: its one collective
    for name, got, want in (("R*S", rs, a_full * a_full), ("S*R", sr, a_full * a_full), ("S+row", bias, a_full + b_full[0])):
        assert got.placements == tuple(pl), (name, got.placements)
        assert torch.equal(got.full_tensor(), want), name
    assert ys[0].placements == tuple(pl) and ys[1].placements == (Replicate(), Replicate())
    assert torch.equal(ys[0].full_tensor(), 2 * a_full) and torch.equal(ys[1].full_tensor(), 2 * a_full)
    assert sum(collectives.values()) == 2, collectives  # the gather of a to R: one per sharded mesh dim
    return True


def test_pointwise_inplace_and_foreach_on_local_shards(ranks):
    ranks(4).run(_check_pointwise_and_foreach)


def _check_clear_errors():
    mesh = init_device_mesh("cpu", (2, 2))
    a = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Replicate()])
    b = distribute_tensor(torch.randn(4, 4), mesh, [Replicate(), Shard(1)])
    c = a + b  # different layouts: each mesh dim keeps the operand's shard (local slices, as torch)
    assert c.placements == (Shard(0), Shard(1)) and torch.equal(c.full_tensor(), a.full_tensor() + b.full_tensor())
    with pytest.raises(NotImplementedError, match=r"aten.cumprod_.default .* no sharding rule yet \(in place"):
        a.clone().cumprod_(0)
    torch.testing.assert_close(torch.cumprod(a, 0).full_tensor(), torch.cumprod(a.full_tensor(), 0))  # gathered
    assert torch.allclose((a @ b).full_tensor(), a.full_tensor() @ b.full_tensor())  # mm has a sharding rule
    with pytest.raises(RuntimeError, match=r"mixes a DTensor with a torch.Tensor of shape \(4, 4\)"):
        a + torch.ones(4, 4)
    p = DTensor.from_local(torch.ones(4, 4), mesh, [Partial(), Partial()])
    # not linear in the pending sums: reduced first, as torch does (adding 1 on each rank of a
    # pending sum would add 4 to the global value)
    e, q = p.exp(), p + 1
    assert torch.equal(e.full_tensor(), torch.full((4, 4), 4.0).exp()) and e.placements == (Replicate(), Replicate())
    assert torch.equal(q.full_tensor(), torch.full((4, 4), 5.0)) and q.placements == (Replicate(), Replicate())
    assert torch.equal((p * 2 + p).full_tensor(), torch.full((4, 4), 12.0))  # linear ops are fine
    with pytest.raises(ValueError, match="has 1 entries for a 2-d mesh"):
        a.redistribute(mesh, [Shard(0)])
    with pytest.raises(ValueError, match="out of range for a tensor with 2 dims"):
        a.redistribute(mesh, [Shard(2), Replicate()])
    return True


def test_unsupported_ops_raise_clear_errors(ranks):
    ranks(4).run(_check_clear_errors)


def _check_optimizer(foreach):
    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    w_full, b_full = torch.randn(7, 3, generator=g), torch.randn(5, generator=g)
    grads_full = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g)]
    ref = [torch.nn.Parameter(w_full.clone()), torch.nn.Parameter(b_full.clone())]
    ours = [
        torch.nn.Parameter(distribute_tensor(w_full, mesh, [Shard(0), Shard(1)])),
        torch.nn.Parameter(distribute_tensor(b_full, mesh, [Replicate(), Shard(0)])),
    ]
    assert all(isinstance(p, DTensor) for p in ours)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, foreach=foreach)
    our_opt = torch.optim.AdamW(ours, lr=0.1, weight_decay=0.1, foreach=foreach)
    for step in range(3):
        for p, q, gf in zip(ref, ours, grads_full, strict=True):
            p.grad = gf * (step + 1)
            q.grad = distribute_tensor(gf * (step + 1), mesh, q.placements)
        ref_opt.step()
        our_opt.step()
    for p, q in zip(ref, ours, strict=True):
        assert torch.allclose(q.full_tensor(), p.detach(), atol=1e-6, rtol=1e-6)
        state = our_opt.state[q]["exp_avg_sq"]
        assert isinstance(state, DTensor) and state.placements == q.placements
    return True


@pytest.mark.parametrize("foreach", [False, True])
def test_stock_optimizer_steps_dtensor_params_like_single_device(ranks, foreach):
    ranks(4).run(_check_optimizer, foreach)


def _check_clip_grad_norm():
    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, generator=g)]
    placements = [[Shard(0), Shard(1)], [Shard(0), Replicate()], [Replicate(), Replicate()]]
    for foreach in (False, True):
        for norm_type in (2.0, 1.0, float("inf")):
            ref = [torch.nn.Parameter(f.clone()) for f in fulls]
            ours = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(fulls, placements, strict=True)]
            for p, q in zip(ref, ours, strict=True):
                p.grad, q.grad = p.detach() * 3, q.detach() * 3
            want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type, foreach=foreach)
            got = torch.nn.utils.clip_grad_norm_(ours, 1.0, norm_type=norm_type, foreach=foreach)
            # The norm is global (not per rank), and so is the clipping.
            assert isinstance(got, DTensor) and torch.allclose(got.full_tensor(), want), (foreach, norm_type)
            for p, q in zip(ref, ours, strict=True):
                assert torch.allclose(q.grad.full_tensor(), p.grad)
    return True


def test_clip_grad_norm_is_global(ranks):
    ranks(4).run(_check_clip_grad_norm)


def _check_replicated_any_op():
    mesh = init_device_mesh("cpu", (4,))
    full = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    r = distribute_tensor(full, mesh, [Replicate()])
    out = r @ r.t()  # no sharding rule needed: every rank holds every operand whole
    assert out.placements == (Replicate(),) and torch.equal(out.to_local(), full @ full.t())
    assert torch.equal(torch.stack([r, r]).to_local(), torch.stack([full, full]))
    return True


def test_fully_replicated_operands_run_any_op(ranks):
    ranks(4).run(_check_replicated_any_op)
