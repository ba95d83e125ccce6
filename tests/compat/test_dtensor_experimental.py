"""torch's ``torch.distributed.tensor.experimental`` recipes (``local_map``, ``register_sharding``,
``implicit_replication``) through torch's DTensor and ours on the same gloo ranks: placements,
values, gradients and errors."""

import torch
import torch.distributed as dist

import hpservice.dtensor as ours
import hpservice.dtensor.experimental as ours_experimental


def _apis():
    import torch.distributed.tensor as t
    import torch.distributed.tensor.experimental as t_experimental
    from torch.distributed.device_mesh import init_device_mesh

    return (ours, ours_experimental, ours.init_device_mesh), (t, t_experimental, init_device_mesh)


def _names(placements):
    return tuple(type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "") for p in placements)


def _same(a, b, key) -> None:
    """Equal structures: tensors close (torch.testing), everything else equal."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, msg=str(key))
    elif isinstance(a, tuple | list):
        assert isinstance(b, tuple | list) and len(a) == len(b), (key, a, b)
        for x, y in zip(a, b, strict=True):
            _same(x, y, key)
    else:
        assert a == b, (key, a, b)


def _same_in_both(one) -> dict:
    """``one(api, experimental, init_mesh)`` run with ours and with torch's: the same keys and
    values; ours returned."""
    mine, theirs = (one(*apis) for apis in _apis())
    assert mine.keys() == theirs.keys()
    for key in theirs:
        _same(mine[key], theirs[key], key)
    return mine


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the type is what the two engines must share
        return type(e).__name__
    return "no error"


def _check_local_map():
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 4 * world, generator=g), torch.randn(4 * world, 5, generator=g)

    def one(api, experimental, init_mesh):
        mesh = init_mesh("cpu", (world,))
        row, col = [api.Shard(0)], [api.Shard(1)]
        out = {}
        # torch's docstring recipe: a local mm of column- and row-sharded operands is a partial sum
        local_mm = experimental.local_map(
            torch.mm, out_placements=[api.Partial()], in_placements=(col, row), device_mesh=mesh
        )
        wd = api.distribute_tensor(w, mesh, col).requires_grad_()
        xd = api.distribute_tensor(x, mesh, row).requires_grad_()
        y = local_mm(wd, xd)
        out["mm"] = (_names(y.placements), y.full_tensor())
        y.full_tensor().pow(2).sum().backward()
        out["mm grads"] = (_names(wd.grad.placements), wd.grad.full_tensor(), xd.grad.full_tensor())
        # placements that differ: refused, or redistributed on request
        replicated = api.distribute_tensor(w, mesh, [api.Replicate()])
        out["mismatch"] = _error(lambda: local_mm(replicated, xd))
        moved = experimental.local_map(
            torch.mm, out_placements=[api.Partial()], in_placements=(col, row), redistribute_inputs=True
        )(replicated, xd.detach())
        out["redistributed"] = (_names(moved.placements), moved.full_tensor())
        # a decorator, several outputs, a non-tensor output, and the gradient's placements given

        @experimental.local_map(
            out_placements=(row, [api.Replicate()], None), in_placements=(row, None), in_grad_placements=(row, None)
        )
        def norms(t, power):
            return t.pow(power), t.sum().reshape(1) * 0 + power, "done"

        td = api.distribute_tensor(w, mesh, row).requires_grad_()  # 6 rows: even shards, as from_local assumes
        a, b, c = norms(td, 2)
        a.full_tensor().sum().backward()
        out["decorated"] = (_names(a.placements), a.full_tensor(), _names(b.placements), b.full_tensor(), c)
        out["decorated grad"] = (_names(td.grad.placements), td.grad.full_tensor())
        out["count mismatch"] = _error(
            lambda: experimental.local_map(torch.mm, [api.Replicate()], in_placements=(col,))(wd, xd)
        )
        rewrap = experimental.local_map(lambda t: api.DTensor.from_local(t, mesh, row), [api.Replicate()])
        out["dtensor output"] = _error(lambda: rewrap(wd.detach()))
        # without a DTensor argument the function runs as it is
        plain = experimental.local_map(torch.mm, out_placements=[api.Replicate()])(w, x)
        out["plain"] = (type(plain) is torch.Tensor, plain)
        return out

    mine = _same_in_both(one)
    torch.testing.assert_close(mine["mm"][1], w @ x)
    return True


def test_local_map_follows_torchs_recipe(ranks):
    ranks(2).run(_check_local_map)


def _define_scale_rows():
    lib = torch.library.Library("hptest", "FRAGMENT")
    lib.define("scale_rows(Tensor x, Tensor w) -> Tensor")
    lib.impl("scale_rows", lambda x, w: x * w[:, None], "CPU")
    lib.impl("scale_rows", lambda x, w: x * w[:, None], "Meta")
    return lib


def _check_register_sharding():
    world = dist.get_world_size()
    lib = _define_scale_rows()  # noqa: F841  (kept alive while the op is used)
    scale_rows = torch.ops.hptest.scale_rows.default
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, generator=g)
    soft = torch.randn(4 * world, 3 * world, generator=g)

    def one(api, experimental, init_mesh):
        out = {}
        meshes = {"1d": init_mesh("cpu", (world,))}
        if world == 4:
            meshes["2d"] = init_mesh("cpu", (2, 2))
        # before a rule: torch has no strategy for a custom op; ours runs it gathered
        xd = api.distribute_tensor(x, meshes["1d"], [api.Shard(0)])
        wd = api.distribute_tensor(w, meshes["1d"], [api.Shard(0)])
        try:
            before = scale_rows(xd, wd)
            out_before = ("computed", _names(before.placements), before.full_tensor())
        except NotImplementedError:
            out_before = ("refused",)

        @experimental.register_sharding(scale_rows)
        def rows(x, w):
            return [
                ([api.Replicate()], [api.Replicate(), api.Replicate()]),
                ([api.Shard(0)], [api.Shard(0), api.Shard(0)]),
            ]

        # torch's docstring recipe: softmax sharded on any dim but its own
        @experimental.register_sharding(torch.ops.aten._softmax.default)
        def softmax(x, dim, half_to_float):
            dim = dim if dim >= 0 else dim + x.ndim
            choices = [([api.Replicate()], [api.Replicate(), None, None])]
            choices += [([api.Shard(d)], [api.Shard(d), None, None]) for d in range(x.ndim) if d != dim]
            return choices

        for mesh_name, mesh in meshes.items():
            n = mesh.ndim
            for px, pw in [("S", "S"), ("R", "R"), ("S", "R"), ("R", "S")]:
                place = {"S": [api.Shard(0)] * n, "R": [api.Replicate()] * n}
                xd = api.distribute_tensor(x, mesh, place[px]).requires_grad_()
                wd = api.distribute_tensor(w, mesh, place[pw])
                y = scale_rows(xd, wd)
                out[(mesh_name, "scale_rows", px, pw)] = (_names(y.placements), y.full_tensor())
            for placements in ([api.Shard(0)], [api.Shard(1)], [api.Replicate()]):
                for dim in (0, 1, -1):
                    sd = api.distribute_tensor(soft, mesh, placements * n)
                    y = torch.softmax(sd, dim)
                    out[(mesh_name, "softmax", _names(placements), dim)] = (_names(y.placements), y.full_tensor())
        return (out_before, out)

    results = [one(*apis) for apis in _apis()]
    (mine_before, mine), (theirs_before, theirs) = results
    assert theirs_before == ("refused",) and mine_before[0] == "computed"
    torch.testing.assert_close(mine_before[2], x * w[:, None])
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert mine[key][0] == theirs[key][0], (key, mine[key][0], theirs[key][0])
        torch.testing.assert_close(mine[key][1], theirs[key][1], msg=str(key))
    return True


def test_register_sharding_follows_torchs_recipe_on_1d_and_2d_meshes():
    # Its own ranks, not the session's pools: a registration replaces aten._softmax's rule, in
    # torch's DTensor and ours, for the rest of the process (as torch's API does).
    from hpservice.launch import RankPool

    with RankPool(4) as pool:
        pool.run(_check_register_sharding)


def _check_implicit_replication():
    world = dist.get_world_size()
    full, other = torch.randn(2 * world, 3), torch.randn(2 * world, 3)

    def one(api, experimental, init_mesh):
        mesh = init_mesh("cpu", (world,))
        out = {}
        for placements in ([api.Shard(0)], [api.Replicate()]):
            d = api.distribute_tensor(full, mesh, placements)
            out[("outside", _names(placements))] = _error(lambda d=d: d + other)
            with experimental.implicit_replication():
                y = d + other
                z = torch.cat([d, other])
            out[("inside", _names(placements))] = (
                _names(y.placements),
                y.full_tensor(),
                _names(z.placements),
                z.full_tensor(),
            )
            out[("after", _names(placements))] = _error(lambda d=d: d * other)
        return out

    _same_in_both(one)
    return True


def test_implicit_replication_follows_torch(ranks):
    ranks(2).run(_check_implicit_replication)
