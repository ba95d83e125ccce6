"""torch DTensor recipes through torch's DTensor and ours on the same gloo ranks: values, layouts
(placements, shapes, strides), gradients and errors; where torch silently loses a write, ours
raises."""

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hpservice.dtensor as ours
from hpservice.fsdp import fully_shard


def _torch():
    import torch.distributed.tensor as t
    from torch.distributed.device_mesh import init_device_mesh

    return t, init_device_mesh


def _both(world):
    t, t_mesh = _torch()
    return (
        (ours, ours.init_device_mesh("cpu", (world,))),
        (t, t_mesh("cpu", (world,))),
    )


def _names(placements):
    return tuple(type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "") for p in placements)


# ---- reductions, scans, sorting and indexing: values, layouts and gradients -------------------------


def _check_scan_sort_index_ops():
    world = dist.get_world_size()
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))  # 5 rows: uneven over 2 ranks
    index = torch.tensor([4, 0, 2])
    source = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    ops = {
        "var(1)": lambda x, i, s: x.var(1),
        "std(0, correction=0)": lambda x, i, s: x.std(0, correction=0),
        "var()": lambda x, i, s: x.var(),
        "cumsum(0)": lambda x, i, s: x.cumsum(0),
        "cumsum(1)": lambda x, i, s: x.cumsum(1),
        "sort(1).values": lambda x, i, s: x.sort(1)[0],
        "sort(0).indices": lambda x, i, s: x.sort(0)[1],
        "topk(2, 1).values": lambda x, i, s: x.topk(2, 1)[0],
        "index_select(1)": lambda x, i, s: x.index_select(1, i),
        "index_add(1)": lambda x, i, s: x.index_add(1, i, s),
    }
    results = []
    for api, mesh in _both(world):
        out = {}
        for placement in (api.Shard(0), api.Shard(1), api.Replicate()):
            for name, op in ops.items():
                x = api.distribute_tensor(full, mesh, [placement]).requires_grad_()
                i = api.distribute_tensor(index, mesh, [api.Replicate()])
                s = api.distribute_tensor(source, mesh, [placement if placement == api.Shard(0) else api.Replicate()])
                y = op(x, i, s)
                key = (_names([placement]), name)
                out[key] = (_names(y.placements), y.full_tensor())
                if y.dtype.is_floating_point:
                    (y * y).sum().backward()
                    out[key + ("grad",)] = (_names(x.grad.placements), x.grad.full_tensor())
        results.append(out)
    mine, theirs = results
    assert mine.keys() == theirs.keys()
    for key, (placements, value) in theirs.items():
        if placements == ("Partial",) and key[-1] == "grad":
            # torch leaves a pending sum in the gradient (var over the sharded dim); ours reduces it.
            assert mine[key][0] == key[0], (key, mine[key][0], placements)
        else:
            assert mine[key][0] == placements, (key, mine[key][0], placements)
        torch.testing.assert_close(mine[key][1], value, rtol=1e-6, atol=1e-6, msg=str(key))
    # And the single-device values (torch's DTensor is the reference for layouts only).
    y = full.clone().requires_grad_()
    (y.var(1) ** 2).sum().backward()
    torch.testing.assert_close(mine[(("Shard(0)",), "var(1)", "grad")][1], y.grad)
    torch.testing.assert_close(mine[(("Shard(1)",), "index_add(1)")][1], full.index_add(1, index, source))
    return True


def test_var_cumsum_sort_topk_index_ops_match_torch(ranks):
    ranks(2).run(_check_scan_sort_index_ops)


def _check_random_like_and_seeding():
    """rand_like / randn_like / randint_like and in-place samplers: the global tensor does not depend
    on the placements and replicas agree. Seeding: the first DTensor random op of a process copies
    rank 0's generator state to every rank (torch's run_state_sync), so ranks seeded differently
    still agree; from then on torch.manual_seed (or random.manual_seed) reseeds, as in torch."""
    from hpservice.dtensor import random as dtensor_random

    world = dist.get_world_size()
    mesh = ours.init_device_mesh("cpu", (world,))
    base = torch.zeros(5, 4)

    def draw():
        out = {}
        for placement in (ours.Shard(0), ours.Shard(1), ours.Replicate()):
            torch.set_rng_state(state)
            x = ours.distribute_tensor(base, mesh, [placement])
            out[placement] = [
                torch.rand_like(x).full_tensor(),
                torch.randn_like(x).full_tensor(),
                torch.randint_like(x, 10).full_tensor(),
                x.clone().uniform_(-1, 1).full_tensor(),
            ]
        return out

    dtensor_random._rng_tracker = None  # a fresh process: no DTensor random op yet
    torch.manual_seed(1234 + dist.get_rank())  # ranks disagree: rank 0's state is taken
    first = ours.distribute_tensor(base, mesh, [ours.Shard(0)]).uniform_().full_tensor()
    state = torch.get_rng_state()
    runs = draw()
    for placement, values in runs.items():
        for a, b in zip(values, runs[ours.Replicate()], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=str(placement))
    assert runs[ours.Replicate()][2].min() >= 0 and runs[ours.Replicate()][2].max() < 10
    gathered = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(gathered, first)
    assert all(torch.equal(g, first) for g in gathered)  # every rank holds the same global tensor

    dtensor_random._rng_tracker = None  # the same start again reproduces the same values
    torch.manual_seed(1234 + dist.get_rank())
    again = ours.distribute_tensor(base, mesh, [ours.Replicate()]).uniform_().full_tensor()
    torch.testing.assert_close(again, first, rtol=0, atol=0)

    dtensor_random.manual_seed(7, mesh)  # torch's signature; = torch.manual_seed(7)
    a = ours.distribute_tensor(base, mesh, [ours.Shard(1)]).normal_().full_tensor()
    torch.manual_seed(7)
    b = ours.distribute_tensor(base, mesh, [ours.Shard(0)]).normal_().full_tensor()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert dtensor_random.is_rng_supported_mesh(mesh)
    return True


def test_random_like_factories_and_torch_seeding(ranks):
    ranks(2).run(_check_random_like_and_seeding)


def _reseeded_draws(api, mesh, make):
    """The issue's recipe: torch.manual_seed(0), a random op on a sharded DTensor, gathered; again."""
    import warnings

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "DTensor random operators may not have complete support on cpu"
        for _ in range(2):
            torch.manual_seed(0)
            out.append([f().full_tensor() for f in make(api, mesh)])
    return out


def _random_recipes(api, mesh):
    model = nn.Sequential(nn.Identity(), nn.Dropout(0.5))  # no parameters: nothing drawn before the ops
    return [
        lambda: api.distribute_tensor(torch.empty(4, 4), mesh, [api.Shard(0)]).uniform_(),
        lambda: api.distribute_tensor(torch.empty(5, 3), mesh, [api.Shard(1)]).normal_(2.0, 0.5),
        lambda: nn.init.kaiming_uniform_(api.distribute_tensor(torch.empty(7, 4), mesh, [api.Shard(0)])),
        lambda: torch.nn.functional.dropout(
            api.distribute_tensor(torch.ones(6, 4), mesh, [api.Shard(0)]), 0.5, training=True
        ),
        lambda: model[1](api.distribute_tensor(torch.ones(4, 6), mesh, [api.Shard(1)])),
        lambda: torch.rand_like(api.distribute_tensor(torch.empty(3, 5), mesh, [api.Shard(0)])),
    ]


def _check_reseeding_reproduces_as_torch():
    """torch.manual_seed(s) on every rank, then random ops on sharded DTensors (samplers, nn.init,
    dropout, a model's Dropout, rand_like), gathered; reseeded, the same ops give the same values,
    in torch's DTensor and in ours. Ours also gives the global tensor that Replicate draws (torch's
    CPU DTensor repeats rank 0's piece on every rank, docs/compat.md)."""
    t, t_mesh = _torch()
    world = dist.get_world_size()
    mine = _reseeded_draws(ours, ours.init_device_mesh("cpu", (world,)), _random_recipes)
    theirs = _reseeded_draws(t, t_mesh("cpu", (world,)), _random_recipes)
    for first, second in (mine, theirs):
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b)
    mesh = ours.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    replicated = ours.distribute_tensor(torch.empty(4, 4), mesh, [ours.Replicate()]).uniform_().to_local()
    assert torch.equal(mine[0][0], replicated)
    assert not torch.equal(mine[0][0][:2], mine[0][0][2:])
    # a generator= draws from that generator and advances it, as torch's does
    g = torch.Generator().manual_seed(3)
    x = ours.distribute_tensor(torch.empty(4, 4), mesh, [ours.Shard(0)]).uniform_(generator=g).full_tensor()
    g2 = torch.Generator().manual_seed(3)
    y = ours.distribute_tensor(torch.empty(4, 4), mesh, [ours.Replicate()]).uniform_(generator=g2).full_tensor()
    assert torch.equal(x, y) and torch.equal(g.get_state(), g2.get_state())
    assert not torch.equal(g.get_state(), torch.Generator().manual_seed(3).get_state())
    return True


def test_reseeding_torch_reproduces_random_ops_dropout_and_init_as_torch(ranks):
    ranks(2).run(_check_reseeding_reproduces_as_torch)


def _check_fully_shard_init_reproduces():
    """nn.init on fully_shard parameters after torch.manual_seed: reseeded, the same values; and the
    values a single process draws with Replicate placements (sharding-independent)."""
    world = dist.get_world_size()
    mesh = ours.init_device_mesh("cpu", (world,))

    def init():
        model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
        fully_shard(model, mesh=mesh)
        torch.manual_seed(11)
        with torch.no_grad():
            for m in model:
                m.reset_parameters()
        return {n: p.full_tensor() for n, p in model.named_parameters()}

    a, b = init(), init()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    return True


def test_nn_init_on_fully_shard_parameters_reproduces_after_reseeding(ranks):
    ranks(2).run(_check_fully_shard_init_reproduces)


def _check_random_op_on_shards_against_torch():
    """Why ours differs from torch's DTensor RNG (docs/compat.md): on a CPU mesh torch 2.13 has none
    (its OffsetBasedRNGTracker needs CUDA), so after torch.manual_seed(s) on every rank a random op on
    a Shard(0) DTensor draws each rank's own generator: every piece holds the same numbers, and the
    global tensor is not one that a single device draws. Ours: pieces differ, and the global tensor
    is the one fully replicated placements draw."""
    import warnings

    import torch.distributed.tensor as t

    world = dist.get_world_size()
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "DTensor random operators may not have complete support on cpu"
        theirs = t.distribute_tensor(torch.zeros(4 * world, 3), t.init_device_mesh("cpu", (world,)), [t.Shard(0)])
        theirs = theirs.uniform_().full_tensor()
    torch.manual_seed(3)
    assert torch.equal(theirs[:4], torch.rand(4, 3))  # rank 0's generator, on every rank...
    assert all(torch.equal(theirs[:4], theirs[4 * r : 4 * r + 4]) for r in range(world))  # ...repeated
    mesh = ours.init_device_mesh("cpu", (world,))
    ours.random.manual_seed(3)
    sharded = ours.distribute_tensor(torch.zeros(4 * world, 3), mesh, [ours.Shard(0)]).uniform_().full_tensor()
    ours.random.manual_seed(3)
    replicated = ours.distribute_tensor(torch.zeros(4 * world, 3), mesh, [ours.Replicate()]).uniform_().full_tensor()
    assert torch.equal(sharded, replicated) and not torch.equal(sharded[:4], sharded[4:8])
    return True


def test_a_random_op_on_shards_differs_from_torchs_cpu_dtensor_where_torch_repeats_pieces(ranks):
    ranks(2).run(_check_random_op_on_shards_against_torch)


# ---- layouts of pointwise ops and of gradients ------------------------------------------------------


def _check_layouts():
    world = dist.get_world_size()
    full_a = torch.arange(24.0).reshape(4, 6)
    full_b = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    results = []
    for api, mesh in _both(world):
        R, S = api.Replicate(), api.Shard
        out = {}
        a = api.distribute_tensor(full_a, mesh, [R])
        b = api.distribute_tensor(full_b, mesh, [S(0)])
        out["R*S"] = _names((a * b).placements), (a * b).full_tensor()
        out["S*R"] = _names((b * a).placements), (b * a).full_tensor()
        c = api.distribute_tensor(full_b, mesh, [S(1)])
        out["S0+S1"] = (b + c).full_tensor()
        for name, fn in (
            ("leaf*leaf", lambda x: (x * x).mean()),
            ("leaf*R", lambda x, a=a: (x * a).sum()),
            ("R*leaf", lambda x, a=a: (a * x).sum()),
            ("leaf.exp", lambda x: x.exp().sum()),
        ):
            leaf = api.distribute_tensor(full_b, mesh, [S(0)]).requires_grad_()
            fn(leaf).backward()
            out[name] = _names(leaf.grad.placements), leaf.grad.full_tensor()
        r = api.distribute_tensor(torch.randn(3, 2, generator=torch.Generator().manual_seed(1)), mesh, [R])
        out["t.stride"] = r.t().stride(), r.t().to_local().stride()
        out["t.reshape"] = r.t().reshape(-1).full_tensor()
        out["t.contiguous.stride"] = r.t().contiguous().stride()
        results.append(out)
    mine, theirs = results
    for key, value in theirs.items():
        got = mine[key]
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.Tensor):
            assert got[0] == value[0], (key, got[0], value[0])
            torch.testing.assert_close(got[1], value[1], rtol=0, atol=1e-6)
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(got, value, rtol=0, atol=1e-6)
        else:
            assert got == value, (key, got, value)
    return True


def test_pointwise_and_gradient_layouts_and_view_strides_match_torch(ranks):
    ranks(2).run(_check_layouts)


def _check_foreach_layouts():
    mesh = ours.init_device_mesh("cpu", (dist.get_world_size(),))
    t, t_mesh = _torch()
    tm = t_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(2)
    fulls = [torch.randn(5, 3, generator=g) for _ in range(3)]
    placements = [[ours.Shard(0)], [ours.Replicate()], [ours.Shard(1)]]
    mine = [ours.distribute_tensor(f, mesh, p) for f, p in zip(fulls, placements)]
    theirs = [t.distribute_tensor(f, tm, [t.Shard(0)] if i == 0 else [t.Replicate()] if i == 1 else [t.Shard(1)])
              for i, f in enumerate(fulls)]
    for xs in (mine, theirs):
        torch._foreach_mul_(xs, 2.0)
        torch._foreach_add_(xs, xs)
    outs = [torch._foreach_sqrt(xs) for xs in (mine, [x.abs() for x in theirs])]
    for a, b in zip(mine, theirs):
        assert _names(a.placements) == _names(b.placements)
        torch.testing.assert_close(a.full_tensor(), b.full_tensor())
    for a in outs[0]:
        assert isinstance(a, ours.DTensor)
    return True


def test_foreach_ops_keep_each_tensor_layout_as_torch(ranks):
    ranks(2).run(_check_foreach_layouts)


# ---- writes through views and in-place metadata changes ------------------------------------------


def _check_view_writes():
    world = dist.get_world_size()
    (_, mesh), (t, t_mesh) = _both(world)
    R, S = ours.Replicate(), ours.Shard
    # A local view aliases the shards: the write reaches x, as in torch.
    x = ours.distribute_tensor(torch.arange(8.0), mesh, [S(0)])
    tx = t.distribute_tensor(torch.arange(8.0), t_mesh, [t.Shard(0)])
    x.view(-1).mul_(2)
    tx.view(-1).mul_(2)
    assert x.full_tensor().tolist() == tx.full_tensor().tolist() == [2.0 * i for i in range(8)]
    # through views that merge or split the sharded dim (even shards): as torch, the writes land
    for recipe in (lambda v: v.view(-1).add_(1), lambda v: v.view(8, 3).mul_(2), lambda v: v.view(4, 3, 2).mul_(2)):
        a = ours.distribute_tensor(torch.arange(24.0).reshape(4, 6), mesh, [S(0)])
        ta = t.distribute_tensor(torch.arange(24.0).reshape(4, 6), t_mesh, [t.Shard(0)])
        recipe(a)
        recipe(ta)
        assert a.full_tensor().tolist() == ta.full_tensor().tolist() != torch.arange(24.0).reshape(4, 6).tolist()
    flat = ours.distribute_tensor(torch.arange(24.0), mesh, [S(0)])
    flat.view(4, 6).mul_(2)  # a split whose outer part takes the shard
    assert flat.full_tensor().tolist() == [2.0 * i for i in range(24)]
    # uneven shards do not line up with the merged dim's chunks: gathered, so a write raises
    uneven = ours.distribute_tensor(torch.arange(30.0).reshape(5, 6), mesh, [S(0)])
    with pytest.raises(NotImplementedError, match="not a view of its input"):
        uneven.view(-1).add_(1)
    y = ours.distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [S(1)])
    with pytest.raises(NotImplementedError, match="not a view of its input"):
        y.view(-1).mul_(2)  # S(1) must be gathered for view(-1): the write would be lost
    assert y.full_tensor().tolist() == torch.arange(8.0).reshape(2, 4).tolist()
    z = ours.distribute_tensor(torch.arange(8.0), mesh, [S(0)])
    tz = t.distribute_tensor(torch.arange(8.0), t_mesh, [t.Shard(0)])
    tz[1] = 7  # torch's DTensor silently drops this write ...
    assert tz.full_tensor().tolist() == torch.arange(8.0).tolist()
    with pytest.raises(NotImplementedError, match="not a view of its input"):
        z[1] = 7  # ... ours refuses it
    # In-place shape changes raise in both.
    r = ours.distribute_tensor(torch.arange(4.0), mesh, [R])
    tr = t.distribute_tensor(torch.arange(4.0), t_mesh, [t.Replicate()])
    for tensor in (r, tr):
        with pytest.raises(NotImplementedError, match="unsqueeze_"):
            tensor.unsqueeze_(0)
    assert r.shape == (4,) and r.to_local().shape == (4,)
    r[1] = 7  # replicated: the write is local and exact
    tr[1] = 7
    assert r.full_tensor().tolist() == tr.full_tensor().tolist() == [0.0, 7.0, 2.0, 3.0]
    return True


def test_writes_through_views_apply_or_raise(ranks):
    ranks(2).run(_check_view_writes)


# ---- from_local ----------------------------------------------------------------------------------


def _check_from_local():
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for api, mesh in _both(world):
        local = torch.full((2,), float(rank))
        results.append(api.DTensor.from_local(local, mesh, [api.Replicate()], run_check=True).to_local())
        if api is ours:  # torch broadcasts into the caller's tensor; ours leaves it alone
            assert local.tolist() == [float(rank)] * 2
    torch.testing.assert_close(results[0], results[1])
    assert results[0].tolist() == [0.0, 0.0]
    # The gradient of a Partial from_local is Replicate by default and with grad_placements=[R].
    grads = []
    for api, mesh in _both(world):
        for gp in (None, [api.Replicate()]):
            leaf = torch.arange(4.0, requires_grad=True)
            d = api.DTensor.from_local(leaf * (rank + 1), mesh, [api.Partial()], grad_placements=gp)
            (d.redistribute(mesh, [api.Replicate()]) * 3).sum().backward()
            grads.append(leaf.grad)
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0])
    mesh = ours.init_device_mesh("cpu", (world,))
    t, _ = _torch()
    # Torch placements are accepted where ours are expected (code written for torch's DTensor).
    e = ours.distribute_tensor(torch.arange(6.0), mesh, [t.Shard(0)])
    assert e.placements == (ours.Shard(0),)
    # redistribute(forward_dtype=, backward_dtype=)
    src = ours.distribute_tensor(torch.arange(6.0), mesh, [ours.Shard(0)]).requires_grad_()
    out = src.redistribute(mesh, [ours.Replicate()], forward_dtype=torch.float64, backward_dtype=torch.float64)
    assert out.dtype == torch.float64
    out.sum().backward()
    assert src.grad.dtype == torch.float32 and src.grad.full_tensor().tolist() == [1.0] * 6
    return True


def test_from_local_run_check_and_grad_placements_and_redistribute_dtypes(ranks):
    ranks(2).run(_check_from_local)


def _check_from_local_like_torch():
    """Every rank's local gradient for each forward placement x grad_placements, and run_check
    on pieces of different shapes, through torch and ours."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grads, errors = [], []
    for api, mesh in _both(world):
        mine = {}
        placements = {"R": api.Replicate(), "P": api.Partial()}
        for fwd in ("R", "P"):
            for gp in (None, "R", "P"):
                leaf = torch.arange(4.0, requires_grad=True)
                d = api.DTensor.from_local(
                    leaf * (rank + 1), mesh, [placements[fwd]], grad_placements=None if gp is None else [placements[gp]]
                )
                (d.redistribute(mesh, [api.Replicate()]) * 3).sum().backward()
                mine[(fwd, gp)] = leaf.grad
        grads.append(mine)
        with pytest.raises(ValueError, match=r"(?i)inconsistent tensor metadata"):
            api.DTensor.from_local(torch.ones(2 + rank), mesh, [api.Replicate()], run_check=True)
        with pytest.raises(ValueError, match=r"(?i)inconsistent tensor metadata"):  # dtypes differ
            piece = torch.ones(2, dtype=torch.float64 if rank else torch.float32)
            api.DTensor.from_local(piece, mesh, [api.Replicate()], run_check=True)
        errors.append(True)
    for key, ours_grad in grads[0].items():
        torch.testing.assert_close(ours_grad, grads[1][key], msg=f"grad of {key}")
    # a Replicate gradient asked for as Partial: divided on every rank (times this rank's factor)
    assert grads[0][("R", "P")].tolist() == [3.0 * (rank + 1) / world] * 4
    return True


def test_from_local_gradients_and_run_check_are_torchs(ranks):
    ranks(2).run(_check_from_local_like_torch)


# ---- copies, pickles and torch.save ------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _check_copies():
    world = dist.get_world_size()
    mesh = ours.init_device_mesh("cpu", (world,))
    x = ours.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [ours.Shard(0)])
    p = nn.Parameter(ours.distribute_tensor(torch.arange(6.0), mesh, [ours.Shard(0)]))
    for copied in (copy.deepcopy(x), pickle.loads(pickle.dumps(x))):
        assert isinstance(copied, ours.DTensor) and copied.placements == x.placements
        assert copied.device_mesh is mesh  # re-bound to this process's mesh and groups
        assert torch.equal(copied.full_tensor(), x.full_tensor())
        assert copied._local_tensor.data_ptr() != x._local_tensor.data_ptr()
    q = copy.deepcopy(p)
    assert isinstance(q, nn.Parameter) and isinstance(q, ours.DTensor) and q.requires_grad
    assert copy.deepcopy(mesh) is mesh and pickle.loads(pickle.dumps(mesh)) is mesh
    sub = ours.init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    assert pickle.loads(pickle.dumps(sub["tp"])) == sub["tp"]

    # torch.save(model.state_dict()) of a fully_shard model, loaded with torch.load's defaults.
    torch.manual_seed(0)
    model = fully_shard(_MLP(), mesh=mesh)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True
    for k, v in model.state_dict().items():
        assert isinstance(loaded[k], ours.DTensor) and torch.equal(loaded[k].full_tensor(), v.full_tensor())
    fresh = fully_shard(_MLP(), mesh=mesh)
    fresh.load_state_dict(loaded)
    inp = torch.randn(2, 4)
    torch.testing.assert_close(fresh(inp), model(inp))
    # An EMA / eval copy: copy the module before fully_shard, or deep-copy a tensor-parallel one;
    # deep-copying a fully_shard module raises as torch's does.
    with pytest.raises(AssertionError, match="deepcopy"):
        copy.deepcopy(model)
    with pytest.raises(pickle.PicklingError, match="state_dict"):
        pickle.dumps(model)
    from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = parallelize_module(_MLP(), mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})
    ema = copy.deepcopy(tp)
    torch.testing.assert_close(ema(inp), tp(inp))
    assert all(isinstance(p, ours.DTensor) for p in ema.parameters())
    assert all(
        p._local_tensor.data_ptr() != q._local_tensor.data_ptr()
        for p, q in zip(ema.parameters(), tp.parameters())
    )
    return True


def test_deepcopy_pickle_and_torch_save(ranks):
    ranks(2).run(_check_copies)


# ---- torch's state-dict helpers on our fully_shard model ------------------------------------------


def _check_state_dict_helpers(world_opts):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ours.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = _MLP()
    model = copy.deepcopy(base)
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(1))
    model(x[rank * 4 : rank * 4 + 4]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=full_opts)
    osd = get_optimizer_state_dict(model, opt, options=full_opts)
    expected = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        assert sd.keys() == base.state_dict().keys()
        for k, v in sd.items():
            assert type(v) is torch.Tensor and v.shape == base.state_dict()[k].shape and v.device.type == "cpu"
            torch.testing.assert_close(v, expected[k])
        for state in osd["state"].values():
            assert all(type(v) is torch.Tensor for v in state.values())
    else:
        assert sd == {}  # cpu_offload: rank 0 only, as torch
    everywhere = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    # Plain tensors (AdamW's "step") come back as the optimizer's own objects, in torch too:
    # copy, as a load from disk would, so the two optimizers below do not share step counters.
    full_osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)))

    # Round trip into a fresh model and optimizer from full state dicts.
    torch.manual_seed(5)
    fresh = _MLP()
    fully_shard(fresh.a, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    set_model_state_dict(fresh, everywhere, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(fresh, fresh_opt, full_osd, options=StateDictOptions(full_state_dict=True))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k].full_tensor(), v.full_tensor())
    for p, q in zip(fresh.parameters(), model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            mine, theirs = fresh_opt.state[p][key], opt.state[q][key]
            assert isinstance(mine, ours.DTensor) and mine.placements == theirs.placements
            torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor())
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert float(fresh_opt.state[p]["step"]) == float(opt.state[q]["step"])
    # Both continue identically.
    for m in (model, fresh):
        m(x[rank * 4 : rank * 4 + 4]).pow(2).mean().backward()
    for p, q in zip(fresh.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor())
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert [id(p) for p in fresh_opt.param_groups[0]["params"]] == [id(p) for p in fresh.parameters()]
    for o in (opt, fresh_opt):
        o.step()
    for p, q in zip(fresh.parameters(), model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = fresh_opt.state[p][key], opt.state[q][key]
            a = a.full_tensor() if isinstance(a, ours.DTensor) else a
            b = b.full_tensor() if isinstance(b, ours.DTensor) else b
            torch.testing.assert_close(a, b, msg=key)
    for p, q in zip(fresh.parameters(), model.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor())
    # Sharded (default) options keep our DTensors.
    sharded = get_model_state_dict(model)
    assert all(isinstance(v, ours.DTensor) for v in sharded.values())
    return True


def test_torch_state_dict_helpers_full_and_round_trip(ranks):
    ranks(2).run(_check_state_dict_helpers, None)


def _check_broadcast_from_rank0():
    """torch's load recipe for a checkpoint only rank 0 read: set_model_state_dict /
    set_optimizer_state_dict(broadcast_from_rank0=True) with rank 0's full state dicts (the other
    ranks pass empty ones); every rank gets its shard of parameters and optimizer states, and
    training continues as the source model's."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ours.init_device_mesh("cpu", (world,))

    def build(seed):
        torch.manual_seed(seed)
        model = _MLP()
        fully_shard(model.a, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = build(0)
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(1))[rank * 4 : rank * 4 + 4]
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    on_rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=on_rank0)
    osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=on_rank0))
    assert (msd == {}) == (rank != 0)

    fresh, fresh_opt = build(5 + rank)  # different weights on every rank before the load
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, msd, options=load)
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=load)
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        assert isinstance(p, ours.DTensor) and p.placements == q.placements
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            mine, theirs = fresh_opt.state[p][key], opt.state[q][key]
            assert isinstance(mine, ours.DTensor) and mine.placements == theirs.placements, key
            torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor(), rtol=0, atol=0)
        assert float(fresh_opt.state[p]["step"]) == float(opt.state[q]["step"])
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0)
    return True


def test_torch_state_dict_broadcast_from_rank0(ranks):
    ranks(2).run(_check_broadcast_from_rank0)


# ---- views of non-contiguous DTensors ------------------------------------------------------------


def _check_views_of_non_contiguous():
    world = dist.get_world_size()
    outcomes = []
    for api, mesh in _both(world):
        mine = {}
        for name, placement in (("R", api.Replicate()), ("S0", api.Shard(0))):
            x = api.distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [placement])
            try:
                x.t().view(-1)
                mine[name] = "viewed"
            except RuntimeError:
                mine[name] = "refused"
            mine[name + " reshape"] = x.t().reshape(-1).full_tensor().tolist()
            mine[name + " contiguous view"] = x.t().contiguous().view(-1).full_tensor().tolist()
        outcomes.append(mine)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0]["R"] == "refused" and outcomes[0]["R reshape"] == torch.arange(12.0).reshape(4, 3).t().reshape(-1).tolist()
    return True


def test_a_view_torch_cannot_make_is_refused_as_torch_refuses_it(ranks):
    ranks(2).run(_check_views_of_non_contiguous)


# ---- factories: zeros / ones / empty / full / rand / randn ------------------------------------------


def _check_factories():
    t, t_mesh = _torch()
    layouts = []
    for api, mesh in ((ours, ours.init_device_mesh("cpu", (2, 2))), (t, t_mesh("cpu", (2, 2)))):
        got = {}
        for placements in ((api.Shard(0), api.Shard(1)), (api.Replicate(), api.Shard(0)), (api.Partial(), api.Replicate())):
            for name, make in {
                "zeros": lambda p, a=api, m=mesh: a.zeros(5, 3, device_mesh=m, placements=p),
                "ones(size tuple)": lambda p, a=api, m=mesh: a.ones((5, 3), device_mesh=m, placements=p, dtype=torch.float64),
                "full": lambda p, a=api, m=mesh: a.full((5, 3), 2.5, device_mesh=m, placements=p, requires_grad=True),
                "empty": lambda p, a=api, m=mesh: a.empty(5, 3, device_mesh=m, placements=p),
            }.items():
                x = make(placements)
                full = x.full_tensor() if name != "empty" else None
                got[(name, _names(placements))] = (
                    tuple(x.shape), tuple(x.to_local().shape), x.to_local().stride(), _names(x.placements),
                    x.dtype, x.requires_grad, None if full is None else full.tolist(),
                )  # fmt: skip
        layouts.append(got)
    # rand / randn: torch 2.13 has no DTensor RNG on a CPU mesh (its factory raises AssertionError);
    # ours has the layout of zeros, and values that do not depend on the placements
    mesh = ours.init_device_mesh("cpu", (2, 2))
    draws = []
    for placements in ((ours.Shard(0), ours.Shard(1)), (ours.Replicate(), ours.Replicate())):
        ours.random.manual_seed(7)
        x = ours.randn(5, 3, device_mesh=mesh, placements=placements)
        zeros = ours.zeros(5, 3, device_mesh=mesh, placements=placements)
        assert x.to_local().shape == zeros.to_local().shape and x.placements == zeros.placements
        assert float(ours.rand(5, 3, device_mesh=mesh, placements=placements).full_tensor().min()) >= 0
        draws.append(x.full_tensor())
    with pytest.raises(ValueError, match="need device_mesh"):
        ours.zeros(2, 2)
    with pytest.raises(NotImplementedError, match="random values on a Partial DTensor are not defined"):
        ours.randn(5, 3, device_mesh=mesh, placements=(ours.Partial(), ours.Replicate()))
    return layouts, torch.equal(draws[0], draws[1]) and draws[0].std() > 0.1


def test_factories_give_torchs_layouts_and_values(ranks):
    for (mine, theirs), same_draw in ranks(4).run(_check_factories):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert mine[key] == theirs[key], (key, mine[key], theirs[key])
        assert same_draw


# ---- norms over a dim, F.normalize, scatter_add: values, layouts, gradients ----------------------------


def _check_norms_and_scatter_add():
    import torch.nn.functional as F

    world = dist.get_world_size()
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))  # 5 rows: uneven
    idx = torch.tensor([[0, 1, 2, 0, 1, 2]] * 5)
    src = torch.ones(5, 6)
    norms = {
        "F.normalize(dim=1)": lambda z: F.normalize(z, dim=1),
        "F.normalize(dim=0)": lambda z: F.normalize(z, dim=0),
        "norm(dim=0)": lambda z: z.norm(dim=0),
        "vector_norm(inf, dim=1)": lambda z: torch.linalg.vector_norm(z, float("inf"), dim=1),
        "vector_norm(1, dim=(0, 1), keepdim)": lambda z: torch.linalg.vector_norm(z, 1, dim=(0, 1), keepdim=True),
    }
    results = []
    for api, mesh in _both(world):
        out = {}
        for placement in (api.Shard(0), api.Shard(1), api.Replicate()):
            for name, op in norms.items():
                x = api.distribute_tensor(full, mesh, [placement]).requires_grad_()
                y = op(x)
                y.sum().backward()
                layout = _names(y.placements) if name.startswith("F.") or placement == api.Replicate() else None
                out[(name, _names([placement]))] = (layout, y.full_tensor().detach(), x.grad.full_tensor())
            for dim in (0, 1):
                for ip in (api.Shard(0), api.Shard(1), api.Replicate()):
                    x = api.distribute_tensor(full, mesh, [placement]).requires_grad_()
                    s = api.distribute_tensor(src, mesh, [ip]).requires_grad_()
                    i = api.distribute_tensor(idx % 5 if dim == 0 else idx, mesh, [ip])
                    y = x.scatter_add(dim, i, s)
                    (y * y).sum().backward()
                    key = (f"scatter_add({dim})", _names([placement]), _names([ip]))
                    out[key] = (_names(y.placements), y.full_tensor().detach(), x.grad.full_tensor(), s.grad.full_tensor())
        results.append(out)
    return results


def test_norms_over_a_dim_normalize_and_scatter_add_match_torch(ranks):
    """Norms over a sharded dim: ours is Replicate where torch leaves its private norm-Partial
    (the same values once reduced); every other layout, value and gradient is torch's."""
    for mine, theirs in ranks(2).run(_check_norms_and_scatter_add):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert mine[key][0] == theirs[key][0], (key, mine[key][0], theirs[key][0])
            for a, b in zip(mine[key][1:], theirs[key][1:], strict=True):
                torch.testing.assert_close(a, b, msg=str(key))


# ---- a Partial result fed to other ops, and the nan-reductions ---------------------------------------

# op -> placements ours gives where torch's differ with the same values: torch keeps a Shard from the
# reduced input where ours gathers (sort, topk), or ours keeps a valid Partial that torch reduces.
_PARTIAL_FED = {
    "relu": torch.relu, "gelu": nn.functional.gelu, "silu": nn.functional.silu, "exp": torch.exp,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "abs": torch.abs, "square": torch.square,
    "pow": lambda x: x.pow(3), "sign": torch.sign, "clamp": lambda x: x.clamp(-0.5, 0.5),
    "where": lambda x: torch.where(x > 0, x, 0.0), "eq": lambda x: x == 0,
    "reciprocal": lambda x: 1 / (x.abs() + 1), "x + 1": lambda x: x + 1, "x - 2.5": lambda x: x - 2.5,
    "x * x": lambda x: x * x, "x + x": lambda x: x + x, "neg": torch.neg, "x * 2": lambda x: x * 2,
    "softmax(0)": lambda x: x.softmax(0), "softmax(1)": lambda x: x.softmax(1),
    "log_softmax(1)": lambda x: nn.functional.log_softmax(x, 1),
    "layer_norm": lambda x: nn.functional.layer_norm(x, (x.shape[-1],)),
    "sum": lambda x: x.sum(), "sum(0)": lambda x: x.sum(0), "mean": lambda x: x.mean(),
    "amax(1)": lambda x: x.amax(1), "max": lambda x: x.max(), "argmax(1)": lambda x: x.argmax(1),
    "norm": lambda x: x.norm(), "norm(dim=1)": lambda x: x.norm(dim=1), "var(1)": lambda x: x.var(1),
    "cumsum(1)": lambda x: x.cumsum(1), "sort(1)": lambda x: x.sort(1)[0], "topk(2, 1)": lambda x: x.topk(2, 1)[0],
    "logsumexp(1)": lambda x: x.logsumexp(1), "prod(1)": lambda x: x.prod(1), "prod": lambda x: x.prod(),
    "nansum": lambda x: x.nansum(), "nanmean": lambda x: x.nanmean(), "median": lambda x: x.median(),
    "median(1)": lambda x: x.median(1)[0], "nanmedian(0)": lambda x: x.nanmedian(0)[0],
}  # fmt: skip
_PARTIAL_FED_LAYOUT_DIFFERS = {"mean": ("Partial",), "x * x": ("Replicate",), "cumsum(1)": ("Partial",), "sort(1)": ("Replicate",),
                               "topk(2, 1)": ("Replicate",), "nansum": ("Replicate",), "nanmean": ("Replicate",)}  # fmt: skip


def _check_partial_fed_ops():
    """``a @ b`` with ``a`` Shard(1) and ``b`` Shard(0) is a Partial sum; every op fed with it
    gives torch's values, and torch's placement except where listed (values equal there)."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    a_full, b_full = torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g)
    results = []
    for api, mesh in _both(world):
        out = {}
        for name, op in _PARTIAL_FED.items():
            y = api.distribute_tensor(a_full, mesh, [api.Shard(1)]) @ api.distribute_tensor(
                b_full, mesh, [api.Shard(0)]
            )
            assert type(y.placements[0]).__name__ == "Partial"
            r = op(y)
            out[name] = (tuple(type(p).__name__ for p in r.placements), r.full_tensor())
        results.append(out)
    plain = {name: op(a_full @ b_full) for name, op in _PARTIAL_FED.items()}
    return results, plain


def test_a_partial_result_fed_to_any_op_is_reduced_where_torch_reduces_it(ranks):
    (mine, theirs), plain = ranks(2).run(_check_partial_fed_ops)[0]
    for name in _PARTIAL_FED:
        expected = _PARTIAL_FED_LAYOUT_DIFFERS.get(name, theirs[name][0])
        assert mine[name][0] == expected, (name, mine[name][0], theirs[name][0])
        torch.testing.assert_close(mine[name][1], theirs[name][1], msg=name)
        torch.testing.assert_close(mine[name][1], plain[name], msg=name)


def _check_nan_reductions():
    """nansum / nanmean / nanmedian on Shard(0) (uneven), Shard(1) and Replicate DTensors holding
    NaNs: the plain tensor's values, as torch's DTensor gives them. (nanquantile / quantile are
    refused: torch's decomposition squeezes a DTensor in place, docs/compat.md.)"""
    world = dist.get_world_size()
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    full[1, 2] = full[4, 0] = full[3, 5] = float("nan")
    ops = {
        "nansum": lambda x: x.nansum(), "nansum(0)": lambda x: x.nansum(0), "nansum(1, keepdim)": lambda x: x.nansum(1, keepdim=True),
        "nanmean": lambda x: x.nanmean(), "nanmean(0)": lambda x: x.nanmean(0), "nanmean(1)": lambda x: x.nanmean(1),
        "nanmedian": lambda x: x.nanmedian(), "nanmedian(0)": lambda x: x.nanmedian(0)[0], "nanmedian(1)": lambda x: x.nanmedian(1)[0],
    }  # fmt: skip
    results = []
    for api, mesh in _both(world):
        out = {}
        for placement in (api.Shard(0), api.Shard(1), api.Replicate()):
            for name, op in ops.items():
                x = api.distribute_tensor(full, mesh, [placement])
                try:
                    out[(str(placement), name)] = op(x).full_tensor()
                except Exception as e:  # torch's refusals are recorded, not ours
                    out[(str(placement), name)] = type(e).__name__
        results.append(out)
    return results, {name: op(full) for name, op in ops.items()}


def test_nan_reductions_on_sharded_dtensors_equal_the_plain_tensor(ranks):
    (mine, theirs), plain = ranks(2).run(_check_nan_reductions)[0]
    for (placement, name), value in mine.items():
        assert isinstance(value, torch.Tensor), (placement, name, value, theirs[(placement, name)])
        torch.testing.assert_close(value, plain[name], equal_nan=True, msg=f"{placement} {name}")
        if isinstance(theirs[(placement, name)], torch.Tensor):
            torch.testing.assert_close(value, theirs[(placement, name)], equal_nan=True, msg=f"{placement} {name}")


def _check_nan_through_max_and_min():
    """A NaN in one rank's piece of a max / min reduction is the result, as ``torch.amax`` keeps
    it: the backends' max and min compare and drop it (gloo, and NCCL's ``fmaxf``), which made
    ``masked.amax`` / ``masked.norm(inf)`` on Shard(0) silently finite in torch's sweep, torch's
    DTensor included. Reductions of sharded dims, inf-norms, and a Partial(max) reduced to
    Replicate (all-reduce) and to Shard(1) (reduce-scatter)."""
    world = dist.get_world_size()
    mesh = ours.init_device_mesh("cpu", (world,))
    full = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    # a NaN on rank 0's rows in every other column and on the last rank's in the rest: which
    # operand a backend's max keeps depends on the position and the values
    full[0, ::2] = full[5, 1::2] = float("nan")
    full[1, 1] = full[4, 6] = 1e3
    ops = {
        "amax(0)": lambda x: x.amax(0, keepdim=True), "amin(0)": lambda x: x.amin(0),
        "amax(1)": lambda x: x.amax(1), "amax()": lambda x: x.amax(), "max(0)": lambda x: x.max(0).values,
        "min()": lambda x: x.min(),
        "norm(inf, 0)": lambda x: torch.linalg.vector_norm(x, float("inf"), 0),
        "norm(-inf, 0)": lambda x: torch.linalg.vector_norm(x, float("-inf"), 0, keepdim=True),
        "norm(inf)": lambda x: torch.linalg.vector_norm(x, float("inf")),
        "masked.amax": lambda x: torch.masked.amax(x, 0, keepdim=True),
    }  # fmt: skip
    for name, op in ops.items():
        want = op(full)
        for placement in (ours.Shard(0), ours.Shard(1), ours.Replicate()):
            got = op(ours.distribute_tensor(full, mesh, [placement])).full_tensor()
            torch.testing.assert_close(got, want, equal_nan=True, msg=f"{name} {placement}")
    rank = dist.get_rank()
    piece = torch.arange(8.0).reshape(2, 4) + rank  # Partial(max) of each rank's piece, one NaN on the last
    if rank == world - 1:
        piece[1, 0] = float("nan")
    want = torch.stack([torch.arange(8.0).reshape(2, 4) + r for r in range(world)]).amax(0)
    want[1, 0] = float("nan")
    partial = ours.DTensor.from_local(piece, mesh, [ours.Partial("max")])
    for target in (ours.Replicate(), ours.Shard(1), ours.Shard(0)):
        got = partial.redistribute(mesh, [target]).full_tensor()
        torch.testing.assert_close(got, want, equal_nan=True, msg=str(target))
    return True


def test_a_nan_in_one_ranks_piece_survives_max_and_min_reductions(ranks):
    ranks(2).run(_check_nan_through_max_and_min)


def _check_dtypes_the_backends_do_not_carry():
    """int16 / uint16 / uint32 / uint64 / float8 DTensors gather, scatter, all-to-all and reduce
    like the others (gloo has no such types: ``x.short()`` of a Shard(0) DTensor crashed in
    ``full_tensor``, torch's DTensor as well). Values: the plain tensor's, sums wrapping as the
    narrow type's own sum does; a reduction no wire type can carry (uint64 max) is refused."""
    world = dist.get_world_size()
    mesh = ours.init_device_mesh("cpu", (world,))
    full = torch.arange(-7, 8).reshape(5, 3) * 4000  # past int16's range once summed over ranks
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn):
        x = full.abs().to(dtype) if dtype in (torch.uint16, torch.uint32, torch.uint64) else full.to(dtype)
        if dtype == torch.float8_e4m3fn:
            x = (full / 4000).to(dtype)
        as_int = x.view(torch.uint8) if dtype == torch.float8_e4m3fn else x
        sharded = ours.distribute_tensor(x, mesh, [ours.Shard(0)])
        assert torch.equal(sharded.full_tensor().view(as_int.dtype), as_int), dtype
        moved = sharded.redistribute(mesh, [ours.Shard(1)])  # all-to-all
        assert torch.equal(moved.full_tensor().view(as_int.dtype), as_int), dtype
        assert torch.equal(sharded.to_local().view(as_int.dtype), as_int.tensor_split(world)[dist.get_rank()]), dtype
        if dtype == torch.float8_e4m3fn:
            continue
        partial = ours.DTensor.from_local(x, mesh, [ours.Partial("sum")])
        want = x.to(torch.int64).mul(world).to(dtype)  # the narrow type's wrap-around
        assert torch.equal(partial.full_tensor(), want), dtype
        assert torch.equal(partial.redistribute(mesh, [ours.Shard(0)]).full_tensor(), want), dtype
        if dtype != torch.uint64:
            wide = x.to(torch.int64)  # no add for uint16 / uint32
            top = ours.DTensor.from_local((wide + dist.get_rank()).to(dtype), mesh, [ours.Partial("max")])
            assert torch.equal(top.full_tensor(), (wide + world - 1).to(dtype)), dtype
    with pytest.raises(TypeError, match=r"max reduction of torch\.uint64"):
        ours.DTensor.from_local(torch.ones(2, dtype=torch.uint64), mesh, [ours.Partial("max")]).full_tensor()
    return True


def test_dtypes_the_backends_do_not_carry_move_and_reduce_exactly(ranks):
    ranks(2).run(_check_dtypes_the_backends_do_not_carry)


# ---- what torch's full op sweep found: uneven shards of one row, keepdim norms, 0-d transposes -------


def _check_sweep_findings():
    """Each was silent or killed a rank under torch's test_dtensor_ops samples: ``squeeze()`` of a
    Shard(0) tensor whose rank holds one row squeezed that rank's piece (then ``cov`` killed a
    rank in the gather); ``linalg.norm(x, 2, keepdim=True)`` of a whole 1-D tensor was 0-d;
    ``transpose(0, 0)`` of a 0-d tensor raised IndexError. Values and shapes: the plain op's."""
    world = dist.get_world_size()
    mesh = ours.init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(4)
    cases = {
        "squeeze()": (torch.randn(3, 3, generator=g), lambda t: t.squeeze()),
        "squeeze(0)": (torch.randn(3, 1, 2, generator=g), lambda t: t.squeeze(0)),
        "squeeze(1)": (torch.randn(3, 1, 2, generator=g), lambda t: t.squeeze(1)),
        "cov": (torch.randn(3, 2, generator=g), torch.cov),
        "normalize": (torch.randn(3, 5, generator=g), lambda t: nn.functional.normalize(t, dim=0)),
        "linalg.norm(keepdim)": (torch.randn(5, generator=g), lambda t: torch.linalg.norm(t, 2, keepdim=True)),
        "vector_norm(keepdim)": (torch.randn(3, 4, generator=g), lambda t: torch.linalg.vector_norm(t, 1, keepdim=True)),
        "transpose 0-d": (torch.tensor(2.0), lambda t: t.transpose(0, -1)),
    }
    for name, (full, op) in cases.items():
        want = op(full)
        for placement in (ours.Replicate(), ours.Shard(0)):
            if full.ndim == 0 and placement != ours.Replicate():
                continue
            got = op(ours.distribute_tensor(full, mesh, [placement])).full_tensor()
            assert got.shape == want.shape, (name, placement, got.shape, want.shape)
            torch.testing.assert_close(got, want, msg=f"{name} {placement}")
    with pytest.raises(IndexError, match="Dimension out of range"):  # torch's error, as torch raises it
        ours.distribute_tensor(torch.randn(2, 2), mesh, [ours.Shard(0)]).transpose(0, 5)
    return True


def test_ops_torchs_sweep_found_silent_or_crashing_give_the_plain_ops_values(ranks):
    ranks(2).run(_check_sweep_findings)


def _check_one_element_plain_tensors():
    """A plain 1-d tensor of one element beside DTensors, top-level or in a tensor list, is a
    replicated value in torch's DTensor and in ours; ``prod`` (whose decomposition makes one)
    equals the plain op. One that requires a gradient is refused by ours, naming its shape."""
    import warnings

    world = dist.get_world_size()
    full = torch.arange(1.0, 7.0).reshape(3, 2)
    results = []
    for api, mesh in _both(world):
        x = api.distribute_tensor(full, mesh, [api.Shard(0)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: "Found a non-scalar tensor with numel=1 and ndim!=0"
            results.append({
                "mul": (x * torch.tensor([2.0])).full_tensor(),
                "add": (torch.tensor([0.5]) + x).full_tensor(),
                "prod": x.prod().full_tensor(),
            })  # fmt: skip
    mine, theirs = results
    plain = {"mul": full * 2, "add": full + 0.5, "prod": full.prod()}
    for key, want in plain.items():
        torch.testing.assert_close(mine[key], want, msg=key)
        torch.testing.assert_close(mine[key], theirs[key], msg=key)
    mesh = ours.init_device_mesh("cpu", (world,))
    x = ours.distribute_tensor(full, mesh, [ours.Shard(0)])
    joined = torch.cat([x.reshape(-1), torch.tensor([7.0])]).full_tensor()
    torch.testing.assert_close(joined, torch.arange(1.0, 8.0))
    with pytest.raises(RuntimeError, match=r"torch.Tensor of shape \(1,\)"):
        x * torch.tensor([2.0], requires_grad=True)
    return True


def test_a_one_element_plain_tensor_beside_dtensors_is_replicated_as_in_torch(ranks):
    ranks(2).run(_check_one_element_plain_tensors)


# ---- chunk / split / unbind / tensor_split of sharded dims ------------------------------------------


_SPLITS = {
    "chunk(3, 0)": lambda x: x.chunk(3, 0), "chunk(2, 1)": lambda x: x.chunk(2, 1), "split(4, 0)": lambda x: x.split(4, 0),
    "split([2, 3], 1)": lambda x: x.split([2, 3], 1), "unbind(0)": lambda x: x.unbind(0), "unbind(1)": lambda x: x.unbind(1),
    "tensor_split(3, 1)": lambda x: x.tensor_split(3, 1),
}  # fmt: skip


def _check_splits():
    """Each piece's placements and values, and the gradient's, through torch's DTensor and ours."""
    world = dist.get_world_size()
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(6))
    results = []
    for api, mesh in _both(world):
        out = {}
        for placement in (api.Shard(0), api.Shard(1), api.Replicate()):
            for name, op in _SPLITS.items():
                x = api.distribute_tensor(full, mesh, [placement]).requires_grad_()
                key = (_names([placement]), name)
                try:
                    parts = op(x)
                except RuntimeError as e:  # torch refuses unbind along its sharded dim
                    out[key] = str(e)
                    continue
                out[key] = [(_names(q.placements), q.full_tensor().detach()) for q in parts]
                sum((q * (i + 1)).sum() for i, q in enumerate(parts)).backward()
                out[key + ("grad",)] = (_names(x.grad.placements), x.grad.full_tensor())
        results.append(out)
    return results


def test_chunk_split_unbind_of_sharded_dims_are_torchs_and_unbind_along_a_shard_works(ranks):
    mine, theirs = ranks(2).run(_check_splits)[0]
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(6))
    assert mine.keys() >= theirs.keys()
    for key, want in theirs.items():
        got = mine[key]
        if isinstance(want, str):  # torch: "Attempted to unbind along the sharded dimension"; ours gathers
            assert "unbind along the sharded dimension" in want, want
            plain = full.unbind(int(key[1][-2]))
            assert len(got) == len(plain) and all(torch.equal(g[1], p) for g, p in zip(got, plain, strict=True))
            continue
        if key[-1] == "grad":
            assert got[0] == want[0], key
            torch.testing.assert_close(got[1], want[1], msg=str(key))
            continue
        assert [g[0] for g in got] == [w[0] for w in want], key
        assert all(torch.equal(g[1], w[1]) for g, w in zip(got, want, strict=True)), key


# ---- distribute_module (torch's documented recipe) --------------------------------------------------------


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 6)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def _recipe_fns(api):
    """torch's docs recipe: shard every Linear's parameters on dim 0, replicate the inputs."""

    def shard_params(name, mod, mesh):
        if isinstance(mod, nn.Linear):
            for key, param in mod.named_parameters():
                mod.register_parameter(key, nn.Parameter(api.distribute_tensor(param, mesh, [api.Shard(0)])))

    def input_fn(mod, inputs, mesh):
        return tuple(api.distribute_tensor(i, mesh, [api.Replicate()]) for i in inputs)

    return shard_params, input_fn


def _check_distribute_module():
    import warnings

    world = dist.get_world_size()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    out = []
    for api, mesh in _both(world):
        shard_params, input_fn = _recipe_fns(api)

        def output_fn(mod, outputs, mesh):
            return outputs.full_tensor()

        torch.manual_seed(0)
        model = api.distribute_module(_WithBuffer(), mesh, shard_params, input_fn, output_fn)
        y = model(x)
        y.sum().backward()
        layouts = {n: (type(p).__name__, _names(p.placements)) for n, p in [*model.named_parameters(), *model.named_buffers()]}
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        with pytest.raises(RuntimeError, match="should only be called once"):
            api.distribute_module(model, mesh)
        with pytest.raises(ValueError, match="input_fn should take in 3 arguments, but got 1"):
            api.distribute_module(_WithBuffer(), mesh, input_fn=lambda inputs: inputs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            api.distribute_module(_WithBuffer(), mesh, output_fn=lambda outputs, mesh: outputs)
        replicated = api.distribute_module(_WithBuffer(), mesh)  # no partition_fn: everything replicated
        out.append((type(y).__name__, y.detach(), layouts, grads, [type(w.message).__name__ for w in caught],
                    {n: _names(p.placements) for n, p in replicated.named_parameters()}))  # fmt: skip
    return out


def test_distribute_module_follows_torchs_recipe(ranks):
    for mine, theirs in ranks(2).run(_check_distribute_module):
        assert mine[0] == theirs[0] == "Tensor"
        torch.testing.assert_close(mine[1], theirs[1])
        assert mine[2] == {k: ("Parameter" if v[0] == "Parameter" else "DTensor", v[1]) for k, v in theirs[2].items()}, (mine[2], theirs[2])
        for name in theirs[3]:
            torch.testing.assert_close(mine[3][name], theirs[3][name], msg=name)
        assert mine[4] == theirs[4] == ["FutureWarning"]
        assert mine[5] == theirs[5]


# ---- torch.compile of DTensor code ------------------------------------------------------------------


def _tp_api(api):
    if api is ours:
        import hpservice.parallel as tp
    else:
        import torch.distributed.tensor.parallel as tp
    return tp


def _dtensor_fns():
    return {
        # local on the shards: Shard(0) x Replicate -> Shard(0)
        "relu(a @ w) * 2": lambda a, w: (a @ w).relu() * 2,
        # a softmax over the sharded dim: the graph itself gathers the shards
        "softmax(a, 0) @ w": lambda a, w: torch.softmax(a, 0) @ w,
        # a reduction over the sharded dim (a pending sum), scaled
        "a.sum(0) * w[:, 0]": lambda a, w: a.sum(0) * w[:, 0],
    }


def _check_compile(cache_dir):
    """The same DTensor code eager and compiled, through torch's DTensor and ours: values,
    placements and gradients, and a tensor-parallel MLP (colwise then rowwise) compiled whole.
    Inductor's caches in ``cache_dir`` (this rank process lives on for later tests)."""
    import os

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        return _compile_both()
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _compile_both():
    import torch._dynamo

    world = dist.get_world_size()
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))  # 5 rows: uneven shards
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    out = []
    for api, mesh in _both(world):
        torch._dynamo.reset()
        results = {}
        for name, fn in _dtensor_fns().items():
            for mode, f in (("eager", fn), ("compiled", torch.compile(fn, backend="aot_eager", fullgraph=True))):
                a = api.distribute_tensor(full, mesh, [api.Shard(0)]).requires_grad_()
                w = api.distribute_tensor(weight, mesh, [api.Replicate()]).requires_grad_()
                y = f(a, w)
                (y * y).sum().backward()
                results[(name, mode)] = (_names(y.placements), y.full_tensor().detach(), a.grad.full_tensor(), w.grad.full_tensor())
        tp = _tp_api(api)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        tp.parallelize_module(model, mesh, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
        eager = model(x)
        eager.sum().backward()
        eager_grads = [p.grad.full_tensor().clone() for p in model.parameters()]
        runs = []
        # Twice: compiled, then from Inductor's on-disk caches (shared by the ranks, as on one
        # machine): each rank's graph is its own (which rank adds the rowwise bias).
        for _ in ("cold", "warm"):
            torch._dynamo.reset()
            model.zero_grad()
            compiled = torch.compile(model, backend="inductor")(x)
            compiled.sum().backward()
            runs.append((compiled.detach(), [p.grad.full_tensor() for p in model.parameters()]))
        out.append((results, type(compiled).__name__, eager.detach(), eager_grads, runs))
    return out


def test_compiled_dtensor_code_and_a_compiled_tensor_parallel_module_match_torch(ranks, tmp_path):
    """Our DTensor is a traceable tensor subclass: compiled code gives eager's values, placements
    and gradients, and torch's. (torch's dynamo also traces torch's from_local / redistribute;
    ours run eagerly between compiled regions, so a tensor-parallel module compiles with graph
    breaks at its boundaries: the same values.)"""
    for mine, theirs in ranks(2).run(_check_compile, str(tmp_path / "inductor")):
        assert mine[0].keys() == theirs[0].keys()
        for key, (_placements, value, grad_a, grad_w) in theirs[0].items():
            got = mine[0][key]
            eager = mine[0][(key[0], "eager")]
            assert got[0] == eager[0], key  # compiled keeps eager's layout (ours: reduced where torch leaves Partial)
            for i, expected in ((1, value), (2, grad_a), (3, grad_w)):
                torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-6, msg=str(key))
                torch.testing.assert_close(got[i], eager[i], rtol=1e-6, atol=1e-6, msg=str(key))
        assert mine[1] == theirs[1] == "Tensor"
        torch.testing.assert_close(mine[2], theirs[2], rtol=1e-5, atol=1e-6)  # eager
        for g_ours, g_torch in zip(mine[3], theirs[3], strict=True):
            torch.testing.assert_close(g_ours, g_torch, rtol=1e-5, atol=1e-6)
        for (y_ours, grads_ours), (y_torch, grads_torch) in zip(mine[4], theirs[4], strict=True):  # cold, warm
            torch.testing.assert_close(y_ours, mine[2], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(y_ours, y_torch, rtol=1e-5, atol=1e-6)
            for g_ours, g_eager, g_torch in zip(grads_ours, mine[3], grads_torch, strict=True):
                torch.testing.assert_close(g_ours, g_eager, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(g_ours, g_torch, rtol=1e-5, atol=1e-6)
