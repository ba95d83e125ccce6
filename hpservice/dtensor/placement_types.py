"""Placements: how a DTensor's global value maps onto one mesh dimension.

``Shard(d)`` splits tensor dim ``d`` into ``torch.chunk`` pieces over the mesh dim,
``Replicate()`` keeps a full copy on every rank, ``Partial(op)`` holds values whose
reduction over the mesh dim (sum, avg, max, min) is the global value.

Placements are immutable values: equality and hashing are by (kind, fields), so they are
safe keys for the layout and plan caches (AUDIT row: ``Shard(0)`` and ``Replicate()``
must not hash equal).
"""

from __future__ import annotations

__all__ = ["Partial", "Placement", "Replicate", "Shard"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class. Subclasses are immutable; compare and hash by value."""

    __slots__ = ("_hash",)

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (type(self), self._fields())

    def _fields(self) -> tuple:
        return ()


class Shard(Placement):
    """Split tensor dim ``dim`` over the mesh dim in ``torch.chunk`` pieces (last ones may be smaller or empty)."""

    __slots__ = ("dim",)

    def __init__(self, dim: int):
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"Shard(dim): dim must be an int, got {dim!r}")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "_hash", hash(("Shard", dim)))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def _fields(self) -> tuple:
        return (self.dim,)

    __hash__ = Placement.__hash__

    def __eq__(self, other) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


class Replicate(Placement):
    """A full copy of the tensor on every rank of the mesh dim."""

    __slots__ = ()

    def __init__(self):
        object.__setattr__(self, "_hash", hash(("Replicate",)))

    def is_replicate(self) -> bool:
        return True

    __hash__ = Placement.__hash__

    def __eq__(self, other) -> bool:
        return type(other) is Replicate

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


class Partial(Placement):
    """Pending reduction: the global value is ``reduce_op`` over the ranks of the mesh dim."""

    __slots__ = ("reduce_op",)

    def __init__(self, reduce_op: str = "sum"):
        if reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op): got {reduce_op!r}, allowed: {', '.join(_REDUCE_OPS)}")
        object.__setattr__(self, "reduce_op", reduce_op)
        object.__setattr__(self, "_hash", hash(("Partial", reduce_op)))

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def _fields(self) -> tuple:
        return (self.reduce_op,)

    __hash__ = Placement.__hash__

    def __eq__(self, other) -> bool:
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __repr__(self) -> str:
        return f"Partial(reduce_op={self.reduce_op!r})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"
