"""DTensor: a torch.Tensor subclass that holds one rank's piece of a global tensor.

The wrapper has the *global* shape, dtype and device; the data lives in ``_local_tensor``
(this rank's piece, per ``_spec``: mesh + placements + global shape). Autograd runs on the
wrapper; operators reach ``__torch_dispatch__`` (``_dispatch.py``), which runs them on the
local tensors. ``from_local``, ``to_local``, ``redistribute`` and ``full_tensor`` are autograd
functions, so gradients flow back with the matching placements (as in torch's DTensor).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_supported_types
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_supported_types

from .._graph_break import eager_under_compile
from . import _collectives as C
from ._layout import DTensorSpec, local_shard_size_and_offset, normalize_placements, replicate_all
from ._redistribute import execute_plan, plan_redistribution
from .device_mesh import DeviceMesh, mesh_device
from .placement_types import Partial, Placement, Replicate, Shard

__all__ = ["DTensor", "distribute_tensor"]


class DTensor(torch.Tensor):
    """A global tensor sharded/replicated/partial over a DeviceMesh; see ``placements``."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    # Set on a view op's result computed from redistributed data (not an alias of its input):
    # in-place writes into it raise instead of silently missing the input (``_dispatch``).
    _copy_of: str | None = None
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=local_tensor.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        # The lazy conjugate / negative bits of the local tensor (torch.conj, _neg_view) are the
        # DTensor's too: resolve_conj() and is_conj() read them from the wrapper.
        if local_tensor.is_conj():
            torch._C._set_conj(r, True)
        if local_tensor.is_neg():
            torch._C._set_neg(r, True)
        r._local_tensor = local_tensor
        r._spec = spec
        r._pending = None
        return r

    # ---- metadata ------------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"DTensor(local_tensor={self._wait_local()}, device_mesh={self.device_mesh}, placements={self.placements})"
        )

    def _wait_local(self) -> torch.Tensor:
        """The local tensor, waiting first if an async redistribution produced it."""
        if self._pending is not None:
            self._local_tensor = self._pending.wait()
            self._pending = None
        return self._local_tensor

    # ---- copies and pickles (torch.save, pickle, copy.deepcopy) -------------------------------
    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        local = copy.deepcopy(self._wait_local().detach(), memo)
        out = DTensor(local, self._spec, requires_grad=self.requires_grad)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        """The local tensor, the spec (its mesh pickles by layout) and whether it is a Parameter;
        loading re-binds the mesh to the loading process's groups."""
        return (
            _rebuild_dtensor,
            (self._wait_local().detach(), self._spec, self.requires_grad, isinstance(self, torch.nn.Parameter)),
        )

    # ---- torch.compile: a traceable tensor subclass ------------------------------------------
    # AOTAutograd traces our dispatch on the local tensor (collectives become functional ones,
    # ``_collectives``); the spec is the compiled graph's metadata, guarded by equality.
    # ``from_local`` / ``to_local`` / ``redistribute`` run eagerly (graph breaks between compiled
    # regions), where torch's dynamo knows torch's own DTensor constructors.
    def __tensor_flatten__(self):
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner_tensors, spec, outer_size, outer_stride):
        return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=inner_tensors["_local_tensor"].requires_grad)

    def _stable_hash_for_caching(self) -> str:
        """The key AOTAutograd's on-disk cache files this tensor's graphs under. A graph traced
        through our dispatch holds this rank's own work (which rank keeps a Partial's bias, where
        an uneven shard ends) and the names of the process groups its collectives use, so the
        key holds this rank's coordinate and those names besides the layout: another rank, or
        a process whose groups are named otherwise, compiles its own graph."""
        spec, local = self._spec, self._wait_local()
        mesh = spec.mesh
        key = (
            type(self).__qualname__,
            mesh.device_type,
            mesh.mesh.tolist(),
            mesh.mesh_dim_names,
            mesh.get_coordinate(),
            [mesh.get_group(i).group_name for i in range(mesh.ndim)] if mesh.get_coordinate() is not None else None,
            [repr(p) for p in spec.placements],
            spec.shape,
            spec.stride,
            self.requires_grad,
            (str(local.dtype), tuple(local.shape), tuple(local.stride()), local.device.type, local.requires_grad),
        )
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    def __coerce_same_metadata_as_tangent__(self, expected_spec: DTensorSpec, expected_type=None):
        """A compiled backward was traced for a gradient with ``expected_spec``: redistribute
        this one to it (the same global value)."""
        if expected_type is not None and expected_type is not DTensor:
            return None
        if expected_spec == self._spec:
            return self
        return self.redistribute(expected_spec.mesh, expected_spec.placements)

    # ---- torch.distributed.checkpoint protocol ------------------------------------------------
    # DCP asks each tensor for the chunk(s) this rank holds (global offsets and sizes) and for the
    # data of a chunk; with these, DCP's planners save each rank's shard, deduplicate replicas and
    # reshard on load (another mesh, world size, or a plain tensor).
    def _checkpoint_chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        if self._spec.has_partial():
            raise ValueError(
                f"cannot checkpoint a DTensor with Partial placements {self.placements}; redistribute to Replicate first"
            )
        return ChunkStorageMetadata(
            offsets=torch.Size(self._spec.local_offset), sizes=torch.Size(self._spec.local_shape)
        )

    def __create_write_items__(self, fqn: str, object):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        chunk = self._checkpoint_chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._wait_local()),
                    size=torch.Size(self._spec.shape),
                ),
            )
        ]

    def __create_chunk_list__(self):
        return [self._checkpoint_chunk()]

    def __get_tensor_shard__(self, index):
        self._checkpoint_chunk()
        return self._wait_local()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from ._dispatch import dispatch

        return dispatch(func, args, kwargs or {})

    # ---- conversions -----------------------------------------------------------------------
    @staticmethod
    @eager_under_compile
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: torch.Size | Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        grad_placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Wrap this rank's piece. Without ``shape`` the global shape of sharded dims is found by
        gathering the local sizes (exact for uneven shards; never "local size x ranks"): hot paths
        pass ``shape``. ``run_check=True`` makes Replicate dims agree as torch does (rank 0 of each
        replicating group broadcasts; the result then no longer aliases ``local_tensor``) and
        checks sharded local shapes against ``shape``. ``grad_placements``: the placements the
        gradient of ``local_tensor`` is redistributed to (default ``placements``)."""
        if device_mesh is None:
            raise ValueError("DTensor.from_local: device_mesh is required")
        if isinstance(local_tensor, DTensor):
            raise TypeError("DTensor.from_local: expected a torch.Tensor, got a DTensor")
        placements = normalize_placements(
            placements if placements is not None else replicate_all(device_mesh), device_mesh, local_tensor.ndim
        )
        if local_tensor.device.type != device_mesh.device_type and local_tensor.device.type != "meta":
            local_tensor = local_tensor.to(device_mesh.device_type)
        if shape is None:
            sharded = any(p.is_shard() for p in placements)
            shape = _global_shape(local_tensor.shape, device_mesh, placements) if sharded else local_tensor.shape
        elif run_check:
            expected = DTensorSpec(device_mesh, placements, tuple(shape)).local_shape
            if tuple(local_tensor.shape) != expected:
                raise ValueError(
                    f"from_local: local shape {tuple(local_tensor.shape)} != {expected} for shape {tuple(shape)}"
                )
        if run_check:
            _check_local_metadata(local_tensor, device_mesh, placements)
            local_tensor = _broadcast_replicas(local_tensor, device_mesh, placements)
        spec = DTensorSpec(device_mesh, placements, tuple(shape), tuple(stride) if stride is not None else None)
        if torch.is_grad_enabled() and local_tensor.requires_grad:
            grad_spec = (
                spec
                if grad_placements is None
                else spec.with_placements(normalize_placements(grad_placements, device_mesh, local_tensor.ndim))
            )
            return _FromLocal.apply(local_tensor, spec, grad_spec, grad_placements is not None)
        return DTensor(local_tensor, spec, requires_grad=False)

    @eager_under_compile
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece; differentiable (the gradient comes back with ``grad_placements``,
        default this tensor's placements)."""
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._wait_local()
        return _ToLocal.apply(self, tuple(grad_placements) if grad_placements is not None else None)

    @eager_under_compile
    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """A new DTensor with ``placements`` on ``device_mesh`` (same global value); this one is unchanged.

        ``forward_dtype``: cast before the collective (the result has that dtype);
        ``backward_dtype``: the gradient's collective runs in it, then the gradient is cast back to
        this tensor's dtype (default: the collective runs in this tensor's dtype), as torch's."""
        mesh = device_mesh if device_mesh is not None else self._spec.mesh
        if placements is None:
            raise ValueError("redistribute: placements is required")
        placements = normalize_placements(placements, mesh, self.ndim)
        src = self
        if forward_dtype is not None and forward_dtype != self.dtype:
            src = self.to(forward_dtype)  # differentiable: the gradient comes back in self's dtype
        if mesh == self._spec.mesh and placements == self._spec.placements and backward_dtype is None:
            return src
        dst = (
            src._spec.with_placements(placements)
            if mesh == src._spec.mesh
            else DTensorSpec(mesh, placements, src._spec.shape, src._spec.stride)
        )
        if torch.is_grad_enabled() and src.requires_grad:
            return _Redistribute.apply(src, dst, async_op, backward_dtype)
        return _redistribute(src, dst, async_op)

    @eager_under_compile
    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (all-gathers / all-reduces as needed)."""
        return self.redistribute(self._spec.mesh, replicate_all(self._spec.mesh)).to_local(
            grad_placements=grad_placements
        )


# torch.optim and clip_grad_norm_ take their multi-tensor (foreach) paths only for tensor types in
# these lists (on devices with foreach kernels, e.g. CUDA); our _foreach_* dispatch runs them on the
# local shards, as torch's own DTensor registers itself.
for _types in (_optim_foreach_supported_types, _util_foreach_supported_types):
    if DTensor not in _types:
        _types.append(DTensor)


def _rebuild_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool, is_param: bool) -> DTensor:
    out = DTensor(local, spec, requires_grad=requires_grad and not is_param)
    return torch.nn.Parameter(out, requires_grad=requires_grad) if is_param else out


def _register_safe_globals() -> None:
    """``torch.load`` (weights_only, the default) may rebuild our DTensors: the functions below
    build tensors and meshes from data, nothing else."""
    from . import device_mesh, placement_types

    torch.serialization.add_safe_globals(
        [
            _rebuild_dtensor,
            DTensorSpec,
            device_mesh._rebuild_mesh,
            placement_types.Shard,
            placement_types.Replicate,
            placement_types.Partial,
        ]
    )


_register_safe_globals()


def _redistribute(src: DTensor, dst: DTensorSpec, async_op: bool) -> DTensor:
    steps = plan_redistribution(src._spec, dst)
    local = execute_plan(src._wait_local(), steps, src._spec, async_op=async_op)
    if isinstance(local, C.Pending):
        out = DTensor(torch.empty(0, dtype=src.dtype, device=src.device), dst, requires_grad=False)
        out._pending = local
        return out
    return DTensor(local, dst, requires_grad=False)


def _grad_placements(forward: Sequence[Placement], grad: Sequence[Placement]) -> tuple[Placement, ...]:
    """The gradient of a Partial input is Replicate (d global / d local is the identity on each rank)."""
    return tuple(
        Replicate() if f.is_partial() and not g.is_partial() else f for f, g in zip(forward, grad, strict=True)
    )


class _FromLocal(torch.autograd.Function):
    """The gradient of ``local_tensor`` as torch's from_local gives it: by default the forward
    placements, a Partial one taken as Replicate (d global / d local is the identity per rank);
    with ``grad_placements`` given explicitly, those, where a Replicate gradient asked for as
    Partial(sum) is divided by the group size on every rank (torch's partition of a replicated
    value), so each rank's local gradient is torch's."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_spec: DTensorSpec, explicit: bool):
        ctx.spec, ctx.explicit = grad_spec, explicit
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        wanted = ctx.spec.placements
        divide = 1
        if ctx.explicit:
            split = []
            for i, (w, g) in enumerate(zip(wanted, grad.placements, strict=True)):
                if w.is_partial("sum") and g.is_replicate():
                    divide *= ctx.spec.mesh.size(i)
                    split.append(Replicate())  # partitioned below, by division as torch does
                else:
                    split.append(w)
            wanted = tuple(split)
        target = ctx.spec.with_placements(_grad_placements(wanted, grad.placements))
        if grad._spec != target:
            grad = _redistribute(grad, grad._spec.with_placements(target.placements), False)
        local = grad._wait_local()
        return (local / divide if divide > 1 else local), None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, grad_placements):
        ctx.spec = (
            dt._spec
            if grad_placements is None
            else dt._spec.with_placements(normalize_placements(grad_placements, dt._spec.mesh, dt.ndim))
        )
        local = dt._wait_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return DTensor(grad, ctx.spec, requires_grad=False), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, dst: DTensorSpec, async_op: bool, backward_dtype: torch.dtype | None = None):
        ctx.src = dt._spec
        ctx.backward_dtype = backward_dtype
        return _redistribute(dt, dst, async_op)

    @staticmethod
    def backward(ctx, grad: DTensor):
        target = ctx.src.with_placements(_grad_placements(ctx.src.placements, grad.placements))
        if grad._spec.placements != target.placements:
            dtype = grad.dtype
            if ctx.backward_dtype is not None and ctx.backward_dtype != dtype:
                grad = DTensor(grad._wait_local().to(ctx.backward_dtype), grad._spec, requires_grad=False)
            grad = _redistribute(grad, grad._spec.with_placements(target.placements), False)
            if grad.dtype != dtype:
                grad = DTensor(grad._wait_local().to(dtype), grad._spec, requires_grad=False)
        return grad, None, None, None


def _check_local_metadata(local: torch.Tensor, mesh: DeviceMesh, placements) -> None:
    """``run_check``: the pieces of one DTensor agree, as torch's ``check_tensor_meta`` makes
    them: the same dtype and ``requires_grad`` on every rank, and the same local shape except
    along a dim sharded over the mesh dim that tells them apart (uneven shards are fine: the
    global shape is gathered exactly; torch requires even ones there). Compared within each mesh
    dim's group, whose ranks differ only in that coordinate. ``ValueError`` otherwise, on every
    rank (each sees the same gathered list)."""
    if local.is_meta:
        return
    for i, p in enumerate(placements):
        if mesh.size(i) == 1:
            continue
        free = p.dim if isinstance(p, Shard) else None
        mine = (str(local.dtype), bool(local.requires_grad), tuple(local.shape))
        seen = [None] * mesh.size(i)
        dist.all_gather_object(seen, mine, group=mesh.get_group(i))

        keys = [(dtype, grad, len(shape), tuple(n for d, n in enumerate(shape) if d != free)) for dtype, grad, shape in seen]
        if any(k != keys[0] for k in keys):
            name = mesh.mesh_dim_names[i] if mesh.mesh_dim_names else str(i)
            raise ValueError(
                f"DTensor.from_local(run_check=True): inconsistent tensor metadata across the ranks of mesh dim "
                f"{name} ({p}): (dtype, requires_grad, local shape) per rank {seen}"
            )


def _broadcast_replicas(local: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """``run_check``: every Replicate mesh dim takes the value of its group's rank 0, as torch's
    from_local does; the gradient passes through unchanged (identity per rank)."""
    dims = [i for i, p in enumerate(placements) if p.is_replicate() and mesh.size(i) > 1]
    if not dims or local.is_meta:
        return local
    with torch.no_grad():
        value = local.detach()
        for i in dims:
            value = C.broadcast(value, mesh.get_group(i), 0)
    if local.requires_grad:
        return local + (value - local).detach()
    return value


def _global_shape(local_shape, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """Exact global shape from local shapes: sum the local sizes over each sharding mesh dim,
    innermost first (one small all-gather per sharded mesh dim)."""
    shape = list(local_shape)
    for mesh_dim in reversed(range(mesh.ndim)):
        p = placements[mesh_dim]
        if not isinstance(p, Shard):
            continue
        group = mesh.get_group(mesh_dim)
        k = mesh.size(mesh_dim)
        mine = torch.tensor([shape[p.dim]], dtype=torch.int64, device=mesh_device(mesh))
        sizes = torch.empty(k, dtype=torch.int64, device=mine.device)
        C._all_gather_single(sizes, mine, group=group)
        sizes = sizes.tolist()
        total = sum(sizes)
        expected = [local_shard_size_and_offset(total, k, j)[0] for j in range(k)]
        if sizes != expected:
            raise ValueError(
                f"from_local: local sizes {sizes} of dim {p.dim} over mesh dim {mesh_dim} are not torch.chunk "
                f"pieces of {total} (expected {expected}); pass shape= for custom layouts"
            )
        shape[p.dim] = total
    return tuple(shape)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute a full tensor. With ``src_data_rank`` (a group rank, default 0) the data of
    that rank is scattered/broadcast along each mesh dim; with None every rank slices its own
    copy locally, without communication. The result is a leaf (``requires_grad`` as ``tensor``)."""
    if device_mesh is None:
        raise ValueError("distribute_tensor: device_mesh is required")
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor: tensor is already a DTensor; use redistribute")
    mesh = device_mesh
    placements = normalize_placements(placements if placements is not None else replicate_all(mesh), mesh, tensor.ndim)
    coord = mesh._coordinate
    if coord is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not part of {mesh}")
    local, fresh = tensor.detach(), False
    if local.device.type != mesh.device_type and not local.is_meta:  # meta stays meta (materialised later)
        local, fresh = local.to(mesh_device(mesh)), True
    for mesh_dim, p in enumerate(placements):
        k, index = mesh.size(mesh_dim), coord[mesh_dim]
        if src_data_rank is not None and not local.is_meta:
            group = mesh.get_group(mesh_dim)
            fresh = True
            if isinstance(p, Shard):
                local = C.scatter(local, p.dim, group, src_data_rank, index)
                continue
            local = C.broadcast(local, group, src_data_rank)
        if isinstance(p, Shard):
            size, start = local_shard_size_and_offset(local.size(p.dim), k, index)
            local = local.narrow(p.dim, start, size)
        elif isinstance(p, Partial) and p.reduce_op == "sum" and index != 0:
            local, fresh = torch.zeros_like(local), True
    if not fresh or not local.is_contiguous():
        # Never alias the caller's tensor: in-place updates of the DTensor must not reach it.
        local = local.clone(memory_format=torch.contiguous_format)
    spec = DTensorSpec(mesh, placements, tuple(tensor.shape))
    return DTensor(local, spec, requires_grad=tensor.requires_grad)
