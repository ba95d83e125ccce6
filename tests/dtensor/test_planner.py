"""The redistribution planner is pure: these tests run it for every rank of a mesh in one
process and simulate the collectives, so every transition on 1-D, 2-D and 3-D meshes is
checked exhaustively without communication."""

import itertools

import pytest
import torch

from hpservice.dtensor._layout import chunk_sizes, local_shard_size_and_offset, shard_shape_and_offset
from hpservice.dtensor._redistribute import (
    AllGather,
    AllReduce,
    AllToAll,
    Partition,
    ReduceScatter,
    Slice,
    _plan,
)
from hpservice.dtensor.placement_types import Partial, Replicate, Shard

_REDUCE = {
    "sum": lambda ts: torch.stack(ts).sum(0),
    "avg": lambda ts: torch.stack(ts).mean(0),
    "max": lambda ts: torch.stack(ts).amax(0),
    "min": lambda ts: torch.stack(ts).amin(0),
}


def _coords(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def _group(coord, mesh_dim, mesh_shape):
    return [coord[:mesh_dim] + (j,) + coord[mesh_dim + 1 :] for j in range(mesh_shape[mesh_dim])]


def _locals_for(full, placements, mesh_shape, partial_seed=0):
    """Each rank's local tensor for ``placements``; Partial dims get a random decomposition."""
    gen = torch.Generator().manual_seed(partial_seed)
    out = {}
    for c in _coords(mesh_shape):
        shape, offset = shard_shape_and_offset(full.shape, placements, mesh_shape, c)
        piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].clone()
        out[c] = piece
    for i, p in enumerate(placements):
        if not p.is_partial():
            continue
        for c in _coords(mesh_shape):
            if c[i] != 0:
                continue
            members = _group(c, i, mesh_shape)
            value = out[c]
            if p.reduce_op == "sum":
                parts = [torch.randn(value.shape, generator=gen, dtype=torch.float64) for _ in members[1:]]
                out[c] = value - sum(parts) if parts else value
                for m, part in zip(members[1:], parts, strict=True):
                    out[m] = part
            elif p.reduce_op == "avg":
                parts = [torch.randn(value.shape, generator=gen, dtype=torch.float64) for _ in members[1:]]
                out[c] = value * len(members) - sum(parts) if parts else value
                for m, part in zip(members[1:], parts, strict=True):
                    out[m] = part
            else:  # max/min: one member holds the value, others are dominated
                shift = -1.0 if p.reduce_op == "max" else 1.0
                for m in members[1:]:
                    out[m] = value + shift * (1 + torch.rand(value.shape, generator=gen, dtype=torch.float64))
    return out


def _simulate(locals_, plans, mesh_shape):
    """Apply every rank's plan step by step, simulating each collective over its group."""
    steps_count = {len(p) for p in plans.values()}
    assert len(steps_count) == 1, "ranks disagree on the number of steps (would deadlock)"
    cur = dict(locals_)
    for n in range(steps_count.pop()):
        new = {}
        for c in cur:
            step = plans[c][n]
            group = _group(c, step.mesh_dim, mesh_shape)
            assert all(type(plans[m][n]) is type(step) and plans[m][n].mesh_dim == step.mesh_dim for m in group)
            idx, k = c[step.mesh_dim], mesh_shape[step.mesh_dim]
            x = cur[c]
            if isinstance(step, AllGather):
                assert all(plans[m][n] == step for m in group), "group members disagree on the gathered size"
                y = torch.cat([cur[m] for m in group], step.tensor_dim)
                assert y.size(step.tensor_dim) == step.full_size
            elif isinstance(step, Slice):
                size, start = local_shard_size_and_offset(x.size(step.tensor_dim), k, idx)
                y = x.narrow(step.tensor_dim, start, size)
            elif isinstance(step, AllReduce):
                y = _REDUCE[step.reduce_op]([cur[m] for m in group])
            elif isinstance(step, ReduceScatter):
                total = _REDUCE[step.reduce_op]([cur[m] for m in group])
                size, start = local_shard_size_and_offset(total.size(step.tensor_dim), k, idx)
                y = total.narrow(step.tensor_dim, start, size)
            elif isinstance(step, AllToAll):
                pieces = []
                for m in group:
                    xm = cur[m]
                    size, start = local_shard_size_and_offset(xm.size(step.dst_dim), k, idx)
                    pieces.append(xm.narrow(step.dst_dim, start, size))
                y = torch.cat(pieces, step.src_dim)
                assert y.size(step.src_dim) == step.src_full
            elif isinstance(step, Partition):
                y = torch.zeros_like(x) if step.reduce_op == "sum" and idx != 0 else x
            else:
                raise AssertionError(step)
            new[c] = y
        cur = new
    return cur


def _check_transition(full, src, dst, mesh_shape):
    locals_ = _locals_for(full, src, mesh_shape)
    plans = {c: _plan(tuple(full.shape), src, dst, mesh_shape, c) for c in _coords(mesh_shape)}
    out = _simulate(locals_, plans, mesh_shape)
    replicate = (Replicate(),) * len(mesh_shape)
    back = {c: _plan(tuple(full.shape), dst, replicate, mesh_shape, c) for c in _coords(mesh_shape)}
    final = _simulate(out, back, mesh_shape)
    for c in _coords(mesh_shape):
        assert torch.allclose(final[c], full), f"{src} -> {dst} wrong on rank {c}"
        if not any(p.is_partial() for p in dst):
            expected = shard_shape_and_offset(full.shape, dst, mesh_shape, c)[0]
            assert tuple(out[c].shape) == expected
    return plans


_ALL = [Shard(0), Shard(1), Replicate(), Partial("sum")]


@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 2), (2, 3), (2, 1), (2, 2, 2), (1, 2, 2)])
def test_every_transition_matches_the_global_value(mesh_shape):
    """Every (src, dst) pair over S(0), S(1), R, P on uneven dims equals the global tensor."""
    full = torch.randn(5, 7, dtype=torch.float64)
    placements = _ALL if len(mesh_shape) < 3 else [Shard(0), Shard(1), Replicate(), Partial()]
    for src in itertools.product(placements, repeat=len(mesh_shape)):
        for dst in itertools.product(placements, repeat=len(mesh_shape)):
            _check_transition(full, src, dst, mesh_shape)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_partial_reduce_ops(op):
    full = torch.randn(6, 3, dtype=torch.float64)
    for dst in [(Replicate(), Replicate()), (Shard(0), Shard(1)), (Shard(1), Replicate()), (Partial("sum"), Shard(0))]:
        _check_transition(full, (Partial(op), Partial(op)), dst, (2, 2))


def test_any_tensor_rank():
    for shape in [(9,), (3, 4, 5), (2, 3, 1, 4)]:
        full = torch.randn(shape, dtype=torch.float64)
        dims = [Shard(d) for d in range(len(shape))] + [Replicate()]
        for src in itertools.product(dims, repeat=2):
            for dst in itertools.product(dims, repeat=2):
                _check_transition(full, src, dst, (2, 2))


def test_audit_01_non_partial_input_takes_no_reduction_step():
    for src in itertools.product([Shard(0), Shard(1), Replicate()], repeat=2):
        for dst in itertools.product([Shard(0), Shard(1), Replicate(), Partial()], repeat=2):
            plan = _plan((4, 6), src, dst, (2, 2), (0, 1))
            assert not any(isinstance(s, AllReduce | ReduceScatter) for s in plan), (src, dst, plan)


@pytest.mark.parametrize("d", [0, 1, 2])
def test_audit_02_partial_to_shard_is_one_reduce_scatter(d):
    plan = _plan((4, 6, 5), (Partial(),), (Shard(d),), (4,), (1,))
    assert plan == (ReduceScatter(0, d, "sum"),)
    _check_transition(torch.randn(4, 6, 5, dtype=torch.float64), (Partial(),), (Shard(d),), (4,))


def test_basic_plans_are_single_collectives():
    assert _plan((8,), (Shard(0),), (Replicate(),), (4,), (0,)) == (AllGather(0, 0, 8),)
    assert _plan((8,), (Replicate(),), (Shard(0),), (4,), (0,)) == (Slice(0, 0),)
    assert _plan((8,), (Partial(),), (Replicate(),), (4,), (0,)) == (AllReduce(0, "sum"),)
    assert _plan((8, 4), (Shard(0),), (Shard(1),), (4,), (0,)) == (AllToAll(0, 0, 1, 8),)
    assert _plan((8,), (Replicate(),), (Partial(),), (4,), (2,)) == (Partition(0, "sum"),)
    assert _plan((8,), (Shard(0),), (Shard(0),), (4,), (0,)) == ()


def test_reductions_come_before_gathers():
    plan = _plan((8, 8), (Shard(0), Partial()), (Replicate(), Replicate()), (2, 2), (0, 0))
    assert [type(s) for s in plan] == [AllReduce, AllGather]


def test_audit_08_uneven_chunks_follow_torch_chunk():
    assert chunk_sizes(5, 4) == (2, 2, 1, 0)
    assert chunk_sizes(7, 2) == (4, 3)
    for n in range(0, 13):
        for k in range(1, 6):
            expected = [c.numel() for c in torch.arange(n).chunk(k)]
            expected += [0] * (k - len(expected))
            assert list(chunk_sizes(n, k)) == expected
            assert sum(chunk_sizes(n, k)) == n


def test_nested_sharding_left_to_right():
    # (S(0), S(0)) on 2x2: dim 0 of 7 -> (4, 3) over mesh dim 0, then each piece over mesh dim 1.
    sizes = {c: shard_shape_and_offset((7,), (Shard(0), Shard(0)), (2, 2), c) for c in _coords((2, 2))}
    assert sizes == {(0, 0): ((2,), (0,)), (0, 1): ((2,), (2,)), (1, 0): ((2,), (4,)), (1, 1): ((1,), (6,))}
    assert sum(s[0][0] for s in sizes.values()) == 7  # never local x ranks


def test_audit_16_plan_cache_is_bounded_with_tuple_keys():
    info = _plan.cache_info()
    assert info.maxsize is not None and info.maxsize <= 65536
    before = _plan.cache_info().hits
    _plan((8,), (Shard(0),), (Replicate(),), (4,), (0,))
    _plan((8,), (Shard(0),), (Replicate(),), (4,), (0,))
    assert _plan.cache_info().hits > before


def test_plans_agree_across_ranks_for_large_meshes():
    """All ranks must issue the same collectives in the same order, or they deadlock."""
    mesh_shape = (2, 2, 3)
    for src, dst in [
        ((Shard(0), Shard(0), Shard(0)), (Shard(1), Replicate(), Shard(0))),
        ((Partial(), Shard(1), Shard(0)), (Shard(0), Shard(0), Partial("sum"))),
    ]:
        plans = {c: _plan((11, 5), src, dst, mesh_shape, c) for c in _coords(mesh_shape)}
        kinds = {tuple((type(s), s.mesh_dim) for s in p) for p in plans.values()}
        assert len(kinds) == 1
        _check_transition(torch.randn(11, 5, dtype=torch.float64), src, dst, mesh_shape)


def test_size_one_mesh_dims_take_no_step():
    # HSDP or TP dims of size 1: no 1-rank collectives.
    assert _plan((8, 4), (Shard(0), Shard(0)), (Replicate(), Replicate()), (2, 1), (1, 0)) == (AllGather(0, 0, 8),)
    assert _plan((8, 4), (Partial(), Partial()), (Shard(0), Shard(1)), (2, 1), (0, 0)) == (ReduceScatter(0, 0, "sum"),)
    assert _plan((8,), (Partial(),), (Replicate(),), (1,), (0,)) == ()
