"""DeviceMesh on real gloo ranks: groups, sub-meshes, coordinates, identity."""

import pytest
import torch
import torch.distributed as dist

from hpservice.dtensor import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh


def _check_basic_2d():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    assert mesh.ndim == 2 and mesh.shape == (2, 2) and mesh.size() == 4 and mesh.size("tp") == 2
    assert mesh.get_coordinate() == [rank // 2, rank % 2]
    assert mesh.get_local_rank("dp") == rank // 2 and mesh.get_local_rank(1) == rank % 2
    # Groups hold the ranks along each dim, in coordinate order.
    assert dist.get_process_group_ranks(mesh.get_group("tp")) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert dist.get_process_group_ranks(mesh.get_group("dp")) == [rank % 2, rank % 2 + 2]
    # Sub-meshes share the parent's groups.
    tp = mesh["tp"]
    assert tp.ndim == 1 and tp.get_group() is mesh.get_group("tp")
    assert tp.mesh.tolist() == [2 * (rank // 2), 2 * (rank // 2) + 1]
    both = mesh["dp", "tp"]
    assert both.get_group("dp") is mesh.get_group("dp") and both.shape == (2, 2)
    assert both.mesh.tolist() == mesh.mesh.tolist()
    # As torch's: dims out of order would flatten to another rank order ([0, 2, 1, 3]).
    with pytest.raises(KeyError, match="ascending order"):
        mesh["tp", "dp"]
    # A collective on a sub-mesh group reaches exactly its members.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=tp.get_group())
    assert t.item() == 2 * (rank // 2) * 2 + 1
    return True


def test_mesh_groups_and_submeshes(ranks):
    ranks(4).run(_check_basic_2d)


def _check_flatten_3d():
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    rank = dist.get_rank()
    flat = mesh["b", "c"].flatten("bc")
    assert flat.ndim == 1 and flat.size() == 4 and flat.mesh_dim_names == ("bc",)
    assert dist.get_process_group_ranks(flat.get_group()) == list(range(4 * (rank // 4), 4 * (rank // 4) + 4))
    assert mesh["bc"] is flat  # flattened dims are addressable from the root
    assert mesh["b", "c"].flatten("bc") is flat
    whole = mesh.flatten()
    assert whole.size() == 8 and sorted(dist.get_process_group_ranks(whole.get_group())) == list(range(8))
    x = distribute_tensor(torch.arange(10.0), flat, [Shard(0)])
    assert torch.equal(x.full_tensor(), torch.arange(10.0))
    return True


def test_flatten_and_3d_mesh(ranks):
    ranks(8).run(_check_flatten_3d)


def _check_audit_03():
    a = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "y"))
    b = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("x", "y"))
    assert a != b and hash(a) != hash(b)
    assert a == DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "y"))
    assert a != DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("p", "q"))
    # Same first and last rank, different middle: different groups and different results.
    rank = dist.get_rank()
    assert dist.get_process_group_ranks(a.get_group("y")) == ([0, 2] if rank in (0, 2) else [1, 3])
    assert dist.get_process_group_ranks(b.get_group("y")) == ([0, 1] if rank in (0, 1) else [2, 3])
    full = torch.arange(8.0)
    xa = distribute_tensor(full, a, [Shard(0), Replicate()])
    xb = distribute_tensor(full, b, [Shard(0), Replicate()])
    assert torch.equal(xa.full_tensor(), full) and torch.equal(xb.full_tensor(), full)
    assert not torch.equal(xa.to_local(), xb.to_local()) or rank in (0, 3)
    return True


def test_audit_03_mesh_key_uses_all_ranks(ranks):
    ranks(4).run(_check_audit_03)


def _check_reversed_mesh():
    # Group-rank order must follow the mesh, not sorted global ranks.
    mesh = DeviceMesh("cpu", [3, 2, 1, 0])
    rank = dist.get_rank()
    assert mesh.get_coordinate() == [3 - rank]
    full = torch.arange(10.0)
    x = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(x.to_local(), full.chunk(4)[3 - rank] if 3 - rank < 4 else full[:0])
    assert torch.equal(x.full_tensor(), full)
    return True


def test_mesh_rank_order_is_not_sorted(ranks):
    ranks(4).run(_check_reversed_mesh)


class _NoScan:
    """Stands in for a mesh's rank list after construction: its length is known, any scan raises."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getattr__(self, name):
        raise AssertionError(f"a lookup scanned the mesh ({name})")

    def __iter__(self):
        raise AssertionError("a lookup iterated over the mesh's ranks")

    def __getitem__(self, item):
        raise AssertionError("a lookup indexed the mesh's ranks")

    def __contains__(self, item):
        raise AssertionError("a lookup searched the mesh's ranks")


def _check_audit_15():
    from unittest import mock

    from hpservice.dtensor._layout import DTensorSpec

    # A simulated 1024-rank cluster (32 x 32), seen from rank 1000: no process groups are built.
    with mock.patch.object(dist, "get_world_size", return_value=1024), mock.patch.object(dist, "get_rank", return_value=1000):
        mesh = DeviceMesh("cpu", torch.arange(1024).reshape(32, 32), mesh_dim_names=("dp", "tp"), _dim_groups=[None, None])
    mesh.mesh, mesh._ranks = _NoScan(1024), _NoScan(1024)  # from here on, every lookup must be O(1)
    assert mesh.get_coordinate() == [31, 8]
    assert mesh.get_local_rank("dp") == 31 and mesh.get_local_rank("tp") == 8
    assert mesh.size() == 1024 and mesh.size("tp") == 32 and mesh.ndim == 2
    spec = DTensorSpec(mesh, (Shard(0), Shard(1)), (1000, 999))
    assert spec.local_shape == (8, 32) and spec.local_offset == (992, 256)  # torch.chunk pieces 31 and 8
    assert isinstance(mesh._rank_to_index, dict) and len(mesh._rank_to_index) == 1024
    # The real 8-rank mesh agrees with the world.
    real = init_device_mesh("cpu", (2, 4))
    assert real.get_coordinate() == [dist.get_rank() // 4, dist.get_rank() % 4]
    return True


def test_audit_15_lookups_on_a_1024_rank_mesh_never_scan_it(ranks):
    ranks(8).run(_check_audit_15)


def _check_from_group_and_errors():
    rank = dist.get_rank()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    assert mesh.size() == 4 and mesh.get_coordinate() == [rank]
    sub = DeviceMesh("cpu", [0, 1])  # ranks 2, 3 are not part of it
    if rank >= 2:
        assert sub.get_coordinate() is None
        with pytest.raises(RuntimeError, match="not part of"):
            sub.get_group()
    with pytest.raises(ValueError, match="unique"):
        DeviceMesh("cpu", [0, 0])
    with pytest.raises(ValueError, match="world size is 4"):
        init_device_mesh("cpu", (3,))
    with pytest.raises(KeyError, match="not in mesh_dim_names"):
        init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))["tp"]
    return True


def test_from_group_and_clear_errors(ranks):
    ranks(4).run(_check_from_group_and_errors)
