"""Redistribution on real gloo ranks: every transition equals the single-device tensor.

Each test body runs on every rank of a persistent pool (see conftest.py). Results are
compared with the full tensor every rank builds from the same seed, and, where the two
overlap, with torch's own DTensor.
"""

import copy
import itertools
import random as pyrandom

import pytest
import torch

from hpservice.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from hpservice.dtensor._redistribute import AllReduce, ReduceScatter, plan_redistribution

MESHES = {2: [(2,)], 4: [(4,), (2, 2)], 8: [(8,), (2, 4), (2, 2, 2)]}
_PLACEMENTS = [Shard(0), Shard(1), Shard(2), Replicate(), Partial()]


def _mesh(shape):
    names = ("a", "b", "c")[: len(shape)]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _partial_local(full, mesh, placements):
    """Local tensor whose reduction over the Partial dims (sum) is ``full``'s piece."""
    dt = distribute_tensor(full, mesh, [Replicate() if p.is_partial() else p for p in placements], src_data_rank=None)
    local = dt.to_local().clone()
    coord = mesh.get_coordinate()
    for i, p in enumerate(placements):
        if p.is_partial():
            # Rank j of the group holds (j + 1) / T of the value, T = sum of (j + 1).
            k = mesh.size(i)
            local = local * (coord[i] + 1) / (k * (k + 1) / 2)
    return DTensor.from_local(local, mesh, placements, shape=full.shape)


def _all_transitions(mesh_shape, sample, seed):
    ndim = len(mesh_shape)
    pairs = list(itertools.product(itertools.product(_PLACEMENTS, repeat=ndim), repeat=2))
    if sample is not None and len(pairs) > sample:
        pairs = pyrandom.Random(seed).sample(pairs, sample)
    return pairs


def _check_transitions(mesh_shape, shape, sample, seed):
    mesh = _mesh(mesh_shape)
    torch.manual_seed(seed)
    full = torch.randn(shape, dtype=torch.float64)
    checked = 0
    for src, dst in _all_transitions(mesh_shape, sample, seed):
        if any(p.is_partial() for p in src):
            dt = _partial_local(full, mesh, src)
        else:
            dt = distribute_tensor(full, mesh, src)
        before_local, before_spec = dt.to_local().clone(), dt._spec
        out = dt.redistribute(mesh, dst)
        assert out.placements == tuple(dst) and out.shape == full.shape
        # AUDIT 1: the source is never mutated (data and layout).
        assert torch.equal(dt.to_local(), before_local) and dt._spec is before_spec
        got = out.full_tensor()
        assert torch.allclose(got, full), f"{src} -> {dst}"
        if not any(p.is_partial() for p in dst):
            expected = distribute_tensor(full, mesh, dst, src_data_rank=None).to_local()
            exact = not any(p.is_partial() for p in src)
            assert torch.equal(out.to_local(), expected) if exact else torch.allclose(out.to_local(), expected)
        checked += 1
    return checked


@pytest.mark.parametrize(
    "world,mesh_shape,sample",
    [(2, (2,), None), (4, (4,), None), (4, (2, 2), None), (8, (8,), None), (8, (2, 4), 160), (8, (2, 2, 2), 160)],
)
def test_transitions_equal_single_device(ranks, world, mesh_shape, sample):
    """S->R, R->S, P->R, P->S(d), S(i)->S(j) and multi-dim combinations, uneven 3-d tensor."""
    counts = ranks(world).run(_check_transitions, mesh_shape, (5, 7, 3), sample, world, timeout=300)
    assert counts[0] > 0 and len(set(counts)) == 1


def _check_tensor_ranks(mesh_shape):
    mesh = _mesh(mesh_shape)
    for shape in [(9,), (0, 3), (2, 3, 4, 5), (1,)]:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        dims = [Shard(d) for d in range(len(shape))] + [Replicate()]
        for src in itertools.product(dims, repeat=len(mesh_shape)):
            for dst in itertools.product(dims, repeat=len(mesh_shape)):
                out = distribute_tensor(full, mesh, src).redistribute(mesh, dst)
                assert torch.equal(out.full_tensor(), full), (shape, src, dst)
    return True


@pytest.mark.parametrize("world,mesh_shape", [(4, (2, 2)), (8, (8,))])
def test_any_tensor_rank_and_empty_shards(ranks, world, mesh_shape):
    ranks(world).run(_check_tensor_ranks, mesh_shape, timeout=300)


def _check_audit_02(world):
    mesh = _mesh((world,))
    full = torch.randn(6, 10, 3, generator=torch.Generator().manual_seed(0))
    for d in range(3):
        rank = mesh.get_rank()
        local = full * (rank + 1) / (world * (world + 1) / 2)
        dt = DTensor.from_local(local, mesh, [Partial()])
        assert plan_redistribution(dt._spec, dt._spec.with_placements((Shard(d),))) == (ReduceScatter(0, d, "sum"),)
        out = dt.redistribute(mesh, [Shard(d)])
        expected = full.chunk(world, d)[rank] if rank < len(full.chunk(world, d)) else full.narrow(d, 0, 0)
        assert torch.allclose(out.to_local(), expected)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_audit_02_partial_to_shard_reduce_scatter_equals_sum(ranks, world):
    ranks(world).run(_check_audit_02, world)


def _check_audit_01(world):
    mesh = _mesh((2, world // 2))
    full = torch.randn(4, 6)
    counts = {"all_reduce": 0, "reduce_scatter": 0}
    import hpservice.dtensor._collectives as C

    orig_ar, orig_rs = C.all_reduce, C.reduce_scatter

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)

        return wrapped

    C.all_reduce, C.reduce_scatter = counting("all_reduce", orig_ar), counting("reduce_scatter", orig_rs)
    try:
        for src in itertools.product([Shard(0), Shard(1), Replicate()], repeat=2):
            dt = distribute_tensor(full, mesh, src)
            spec = dt._spec
            for dst in itertools.product([Shard(0), Shard(1), Replicate()], repeat=2):
                dt.redistribute(mesh, dst).full_tensor()
                assert dt._spec is spec and dt.placements == src  # layout untouched
    finally:
        C.all_reduce, C.reduce_scatter = orig_ar, orig_rs
    return counts


def test_audit_01_redistribute_never_mutates_source_and_skips_reduction(ranks):
    counts = ranks(4).run(_check_audit_01, 4)
    assert counts[0] == {"all_reduce": 0, "reduce_scatter": 0}


def _check_avg_low_precision(dtype_name):
    dtype = getattr(torch, dtype_name)
    mesh = _mesh((4,))
    big = 60000.0 if dtype is torch.float16 else 3.0e38
    local = torch.full((8, 3), big, dtype=dtype)
    for dst in ([Replicate()], [Shard(0)], [Shard(1)]):
        out = DTensor.from_local(local, mesh, [Partial("avg")]).redistribute(mesh, dst)
        got = out.full_tensor()
        assert got.dtype == dtype
        assert torch.isfinite(got).all(), f"avg overflowed in {dtype_name} for {dst}"
        assert torch.equal(got, torch.full((8, 3), big, dtype=dtype))
    # 1/3 averages: exact to the dtype's rounding of the true mean.
    rank = mesh.get_rank()
    vals = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    local = torch.full((4,), float(vals[rank]), dtype=dtype)
    got = DTensor.from_local(local, mesh, [Partial("avg")]).full_tensor()
    true_mean = torch.tensor([float(v) for v in vals.to(dtype)], dtype=torch.float64).mean()
    assert torch.equal(got, torch.full((4,), float(true_mean), dtype=torch.float64).to(dtype))
    return True


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_audit_row_avg_is_exact_in_low_precision(ranks, dtype):
    ranks(4).run(_check_avg_low_precision, dtype)


def _check_reduce_ops():
    mesh = _mesh((2, 2))
    rank = mesh.get_rank()
    local = torch.arange(6.0).reshape(3, 2) + rank
    expect = {
        "sum": torch.arange(6.0).reshape(3, 2) * 4 + 6,
        "avg": torch.arange(6.0).reshape(3, 2) + 1.5,
        "max": torch.arange(6.0).reshape(3, 2) + 3,
        "min": torch.arange(6.0).reshape(3, 2),
    }
    for op, value in expect.items():
        for dst in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Replicate(), Shard(0)]):
            out = DTensor.from_local(local, mesh, [Partial(op), Partial(op)]).redistribute(mesh, dst)
            assert torch.equal(out.full_tensor(), value), (op, dst)
    return True


def test_partial_reduce_ops_sum_avg_max_min(ranks):
    ranks(4).run(_check_reduce_ops)


def _check_against_torch():
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor as tdistribute
    from torch.distributed.tensor import init_device_mesh as tmesh

    ours, theirs = _mesh((2, 2)), tmesh("cpu", (2, 2))
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    conv = {Shard(0): TS(0), Shard(1): TS(1), Replicate(): TR()}
    for src in itertools.product(conv, repeat=2):
        for dst in itertools.product(conv, repeat=2):
            a = distribute_tensor(full, ours, src).redistribute(ours, dst).to_local()
            b = (
                tdistribute(full, theirs, [conv[p] for p in src])
                .redistribute(theirs, [conv[p] for p in dst])
                .to_local()
            )
            assert torch.equal(a, b), (src, dst)
    return True


def test_local_shards_equal_torch_dtensor(ranks):
    ranks(4).run(_check_against_torch)


def _check_async():
    mesh = _mesh((4,))
    full = torch.randn(9, 4, generator=torch.Generator().manual_seed(1))
    dt = distribute_tensor(full, mesh, [Shard(0)])
    out = dt.redistribute(mesh, [Replicate()], async_op=True)
    assert out._pending is not None
    assert torch.equal((out + 1).to_local(), full + 1)  # ops wait before use
    assert torch.equal(dt.redistribute(mesh, [Shard(1)], async_op=True).full_tensor(), full)
    return True


def test_async_redistribute_waits_on_first_use(ranks):
    ranks(4).run(_check_async)


class _CopyCounter:
    """Counts every copy of a layout object (DTensorSpec, DeviceMesh, placements), whatever the
    import style (``copy.deepcopy``, ``from copy import deepcopy``, ``copy.copy``, pickling): all
    of them go through the class's ``__deepcopy__`` / ``__reduce_ex__``."""

    def __init__(self):
        from hpservice.dtensor import DeviceMesh
        from hpservice.dtensor._layout import DTensorSpec
        from hpservice.dtensor.placement_types import Partial

        self.classes = [DTensorSpec, DeviceMesh, Shard, Replicate, Partial]
        self.count = 0
        self.depth = 0
        self.saved = []

    def __enter__(self):
        for cls in self.classes:
            for name in ("__deepcopy__", "__reduce_ex__", "__copy__"):
                original = cls.__dict__.get(name)
                self.saved.append((cls, name, original))
                inherited = getattr(cls, name, None)

                def counting(obj, *args, _inherited=inherited, **kwargs):
                    self.count += self.depth == 0  # one copy, however many hooks it passes through
                    self.depth += 1
                    try:
                        if _inherited is None:  # no __copy__/__deepcopy__: copy falls back to __reduce_ex__
                            return obj.__reduce_ex__(4)
                        return _inherited(obj, *args, **kwargs)
                    finally:
                        self.depth -= 1

                setattr(cls, name, counting)
        return self

    def __exit__(self, *exc):
        for cls, name, original in reversed(self.saved):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def _check_no_deepcopy():
    from copy import deepcopy as imported_deepcopy

    import torch.nn as nn

    from hpservice.fsdp import fully_shard

    mesh = _mesh((2, 2))
    dt = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Replicate()])
    with _CopyCounter() as probe:  # the counter sees a copy made through any import style
        imported_deepcopy(dt._spec)
        copy.copy(mesh)
    assert probe.count == 2, probe.count
    flat = mesh._flatten("flat") if hasattr(mesh, "_flatten") else mesh
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with _CopyCounter() as hot:  # the hot path: redistributions, ops, an FSDP training step
        a = dt.redistribute(mesh, [Replicate(), Shard(1)])
        b = dt.redistribute(mesh, [Replicate(), Shard(1)])
        c = a + b  # pointwise results share their operands' layout object
        (a @ b.t()).redistribute(mesh, [Replicate(), Replicate()])
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert hot.count == 0, f"{hot.count} copies of layout objects on the hot path"
    assert c._spec is a._spec
    return True


def test_audit_12_layouts_shared_no_deepcopy(ranks):
    ranks(4).run(_check_no_deepcopy)


def test_audit_row_reduce_ops_on_plans_are_exact_names():
    # The planner carries the reduce op: Partial(max) -> Replicate is a MAX all-reduce.
    from hpservice.dtensor._redistribute import _plan

    assert _plan((4,), (Partial("max"),), (Replicate(),), (2,), (0,)) == (AllReduce(0, "max"),)
