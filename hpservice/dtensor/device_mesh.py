"""DeviceMesh: an n-d array of global ranks with one process group per mesh dim.

Layout: ``mesh`` is an int tensor of global ranks, e.g. ``[[0, 1], [2, 3]]`` for 2x2. For each
mesh dim ``i`` the ranks along that dim (all other coordinates fixed) form one process group;
this rank keeps the group it belongs to. Group-rank order follows the mesh coordinate (groups
are created with ``sort_ranks=False``), so gathering over a group yields chunks in coordinate
order even for meshes like ``[[0, 2], [1, 3]]``.

Identity is the full rank layout plus dim names and device type (AUDIT 3): two meshes with the
same shape but different rank orders are different keys everywhere a mesh is a key.
The rank -> coordinate lookup is a dict built once (AUDIT 15).
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["DeviceMesh", "init_device_mesh"]


def _backend_for(device_type: str) -> str:
    backend = dist.Backend.default_device_backend_map.get(device_type)
    if backend is None:
        raise ValueError(
            f"device_type {device_type!r} has no default torch.distributed backend; "
            f"known: {sorted(dist.Backend.default_device_backend_map)}"
        )
    return backend


def _ensure_default_group(device_type: str) -> None:
    """Create the default process group from env:// (MASTER_ADDR/PORT, RANK, WORLD_SIZE) if none exists."""
    if dist.is_initialized():
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "no default process group and cannot create one from env://: "
            f"environment variables {missing} are not set (launch with torchrun, or call "
            "torch.distributed.init_process_group first)"
        )
    dist.init_process_group(backend=_backend_for(device_type))


class DeviceMesh:
    """An n-d mesh of ranks; ``mesh["dp"]`` and ``mesh["dp", "tp"]`` are sub-meshes sharing its groups."""

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _dim_groups: Sequence[dist.ProcessGroup | None] | None = None,
        _root: DeviceMesh | None = None,
        _root_dims: tuple[int, ...] | None = None,
        _dim_roots: tuple[tuple[int, ...], ...] | None = None,
    ):
        if not isinstance(device_type, str) or not device_type:
            raise TypeError(f"DeviceMesh(device_type): expected a str such as 'cpu' or 'cuda', got {device_type!r}")
        mesh_t = (
            mesh.detach().to("cpu", torch.int64)
            if isinstance(mesh, torch.Tensor)
            else torch.tensor(mesh, dtype=torch.int64)
        )
        if mesh_t.ndim == 0:
            raise ValueError("DeviceMesh(mesh): expected at least one dimension, got a scalar")
        ranks = tuple(mesh_t.flatten().tolist())
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"DeviceMesh(mesh): ranks must be unique, got {mesh_t.tolist()}")
        if mesh_dim_names is not None:
            mesh_dim_names = tuple(mesh_dim_names)
            if len(mesh_dim_names) != mesh_t.ndim or len(set(mesh_dim_names)) != len(mesh_dim_names):
                raise ValueError(f"DeviceMesh(mesh_dim_names): need {mesh_t.ndim} unique names, got {mesh_dim_names}")
        self.device_type = device_type
        self.mesh = mesh_t
        self.mesh_dim_names = mesh_dim_names
        self._shape = tuple(mesh_t.shape)
        self._ranks = ranks
        self._key = (device_type, self._shape, ranks, mesh_dim_names)
        self._hash = hash(self._key)
        self._root = _root if _root is not None else self
        # The root dims each of this mesh's dims covers: one, or several for a flattened dim taken
        # with others (``world["dp_replicate", "dp_shard_cp"]``); _root_dims lists them all in order.
        if _dim_roots is None:
            _dim_roots = tuple((d,) for d in (_root_dims if _root_dims is not None else range(mesh_t.ndim)))
        self._dim_roots = _dim_roots
        self._root_dims = tuple(d for roots in _dim_roots for d in roots)
        if _root is None:
            self._flattened: dict[str, DeviceMesh] = {}

        _ensure_default_group(device_type)
        self._rank = dist.get_rank()
        if max(ranks) >= dist.get_world_size() or min(ranks) < 0:
            raise ValueError(f"DeviceMesh(mesh): ranks {mesh_t.tolist()} outside world size {dist.get_world_size()}")
        # O(1) rank -> coordinate: one dict for this mesh, one lookup for this process.
        self._rank_to_index = {r: i for i, r in enumerate(ranks)}
        index = self._rank_to_index.get(self._rank)
        self._coordinate = None if index is None else tuple(_unravel(index, self._shape))
        self._dim_groups = list(_dim_groups) if _dim_groups is not None else self._create_groups()
        if _root is None:
            _LIVE_ROOTS[self._key] = self

    # ---- copies and pickles ------------------------------------------------------------------
    def __deepcopy__(self, memo) -> DeviceMesh:
        """A mesh is immutable and names process groups: copies share it (AUDIT 12)."""
        return self

    def __reduce__(self):
        """Pickled by its layout (root mesh, which of its dims, flattened name); unpickling re-binds
        to the live mesh of that layout in the loading process, or creates it (a collective: every
        rank must unpickle it)."""
        root = self._root
        flat_name = next((n for n, m in root._flattened.items() if m is self), None)
        return (
            _rebuild_mesh,
            (root.device_type, root.mesh.tolist(), root.mesh_dim_names, self._root_dims, self.mesh_dim_names, flat_name),
        )

    # ---- construction -------------------------------------------------------------------
    def _create_groups(self) -> list[dist.ProcessGroup | None]:
        """One group per mesh dim; every rank of the world takes part in creating every group."""
        backend = _backend_for(self.device_type)
        world = tuple(range(dist.get_world_size()))
        groups: list[dist.ProcessGroup | None] = []
        for dim in range(self.mesh.ndim):
            rows = self.mesh.movedim(dim, -1).reshape(-1, self._shape[dim]).tolist()
            mine = None
            for row in rows:
                if tuple(row) == world and dist.get_backend() == backend:
                    group = dist.group.WORLD
                else:
                    group = dist.new_group(ranks=row, backend=backend, sort_ranks=False)
                if self._rank in row:
                    mine = group
            groups.append(mine)
        return groups

    @staticmethod
    def from_group(
        group: dist.ProcessGroup | Sequence[dist.ProcessGroup],
        device_type: str,
        mesh: torch.Tensor | Sequence | None = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> DeviceMesh:
        """Wrap existing groups: one group gives a 1-D mesh; a list needs ``mesh`` (one group per dim)."""
        if isinstance(group, dist.ProcessGroup):
            ranks = dist.get_process_group_ranks(group)
            return DeviceMesh(
                device_type, ranks if mesh is None else mesh, mesh_dim_names=mesh_dim_names, _dim_groups=[group]
            )
        groups = list(group)
        if mesh is None:
            raise ValueError("DeviceMesh.from_group: a list of groups needs `mesh` (the full rank layout)")
        result = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _dim_groups=groups)
        if len(groups) != result.ndim:
            raise ValueError(f"DeviceMesh.from_group: got {len(groups)} groups for a {result.ndim}-d mesh")
        return result

    # ---- identity -----------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    # ---- queries ------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return len(self._ranks)
        return self._shape[self._dim(mesh_dim)]

    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate in the mesh, or None if it is not part of it."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank: mesh_dim is required on a {self.ndim}-d mesh")
            mesh_dim = 0
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self!r}")
        return self._coordinate[self._dim(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group: mesh_dim is required on a {self.ndim}-d mesh")
            mesh_dim = 0
        group = self._dim_groups[self._dim(mesh_dim)]
        if group is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self!r}")
        return group

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        return [self.get_group(i) for i in range(self.ndim)]

    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh dim {mesh_dim!r} not in mesh_dim_names {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim!r} out of range for a {self.ndim}-d mesh")
        return mesh_dim % self.ndim

    # ---- sub-meshes ---------------------------------------------------------------------
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """Sub-mesh over the named dims, through this rank; shares this mesh's process groups. As
        torch's: the dims in this mesh's order (a transposed sub-mesh would flatten to another rank
        order)."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if len(names) == 1 and self._is_flattened_name(names[0]):
            return self._root._flattened[names[0]]
        sub = self._slice(names)
        if list(sub._root_dims) != sorted(sub._root_dims):
            raise KeyError(
                f"Invalid mesh_dim_names {names} specified. Mesh dim indices should be in ascending order "
                f"(this mesh's dims: {self.mesh_dim_names})"
            )
        return sub

    def _is_flattened_name(self, name: str) -> bool:
        return name in self._root._flattened and (not self.mesh_dim_names or name not in self.mesh_dim_names)

    def _slice(self, names: tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over ``names`` in the order given (a transposed one too: fully_shard's mesh
        of a tensor-parallel parameter puts the data-parallel dims first). A name may be a
        flattened dim over adjacent dims of this mesh (``world["dp_replicate", "dp_shard_cp"]``,
        HSDP with context parallelism): its ranks in the flattened order, its flattened group."""
        if not self.mesh_dim_names:
            raise KeyError("cannot slice a DeviceMesh without mesh_dim_names")
        parts, groups = [], []  # per name: the dims of this mesh it covers; its process group
        for n in names:
            if n in self.mesh_dim_names or not self._is_flattened_name(n):
                d = self._dim(n)
                parts.append([d])
                groups.append(self._dim_groups[d])
                continue
            flat = self._root._flattened[n]
            covered = [d for d, roots in enumerate(self._dim_roots) if set(roots) <= set(flat._root_dims)]
            roots = tuple(r for d in covered for r in self._dim_roots[d])
            if roots != flat._root_dims or covered != list(range(covered[0], covered[0] + len(covered))):
                raise KeyError(f"flattened dim {n!r} does not cover adjacent dims of {self!r}")
            parts.append(covered)
            groups.append(flat._dim_groups[0])
        dims = [d for part in parts for d in part]
        if len(set(dims)) != len(dims):
            raise KeyError(f"repeated mesh dim names in {names}")
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self!r}; cannot take a sub-mesh through it")
        index = tuple(slice(None) if d in dims else self._coordinate[d] for d in range(self.ndim))
        kept = sorted(dims)
        sub = self.mesh[index].permute([kept.index(d) for d in dims])
        sub = sub.reshape([math.prod(self._shape[d] for d in part) for part in parts])
        return DeviceMesh(
            self.device_type,
            sub,
            mesh_dim_names=names,
            _dim_groups=groups,
            _root=self._root,
            _dim_roots=tuple(tuple(r for d in part for r in self._dim_roots[d]) for part in parts),
        )

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over all ranks of this (sub-)mesh, with its own group; cached on the root mesh."""
        if self.ndim == 1 and mesh_dim_name is None:
            return self
        name = mesh_dim_name or "_".join(self.mesh_dim_names or [str(d) for d in self._root_dims])
        root = self._root
        cached = root._flattened.get(name)
        if cached is not None:
            if cached._root_dims != self._root_dims:
                raise ValueError(f"flatten: name {name!r} already used for root dims {cached._root_dims}")
            return cached
        if root.mesh_dim_names and name in root.mesh_dim_names:
            raise ValueError(f"flatten: name {name!r} is already a dim of {root!r}")
        # Every slice of the root over these dims becomes a group (all ranks create all groups).
        dims = list(self._root_dims)
        others = [d for d in range(root.ndim) if d not in dims]
        slices = root.mesh.permute(others + dims).reshape(-1, math.prod(root._shape[d] for d in dims))
        backend = _backend_for(self.device_type)
        mine = None
        for row in slices.tolist():
            group = dist.new_group(ranks=row, backend=backend, sort_ranks=False)
            if self._rank in row:
                mine = group
        flat = DeviceMesh(
            self.device_type,
            self.mesh.flatten(),
            mesh_dim_names=(name,),
            _dim_groups=[mine],
            _root=root,
            _dim_roots=(tuple(dims),),
        )
        root._flattened[name] = flat
        return flat

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """torch's name for ``flatten``."""
        return self.flatten(mesh_dim_name)


# Root meshes alive in this process, by layout: unpickled meshes re-bind to their process groups.
_LIVE_ROOTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors for ``mesh``'s collectives live on: the CPU, or the current
    accelerator of the mesh's device type."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _rebuild_mesh(device_type, root_mesh, root_names, root_dims, names, flat_name) -> DeviceMesh:
    mesh_t = torch.tensor(root_mesh, dtype=torch.int64)
    key = (device_type, tuple(mesh_t.shape), tuple(mesh_t.flatten().tolist()), root_names)
    root = _LIVE_ROOTS.get(key)
    if root is None:
        root = DeviceMesh(device_type, mesh_t, mesh_dim_names=root_names)
    if flat_name is not None:
        return root._flattened.get(flat_name) or root._slice(tuple(root.mesh_dim_names[d] for d in root_dims)).flatten(
            flat_name
        )
    if tuple(root_dims) == tuple(range(root.ndim)):
        return root
    return root._slice(tuple(names))


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    coord = []
    for size in reversed(shape):
        coord.append(index % size)
        index //= size
    return coord[::-1]


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """A mesh over all ranks of the world, in row-major order; creates the default group if needed."""
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or any(not isinstance(s, int) or s < 1 for s in mesh_shape):
        raise ValueError(f"init_device_mesh(mesh_shape): expected positive ints, got {mesh_shape}")
    _ensure_default_group(device_type)
    world = dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise ValueError(
            f"init_device_mesh: mesh_shape {mesh_shape} has {math.prod(mesh_shape)} ranks, world size is {world}"
        )
    if device_type != "cpu" and "LOCAL_RANK" in os.environ:
        torch.get_device_module(device_type).set_device(int(os.environ["LOCAL_RANK"]))
    return DeviceMesh(device_type, torch.arange(world).view(mesh_shape), mesh_dim_names=mesh_dim_names)
