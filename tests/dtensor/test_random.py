"""Random ops on DTensors do not depend on the sharding (AUDIT 6)."""

import pytest
import torch
import torch.distributed as dist

from hpservice.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh, random
from hpservice.dtensor.random import BLOCK, _global_flat_index, _mix


def _init(mesh, placements, shape, op):
    dt = distribute_tensor(torch.empty(shape), mesh, placements, src_data_rank=None)
    return op(dt)


_OPS = {
    "uniform": lambda t: t.uniform_(-2, 3),
    "normal": lambda t: t.normal_(1.0, 0.5),
    "kaiming": lambda t: torch.nn.init.kaiming_uniform_(t, a=5**0.5),
    "bernoulli": lambda t: t.bernoulli_(0.3),
}


def _check_audit_06(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    ndim = len(mesh_shape)
    shape = (BLOCK // 64 + 3, 67)  # several RNG blocks, uneven over every mesh
    for name, op in _OPS.items():
        random.manual_seed(7)
        reference = _init(mesh, [Replicate()] * ndim, shape, op).to_local()  # every rank: whole tensor
        for placements in (
            [Shard(0)] * ndim,
            [Shard(1)] + [Replicate()] * (ndim - 1),
            [Replicate()] * (ndim - 1) + [Shard(1)],
        ):
            random.manual_seed(7)
            sharded = _init(mesh, placements, shape, op)
            assert torch.equal(sharded.full_tensor(), reference), (name, placements)
    # Consecutive ops advance torch's generator, the same on every rank: a second draw differs from
    # the first, and torch.manual_seed reproduces both.
    random.manual_seed(7)
    a = _init(mesh, [Shard(0)] * ndim, (4, 5), _OPS["uniform"])
    state = torch.get_rng_state()
    states = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(states, state)
    assert all(torch.equal(s, state) for s in states)
    b = _init(mesh, [Shard(0)] * ndim, (4, 5), _OPS["uniform"])
    assert not torch.equal(a.full_tensor(), b.full_tensor())
    torch.manual_seed(7)
    assert torch.equal(_init(mesh, [Shard(0)] * ndim, (4, 5), _OPS["uniform"]).full_tensor(), a.full_tensor())
    assert torch.equal(_init(mesh, [Replicate()] * ndim, (4, 5), _OPS["uniform"]).full_tensor(), b.full_tensor())
    # Replicas hold identical values: gather every rank's local piece of a Replicate dim.
    random.manual_seed(11)
    r = _init(mesh, [Replicate()] * ndim, (3, 3), _OPS["normal"]).to_local()
    pieces = [torch.empty_like(r) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, r)
    assert all(torch.equal(p, r) for p in pieces)
    return True


@pytest.mark.parametrize("world,mesh_shape", [(2, (2,)), (4, (2, 2)), (8, (2, 2, 2))])
def test_audit_06_sharded_random_init_equals_single_device(ranks, world, mesh_shape):
    ranks(world).run(_check_audit_06, mesh_shape, timeout=300)


def _check_dropout():
    mesh = init_device_mesh("cpu", (4,))
    random.manual_seed(3)
    x = distribute_tensor(torch.ones(40, 8), mesh, [Shard(0)])
    y = torch.nn.functional.dropout(x, p=0.5, training=True)
    random.manual_seed(3)
    xr = distribute_tensor(torch.ones(40, 8), mesh, [Replicate()])
    yr = torch.nn.functional.dropout(xr, p=0.5, training=True)
    assert torch.equal(y.full_tensor(), yr.to_local())
    assert 0 < (yr.to_local() == 0).sum() < 320
    return True


def test_dropout_mask_independent_of_sharding(ranks):
    ranks(4).run(_check_dropout)


def test_flat_index_is_row_major_and_increasing():
    idx = _global_flat_index((2, 3), (1, 2), (4, 6), torch.device("cpu"))
    assert idx.tolist() == [8, 9, 10, 14, 15, 16]
    assert _mix(1, 2, 3) != _mix(1, 2, 4) and 0 <= _mix(5) < 2**63
