"""Redistribution = a pure planner and an executor.

``plan_redistribution(src, dst)`` turns two specs into a tuple of steps, one collective (or
local op) on one mesh dim each, without communicating; it only needs the mesh shape and this
rank's coordinate, so it is unit-testable on one process and cached (bounded LRU keyed by
immutable specs and the coordinate; AUDIT 16). ``execute_plan`` runs the steps.

Per mesh dim: S->R all-gather, R->S local slice, P->R all-reduce, P->S reduce-scatter,
S(i)->S(j) all-to-all, R->P local partition.

Nested sharding decides the order. A mesh dim may change how tensor dim ``d`` is cut only if
no mesh dim to its right also cuts ``d`` (it is the innermost cut), otherwise the local pieces
are not contiguous pieces of the level above. So:

1. right to left, every shard that must change (itself, or because a mesh dim to its left
   changes the same tensor dim) is gathered, or moved with an all-to-all when that is legal;
2. left to right, the remaining targets are applied: slices, reduce-scatters, all-reduces,
   partitions.

All-reduces are legal anywhere (every rank of the group holds the same region), so when the
plan gathers they are moved to the front, where the data is smallest. A non-Partial source
never gets a reduction step (AUDIT 1); Partial -> Shard(d) is one reduce-scatter (AUDIT 2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import _collectives as C
from ._layout import DTensorSpec, local_shard_size_and_offset, shard_shape_and_offset
from .placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Partition",
    "ReduceScatter",
    "Slice",
    "execute_plan",
    "plan_redistribution",
]


@dataclass(frozen=True, slots=True)
class AllGather:
    """Shard(tensor_dim) -> Replicate on mesh_dim; the gathered dim has full_size elements."""

    mesh_dim: int
    tensor_dim: int
    full_size: int


@dataclass(frozen=True, slots=True)
class Slice:
    """Replicate -> Shard(tensor_dim) on mesh_dim: keep this rank's chunk, no communication."""

    mesh_dim: int
    tensor_dim: int


@dataclass(frozen=True, slots=True)
class AllReduce:
    """Partial(reduce_op) -> Replicate on mesh_dim."""

    mesh_dim: int
    reduce_op: str


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """Partial(reduce_op) -> Shard(tensor_dim) on mesh_dim, one collective."""

    mesh_dim: int
    tensor_dim: int
    reduce_op: str


@dataclass(frozen=True, slots=True)
class AllToAll:
    """Shard(src_dim) -> Shard(dst_dim) on mesh_dim; src_dim becomes src_full long."""

    mesh_dim: int
    src_dim: int
    dst_dim: int
    src_full: int


@dataclass(frozen=True, slots=True)
class Partition:
    """Replicate -> Partial(reduce_op) on mesh_dim: sum keeps the value on coordinate 0 and
    zeros elsewhere (exact, unlike dividing by n); avg/max/min keep the value everywhere."""

    mesh_dim: int
    reduce_op: str


Step = AllGather | Slice | AllReduce | ReduceScatter | AllToAll | Partition

_COLLECTIVE_STEPS = (AllGather, AllReduce, ReduceScatter, AllToAll)


def plan_redistribution(src: DTensorSpec, dst: DTensorSpec) -> tuple[Step, ...]:
    """The steps that turn ``src``'s local tensor into ``dst``'s on this rank (pure, no communication)."""
    if src.mesh != dst.mesh:
        raise NotImplementedError(f"redistribute across different meshes is not supported: {src.mesh} -> {dst.mesh}")
    if src.shape != dst.shape:
        raise ValueError(f"redistribute cannot change the global shape: {src.shape} -> {dst.shape}")
    coord = src.mesh._coordinate
    if coord is None:
        raise RuntimeError(f"rank {src.mesh.get_rank()} is not part of {src.mesh}")
    return _plan(src.shape, src.placements, dst.placements, src.mesh.shape, tuple(coord))


@functools.lru_cache(maxsize=4096)
def _plan(
    shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
) -> tuple[Step, ...]:
    n = len(mesh_shape)
    if 1 in mesh_shape:
        # A mesh dim of size 1 cuts nothing and reduces over one value: every placement on it is
        # the same local data, so it takes no step (no 1-rank collectives) and blocks nothing.
        src = tuple(Replicate() if k == 1 else p for p, k in zip(src, mesh_shape, strict=True))
        dst = tuple(Replicate() if k == 1 else p for p, k in zip(dst, mesh_shape, strict=True))
    cur = list(src)
    steps: list[Step] = []

    def full_size(mesh_dim: int, tensor_dim: int) -> int:
        # Size of tensor_dim before mesh_dim's cut: mesh_dim is the innermost cut here.
        unsplit = cur[:mesh_dim] + [Replicate()] + cur[mesh_dim + 1 :]
        return shard_shape_and_offset(shape, unsplit, mesh_shape, coord)[0][tensor_dim]

    def outer_change_touches(i: int, d: int) -> bool:
        return any(cur[k] != dst[k] and (cur[k].is_shard(d) or dst[k].is_shard(d)) for k in range(i))

    # Phase 1, right to left: take apart the shards that must change.
    for i in reversed(range(n)):
        c, t = cur[i], dst[i]
        if not isinstance(c, Shard):
            continue
        must_move = outer_change_touches(i, c.dim)
        if c == t and not must_move:
            continue
        if (
            isinstance(t, Shard)
            and t.dim != c.dim
            and not outer_change_touches(i, t.dim)
            and not any(cur[j].is_shard(t.dim) for j in range(i + 1, n))
        ):
            steps.append(AllToAll(i, c.dim, t.dim, full_size(i, c.dim)))
            cur[i] = t
        else:
            steps.append(AllGather(i, c.dim, full_size(i, c.dim)))
            cur[i] = Replicate()

    # Phase 2, left to right: apply the remaining targets.
    for i in range(n):
        c, t = cur[i], dst[i]
        if c == t:
            continue
        if isinstance(c, Replicate):
            steps.append(Slice(i, t.dim) if isinstance(t, Shard) else Partition(i, t.reduce_op))
        elif isinstance(c, Partial):
            if isinstance(t, Shard):
                steps.append(ReduceScatter(i, t.dim, c.reduce_op))
            else:
                steps.append(AllReduce(i, c.reduce_op))
                if isinstance(t, Partial):
                    steps.append(Partition(i, t.reduce_op))
        else:  # pragma: no cover - phase 1 moved every changing shard
            raise AssertionError(f"planner left {c} -> {t} on mesh dim {i}")
        cur[i] = t

    if any(isinstance(s, AllGather) for s in steps):
        # Reduce before gathering: all-reduces are valid at any point and the data is smallest first.
        steps.sort(key=lambda s: not isinstance(s, AllReduce))
    return tuple(steps)


def execute_plan(local: torch.Tensor, steps: tuple[Step, ...], spec: DTensorSpec, *, async_op: bool = False):
    """Run ``steps`` on ``local``; returns a tensor, or a ``Pending`` for the last collective if async_op.

    ``local`` is never written: the first step that would work in place copies it first.
    """
    mesh = spec.mesh
    groups, coord = mesh._dim_groups, mesh._coordinate
    x, owned = local, False
    last = len(steps) - 1
    for n, step in enumerate(steps):
        kind = type(step)
        group = groups[step.mesh_dim]
        if kind is AllGather:
            pending = C.all_gather(x, step.tensor_dim, step.full_size, group)
        elif kind is AllReduce:
            pending = C.all_reduce(x, step.reduce_op, group, owned=owned)
        elif kind is ReduceScatter:
            pending = C.reduce_scatter(x, step.tensor_dim, step.reduce_op, group, coord[step.mesh_dim])
        elif kind is AllToAll:
            pending = C.all_to_all(x, step.src_dim, step.dst_dim, step.src_full, group, coord[step.mesh_dim])
        elif kind is Slice:
            size, start = local_shard_size_and_offset(
                x.size(step.tensor_dim), mesh.shape[step.mesh_dim], coord[step.mesh_dim]
            )
            piece = x.narrow(step.tensor_dim, start, size)
            pending = C.done(piece.contiguous() if owned else piece.clone(memory_format=torch.contiguous_format))
        else:  # Partition
            if step.reduce_op == "sum" and coord[step.mesh_dim] != 0:
                pending = C.done(torch.zeros_like(x))
            else:
                pending = C.done(x if owned else x.clone())
        if async_op and n == last:
            return pending
        x, owned = pending.wait(), True
    return x
