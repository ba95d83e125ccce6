"""The job's parallel dimensions in one object (torchtitan's ``ParallelDims``).

The world is laid out as one device mesh, outermost dim first::

    pp x dp_replicate x dp_shard x cp x tp        (row-major: tp ranks are adjacent)

- ``pp``: pipeline parallelism: each pp rank holds a stage (or ``pp_virtual_stages`` of them)
  of the model, and every dim below is that stage's own layout. Outermost, so its ranks are the
  furthest apart: point-to-point activations are the least traffic, and it is the dim that
  crosses nodes. Every pp rank of a data-parallel rank reads the same batch (the first stage its
  inputs, the last its targets).
- ``dp_replicate``: HSDP replica groups (each holds the whole model; gradients all-reduce
  across them). May span nodes.
- ``dp_shard``: the ranks fully_shard shards parameters over (FSDP). With ``tp``, one shard
  group (``dp_shard x tp`` ranks) is what placement keeps inside a node.
- ``cp``: context parallelism: each sequence is split over the cp ranks (ring attention). They
  read the same batch and each takes its part of every sequence, so fully_shard shards over
  ``dp_shard x cp`` (one flattened dim, ``dp_shard_cp``, as torchtitan does): their gradients
  are averaged like data-parallel ones, which is right because every cp rank holds the same
  number of tokens.
- ``tp``: tensor parallelism, innermost, so a tensor-parallel group is consecutive ranks.

Expert parallelism (``ep``) is not a dim of its own: it splits ``dp_shard`` into
``dp_shard_mod_ep x ep`` (torchtitan's layout), so an ep group is ``ep`` consecutive dp_shard
ranks (in one node wherever a shard group is). Each layer's experts are split over its ep
group, the tokens of its ranks exchanged with all-to-all; the ranks with the same experts
(``dp_replicate x dp_shard_mod_ep``, the expert data-parallel ranks) average those experts'
gradients. ``expert_mesh`` is that layout, a mesh of its own over the same ranks.

The data-parallel ranks are ``dp_replicate x dp_shard``: every context- and tensor-parallel rank
of one data-parallel rank reads the same batch. A new dimension (pipeline, context, expert) is added
here: its size, its place in the mesh order, whether fully_shard shards over it, and what it
does to the data-parallel rank; the trainer, placement and preflight read it from here.

It imports no torch until ``build_mesh``: the spec's checks (``hpservice validate``, the API) use
the sizes without it. ``hpservice.parallel`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpservice.dtensor import DeviceMesh
    from hpservice.spec import ParallelismSpec

__all__ = ["CP", "DP", "DP_REPLICATE", "DP_SHARD", "DP_SHARD_CP", "DP_SHARD_MOD_EP", "EP", "PP", "TP", "ParallelDims"]

PP, DP_REPLICATE, DP_SHARD, CP, TP = "pp", "dp_replicate", "dp_shard", "cp", "tp"  # the mesh's dims, outer to inner
DP = "dp"  # dp_replicate and dp_shard flattened: the ranks whose batches differ
DP_SHARD_CP = "dp_shard_cp"  # dp_shard and cp flattened: what fully_shard shards over with cp
_DATA_PARALLEL = (DP_REPLICATE, DP_SHARD)
EP, DP_SHARD_MOD_EP = "ep", "dp_shard_mod_ep"  # dp_shard split for expert parallelism (expert_mesh)


@dataclass
class ParallelDims:
    """Sizes of every dimension for ``world_size`` ranks (their product), and, once
    ``build_mesh`` ran, the mesh and this rank's place in it."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    cp: int = 1
    pp: int = 1
    ep: int = 1
    cp_rotate: str = "ring"  # how context parallelism passes keys and values (parallelism.cp_rotate)
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        if min(sizes) < 1 or self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp != self.world_size:
            raise ValueError(
                f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp} x tp "
                f"{self.tp} != world size {self.world_size}"
            )
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ValueError(f"ep {self.ep} must divide dp_shard {self.dp_shard} (experts split over dp_shard ranks)")

    @classmethod
    def from_spec(cls, parallelism: ParallelismSpec, world_size: int) -> ParallelDims:
        """The job's dims on ``world_size`` ranks (``dp_shard: -1`` takes the rest); raises the
        spec's SpecError, naming the fields, when they do not multiply to the world."""
        replicate, shard = parallelism.resolve(world_size)
        ep = parallelism.ep
        if shard % ep:
            from hpservice.spec import SpecError

            raise SpecError(
                f"parallelism: ep {ep} must divide dp_shard {shard} (each layer's experts are split over ep of the "
                "dp_shard ranks)",
                [("parallelism.ep", f"{ep} does not divide dp_shard {shard}")],
            )
        return cls(
            replicate, shard, parallelism.tp, world_size, cp=parallelism.cp, pp=parallelism.pp, ep=ep,
            cp_rotate=parallelism.cp_rotate,
        )  # fmt: skip

    # ---- sizes: pure, before any process group exists --------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many slices each global batch splits into."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group_size(self) -> int:
        """Ranks of one shard group, ``dp_shard x cp x tp`` (the innermost dims): placement keeps
        one inside a node."""
        return self.dp_shard * self.cp * self.tp

    @property
    def mesh_dims(self) -> list[tuple[str, int]]:
        """(name, size) of the mesh's dims, outer to inner. Dims of size 1 are left out, except
        ``dp_shard`` unless tp or cp stands in for it (so fully_shard always has a dim to shard
        over when there is any data parallelism)."""
        dims = [(PP, self.pp), (DP_REPLICATE, self.dp_replicate), (DP_SHARD, self.dp_shard), (CP, self.cp), (TP, self.tp)]
        keep_shard = self.cp == 1 and (self.tp == 1 or self.dp_replicate > 1)
        return [(n, s) for n, s in dims if s > 1 or (n == DP_SHARD and keep_shard)]

    @property
    def fsdp_dim_names(self) -> tuple[str, ...]:
        """The mesh dims fully_shard shards over (``(dp_replicate, dp_shard)`` is HSDP; with cp,
        ``dp_shard`` and ``cp``, flattened); empty with tensor parallelism alone."""
        return tuple(n for n, _ in self.mesh_dims if n in (*_DATA_PARALLEL, CP))

    # ---- the mesh: after torch.distributed is initialised ----------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Builds (once) and returns the world mesh on this rank."""
        if self._mesh is None:
            from hpservice.dtensor import init_device_mesh

            names, sizes = zip(*self.mesh_dims, strict=True)
            self._mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        return self._mesh

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """With ep > 1: the world's ranks as ``dp_replicate x dp_shard_mod_ep x ep x tp`` (built
        once, on every rank: it creates process groups); ``expert_mesh["ep"]`` splits the experts,
        ``expert_mesh[("dp_replicate", "dp_shard_mod_ep")]`` holds the same ones."""
        if self.ep == 1:
            return None
        if self._expert_mesh is None:
            from hpservice.dtensor import DeviceMesh

            ranks = self.world_mesh.mesh.reshape(self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)
            names = (DP_REPLICATE, DP_SHARD_MOD_EP, EP, TP)
            self._expert_mesh = DeviceMesh(self.world_mesh.device_type, ranks, mesh_dim_names=names)
        return self._expert_mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) has not run on this rank yet")
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The sub-mesh fully_shard shards over (None with tensor parallelism alone); with cp,
        ``dp_shard x cp`` flattened into one dim (``dp_shard_cp``), after ``dp_replicate`` for HSDP."""
        names = self.fsdp_dim_names
        if not names:
            return None
        sharded = tuple(n for n in names if n in (DP_SHARD, CP))
        if CP in sharded and len(sharded) > 1:
            self.world_mesh[sharded].flatten(DP_SHARD_CP)  # once; cached on the mesh
            names = tuple(n for n in names if n not in sharded) + (DP_SHARD_CP,)
        return self.world_mesh[names]

    @property
    def batch_mesh(self) -> DeviceMesh | None:
        """The ranks whose batches differ (``dp_replicate x dp_shard``, flattened as ``dp``):
        what a step's valid labels are counted over. None with one data-parallel rank. Every
        rank asks for it at the same point (its first use may create a process group)."""
        if self.dp_size == 1:
            return None
        names = tuple(n for n, _ in self.mesh_dims if n in _DATA_PARALLEL)
        return self.world_mesh[names].flatten(DP) if len(names) > 1 else self.world_mesh[names[0]]

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The ranks one sequence is split over (None without context parallelism)."""
        return self.world_mesh[CP] if self.cp > 1 else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """The ranks one micro-batch goes through, stage by stage (None without pipeline parallelism)."""
        return self.world_mesh[PP] if self.pp > 1 else None

    @property
    def stage_mesh(self) -> DeviceMesh:
        """The mesh of this rank's pipeline stage: every dim but pp (the world mesh without pp)."""
        if self.pp == 1:
            return self.world_mesh
        return self.world_mesh[tuple(n for n, _ in self.mesh_dims if n != PP)]

    @property
    def pp_rank(self) -> int:
        """Which stages this rank holds (stage ``s`` on pp rank ``s % pp``); 0 without pp."""
        return self.world_mesh.get_local_rank(PP) if self.pp > 1 else 0

    def pp_rank_of(self, rank: int) -> int:
        """The pp rank of global ``rank``: pp is the outermost mesh dim (pure: no mesh needed)."""
        return rank // (self.world_size // self.pp)

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh[TP] if self.tp > 1 else None

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index, row-major over (dp_replicate, dp_shard): which slice
        of each global batch it reads."""
        rank = 0
        for name, size in self.mesh_dims:
            if name in _DATA_PARALLEL:
                rank = rank * size + self.world_mesh.get_local_rank(name)
        return rank

    @property
    def cp_rank(self) -> int:
        """Which part of each sequence this rank holds (0 without context parallelism)."""
        return self.world_mesh.get_local_rank(CP) if self.cp > 1 else 0
