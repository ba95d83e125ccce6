"""Layout math: global shape + mesh + placements -> this rank's local shape and offset.

Sharding is nested left to right over mesh dims: with ``(Shard(0), Shard(0))`` on a 2x2 mesh,
dim 0 is first cut in 2 ``torch.chunk`` pieces over mesh dim 0, then each piece in 2 over mesh
dim 1. Chunk sizes are ``torch.chunk``'s: ceil(n / k) each, the last ones smaller or empty
(n=5 over 4 ranks gives 2, 2, 1, 0; AUDIT 8). The global shape is always stored, never
recomputed as "local size x ranks".

A ``DTensorSpec`` is immutable and shared between tensors (AUDIT 12): operations that keep the
layout reuse the same object, and its hash is computed once.
"""

from __future__ import annotations

from collections.abc import Sequence

from .device_mesh import DeviceMesh
from .placement_types import Placement, Replicate, Shard

__all__ = ["DTensorSpec", "chunk_sizes", "contiguous_strides", "local_shard_size_and_offset"]


def local_shard_size_and_offset(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Size and start of chunk ``index`` when ``size`` is cut like ``torch.chunk(size, num_chunks)``."""
    chunk = -(-size // num_chunks)
    start = min(index * chunk, size)
    return min(size, start + chunk) - start, start


def chunk_sizes(size: int, num_chunks: int) -> tuple[int, ...]:
    return tuple(local_shard_size_and_offset(size, num_chunks, i)[0] for i in range(num_chunks))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def normalize_placements(placements: Sequence[Placement], mesh: DeviceMesh, ndim: int) -> tuple[Placement, ...]:
    """Check count and types; turn ``Shard(-1)`` into ``Shard(ndim - 1)``."""
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"placements {list(map(str, placements))} has {len(placements)} entries for a {mesh.ndim}-d mesh {mesh}"
        )
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            p = _from_torch_placement(p)
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{p!r} is out of range for a tensor with {ndim} dims")
            if p.dim < 0:
                p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def _from_torch_placement(p) -> Placement:
    """torch.distributed.tensor's Shard/Replicate/Partial (code written for torch's DTensor, such
    as torch's state-dict helpers, passes them) as ours; anything else is an error."""
    from .placement_types import Partial

    if type(p).__module__.startswith("torch.distributed.tensor"):
        if type(p).__name__ == "Shard":
            return Shard(p.dim)
        if type(p).__name__ == "Replicate":
            return Replicate()
        if type(p).__name__ == "Partial":
            return Partial(p.reduce_op)
    raise TypeError(f"placements: expected Shard/Replicate/Partial, got {p!r}")


class DTensorSpec:
    """Immutable (mesh, placements, global shape, global stride); local shape/offset computed once."""

    __slots__ = ("_hash", "_local", "contiguous", "mesh", "placements", "shape", "stride")

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        shape: tuple[int, ...],
        stride: tuple[int, ...] | None = None,
    ):
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "shape", tuple(shape))
        dense = contiguous_strides(shape)
        object.__setattr__(self, "stride", tuple(stride) if stride is not None else dense)
        object.__setattr__(self, "contiguous", self.stride == dense)
        object.__setattr__(self, "_hash", hash((mesh, placements, self.shape, self.stride)))
        object.__setattr__(self, "_local", None)

    def __setattr__(self, name, value):
        raise AttributeError("DTensorSpec is immutable")

    def __deepcopy__(self, memo) -> DTensorSpec:
        return self  # immutable and shared (AUDIT 12)

    def __reduce__(self):
        return (DTensorSpec, (self.mesh, self.placements, self.shape, self.stride))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, DTensorSpec)
            and self._hash == other._hash
            and self.mesh == other.mesh
            and self.placements == other.placements
            and self.shape == other.shape
            and self.stride == other.stride
        )

    def __repr__(self) -> str:
        return f"DTensorSpec({self.mesh}, ({', '.join(map(str, self.placements))}), shape={self.shape})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_placements(self, placements: tuple[Placement, ...]) -> DTensorSpec:
        if placements == self.placements:
            return self
        return DTensorSpec(self.mesh, placements, self.shape, self.stride)

    def _local_layout(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self._local is None:
            coord = self.mesh._coordinate
            if coord is None:
                layout = ((0,) * self.ndim, (0,) * self.ndim)
            else:
                layout = shard_shape_and_offset(self.shape, self.placements, self.mesh.shape, coord)
            object.__setattr__(self, "_local", layout)
        return self._local

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's local tensor."""
        return self._local_layout()[0]

    @property
    def local_offset(self) -> tuple[int, ...]:
        """Offset of this rank's local tensor inside the global tensor, per dim."""
        return self._local_layout()[1]

    def has_partial(self) -> bool:
        return any(p.is_partial() for p in self.placements)

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)


def shard_shape_and_offset(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset for the rank at ``coordinate`` (nested, left to right)."""
    size, offset = list(shape), [0] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            n, start = local_shard_size_and_offset(size[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            size[p.dim] = n
            offset[p.dim] += start
    return tuple(size), tuple(offset)


def replicate_all(mesh: DeviceMesh) -> tuple[Placement, ...]:
    return (Replicate(),) * mesh.ndim
