"""FSDPParam: one parameter's sharded and unsharded forms inside its group's flat buffers.

Sharding: the parameter is cut along ``shard_dim`` (0 unless ``shard_placement_fn`` says
otherwise) into ``torch.chunk`` pieces over the S ranks of the shard group. Every piece is
padded to the chunk size ``c = ceil(n / S)``, so all ranks hold ``numel`` = ``prod(padded piece
shape)`` elements for it at offset ``offset`` of the group's flat shard. Padding is never
visible: the registered parameter is a DTensor whose local tensor is the unpadded view.

Unsharded: after the all-gather, the group's rank-major output ``(S, C)`` is copied into this
parameter's slot of the group's unsharded flat buffer as a padded full tensor (``S * c`` along
``shard_dim``); the unsharded parameter (a plain ``nn.Parameter``, what forward and backward
use) is the unpadded view of it. The slot's storage is freed on reshard and regrown, not
reallocated, so tensors autograd saved stay valid.

With tensor parallelism (a parameter that is already a DTensor on a "tp" mesh, from
``hpservice.parallel``), FSDP shards the parameter's *local* tensor over the data-parallel mesh:
the unsharded form is the tp DTensor again, and the sharded form is one DTensor on the combined
mesh ``(dp dims..., tp dims...)`` with placements ``(dp placements..., tp placements...)``. FSDP
cuts a tensor dim that tp does not shard (dim 0 for a rowwise weight, dim 1 for a colwise one),
so the nested placements describe exactly the bytes each rank holds, with no strided layout, and
the optimizer, global norms and checkpoints (whose chunk offsets come from the spec) need nothing
special. A parameter tp shards on every dim (a colwise bias) is cut again on a tp-sharded dim: its
sharded form lives on the mesh ``(tp dims..., dp dims...)``, where nested placements (tp splits the
dim first, then dp splits each piece) again describe the bytes exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from hpservice.dtensor import DeviceMesh, DTensor, Replicate, Shard
from hpservice.dtensor._layout import DTensorSpec, local_shard_size_and_offset

from ._fsdp_common import FSDPMeshInfo, HSDPMeshInfo


def combined_mesh(first: DeviceMesh, second: DeviceMesh) -> DeviceMesh:
    """The mesh ``(first's dims..., second's dims...)`` of their root mesh, for parameters sharded
    by both fully_shard (the data-parallel mesh) and tensor parallelism."""
    root = first._root
    if second._root is not root or set(first._root_dims) & set(second._root_dims):
        raise ValueError(
            f"fully_shard: a DTensor parameter needs a data-parallel mesh from the same root mesh as its own, "
            f"on other dims (e.g. world['dp_shard'] and world['tp']); got {first!r} and {second!r}"
        )
    if not root.mesh_dim_names:
        raise ValueError("fully_shard: a DTensor parameter needs a root mesh with mesh_dim_names")
    # by the meshes' own dim names (sub-meshes of a named root always have them): a flattened
    # data-parallel dim (dp_shard_cp) stays one dim
    return root._slice((*first.mesh_dim_names, *second.mesh_dim_names))


class FSDPParam:
    """Metadata and views for one parameter managed by an FSDPParamGroup."""

    def __init__(
        self, param: nn.Parameter, uses: list[tuple[nn.Module, str]], shard_dim: int | None, mesh_info: FSDPMeshInfo
    ):
        self.uses = uses  # every (module, attribute name) that holds this parameter (tied weights)
        self._requires_grad_at_init = param.requires_grad
        self.orig_dtype = param.dtype
        # Tensor parallelism: FSDP works on the local tensor; ``tp_spec`` is the parameter's layout.
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        local = param._local_tensor if self.tp_spec is not None else param
        self.shape = tuple(local.shape)  # what FSDP shards: the tp-local shape
        if param.ndim == 0:  # torch's error class and advice
            raise ValueError(
                f"fully_shard doesn't support scalar parameters ({uses[0][1]!r}). "
                "Change it to a 1D tensor with numel equal to 1, or pass it in ignored_params."
            )
        tp_dims = {p.dim % param.ndim for p in self.tp_spec.placements if p.is_shard()} if self.tp_spec else set()
        if shard_dim is None:  # the first dim tensor parallelism leaves whole (dim 0 if it shards them all)
            shard_dim = next((d for d in range(param.ndim) if d not in tp_dims), 0)
        self.shard_dim = shard_dim % param.ndim
        mesh = self.mesh = mesh_info.mesh
        self.shard_size = mesh_info.shard_mesh_size  # S
        self.rank = mesh_info.shard_mesh_rank
        n = self.shape[self.shard_dim]
        self.chunk = -(-n // self.shard_size)
        self.local_size, _ = local_shard_size_and_offset(n, self.shard_size, self.rank)
        self.padded_shard_shape = self.shape[: self.shard_dim] + (self.chunk,) + self.shape[self.shard_dim + 1 :]
        self.numel = math.prod(self.padded_shard_shape)
        hsdp = isinstance(mesh_info, HSDPMeshInfo)
        placements = (Replicate(), Shard(self.shard_dim)) if hsdp else (Shard(self.shard_dim),)
        if self.tp_spec is None:
            self.spec = DTensorSpec(mesh, placements, self.shape, tuple(param.stride()))
        elif self.shard_dim not in tp_dims:  # different dims: the cuts commute, dp dims first
            self.spec = DTensorSpec(
                combined_mesh(mesh, self.tp_spec.mesh), placements + self.tp_spec.placements, self.tp_spec.shape
            )
        else:
            # FSDP cuts the tp piece again on the same dim (a colwise bias): the global dim is split
            # by tp first, then by dp, which is what nested placements say on the mesh (tp..., dp...).
            self.spec = DTensorSpec(
                combined_mesh(self.tp_spec.mesh, mesh), self.tp_spec.placements + placements, self.tp_spec.shape
            )
        self.offset = 0  # set by the group
        self.sharded_param: nn.Parameter | None = None
        self.unsharded_param: nn.Parameter | None = None

    @property
    def requires_grad(self) -> bool:
        """Live: ``p.requires_grad_(False)`` on the sharded parameter after fully_shard freezes it
        (no gradient is reduced or written, as in torch)."""
        sp = self.sharded_param
        return self._requires_grad_at_init if sp is None else sp.requires_grad

    def registered_param(self) -> nn.Parameter | None:
        module, name = self.uses[0]
        return module._parameters.get(name)

    def is_linked(self) -> bool:
        """Whether the registered parameter is still our sharded DTensor over ``flat_shard``
        (``to_empty``, ``load_state_dict(assign=True)``, ``_apply`` and attribute assignment
        replace the parameter or its local tensor; forward would then read a stale buffer)."""
        sp = self.sharded_param
        return self.registered_param() is sp and sp._local_tensor is self._local_view

    def relink(self, flat_shard: torch.Tensor) -> None:
        """Make the registered parameter (whatever replaced ours) our sharded DTensor again: its
        values are copied into this rank's slot of ``flat_shard`` (same dtype and device: the
        group reallocates first if they changed) and its local tensor becomes the view of it."""
        new = self.registered_param()
        if new is None:
            raise RuntimeError(f"fully_shard: parameter {self.uses[0][1]!r} was removed from its module")
        if isinstance(new, DTensor):
            if tuple(new.shape) != self.spec.shape:
                raise RuntimeError(
                    f"fully_shard: parameter {self.uses[0][1]!r} was replaced by a DTensor of shape "
                    f"{tuple(new.shape)}; the sharded parameter has shape {self.spec.shape}"
                )
            if new._spec.mesh != self.spec.mesh or new._spec.placements != self.spec.placements:
                new_local = new.redistribute(self.spec.mesh, self.spec.placements)._wait_local()
            else:
                new_local = new._wait_local()
        elif tuple(new.shape) == self.spec.shape:  # a full plain tensor: keep this rank's piece
            new_local = self.global_to_local(new.detach())
        else:
            raise RuntimeError(
                f"fully_shard: parameter {self.uses[0][1]!r} was replaced by a tensor of shape {tuple(new.shape)}; "
                f"expected a DTensor or a full tensor of shape {self.spec.shape}"
            )
        view = self.shard_view(flat_shard)
        if not new_local.is_meta and new_local is not view:
            with torch.no_grad():
                view.copy_(new_local.detach())
        if isinstance(new, nn.Parameter) and isinstance(new, DTensor):
            # Keep the object (an optimizer or the caller may hold it): only its data moves.
            new._local_tensor = view
            new._spec = self.spec
            self.sharded_param = new
        else:
            requires_grad = new.requires_grad
            self.sharded_param = nn.Parameter(DTensor(view, self.spec), requires_grad=requires_grad)
        self._local_view = view
        self.swap_to(self.sharded_param)

    # ---- sharded form ---------------------------------------------------------------------
    def shard_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded piece inside a flat shard buffer (params, grads)."""
        padded = flat[self.offset : self.offset + self.numel].view(self.padded_shard_shape)
        return padded.narrow(self.shard_dim, 0, self.local_size)

    def init_sharded(self, full: torch.Tensor, flat_shard: torch.Tensor) -> None:
        """Copy this rank's chunk of ``full`` into the flat shard; register a DTensor view of it.

        A meta ``full`` (a model built on the meta device) copies nothing: the shard stays zero
        until the model's own init (e.g. ``reset_parameters()``) runs on the DTensor parameters,
        whose random ops draw sharding-independent values (hpservice.dtensor.random), so the
        full model never exists on one rank.
        """
        view = self.shard_view(flat_shard)
        if isinstance(full, DTensor):  # tensor parallelism: shard this rank's tp piece
            full = full._local_tensor
        if not full.is_meta:
            start = min(self.rank * self.chunk, self.shape[self.shard_dim])
            with torch.no_grad():
                view.copy_(full.narrow(self.shard_dim, start, self.local_size))
        self.sharded_param = nn.Parameter(DTensor(view, self.spec), requires_grad=self._requires_grad_at_init)
        self._local_view = view

    # ---- unsharded form -------------------------------------------------------------------
    def init_unsharded(self, flat_unsharded: torch.Tensor, offset: int) -> None:
        """The unsharded parameter: the unpadded view of this slot of the unsharded buffer."""
        self.unsharded_offset = offset
        padded_shape = self.shape[: self.shard_dim] + (self.chunk * self.shard_size,) + self.shape[self.shard_dim + 1 :]
        slot = flat_unsharded[offset : offset + self.numel * self.shard_size].view(padded_shape)
        self._unsharded_padded = slot
        unsharded = slot.narrow(self.shard_dim, 0, self.shape[self.shard_dim])
        if self.tp_spec is not None:
            unsharded = DTensor(unsharded, self.tp_spec)
        self.unsharded_param = nn.Parameter(unsharded, requires_grad=self.requires_grad)
        self.grad_hooked = False

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Rank-major all-gather output ``(S, C)`` -> this parameter's padded full slot."""
        d = self.shard_dim
        block = gathered[:, self.offset : self.offset + self.numel].view((self.shard_size,) + self.padded_shard_shape)
        dst = self._unsharded_padded.unflatten(d, (self.shard_size, self.chunk))
        dst.copy_(block.movedim(0, d))

    def copy_in_grad(self, grad: torch.Tensor, flat_in: torch.Tensor) -> None:
        """Full gradient -> its rank-major slots of the reduce-scatter input ``(S, C)`` (cast there).

        Padding positions get zeros; they reduce into padding, which is never read. A tensor-parallel
        gradient is first given the parameter's placements (e.g. the Partial gradient of a replicated
        norm weight under sequence parallelism is all-reduced over tp), then its local tensor is used.
        """
        if isinstance(grad, DTensor):
            if grad._spec.placements != self.tp_spec.placements:
                grad = grad.redistribute(self.tp_spec.mesh, self.tp_spec.placements)
            grad = grad._wait_local()
        d = self.shard_dim
        dst = flat_in[:, self.offset : self.offset + self.numel]
        n = self.shape[d]
        if self.numel == 0:  # a 0-size parameter: nothing to reduce
            return
        if d == 0:
            # Row-major, the padded full gradient is the gradient followed by zero rows, and rank r's
            # slot holds rows [r*c, (r+1)*c): copy whole chunks, then the last partial one, no pad copy.
            full_chunks, rem = divmod(n, self.chunk)
            grad = grad.reshape(n, -1)
            row = grad.shape[1]
            if full_chunks:
                dst[:full_chunks].copy_(grad[: full_chunks * self.chunk].reshape(full_chunks, self.numel))
            if full_chunks < self.shard_size:
                tail = dst[full_chunks]
                if rem:
                    tail[: rem * row].copy_(grad[full_chunks * self.chunk :].reshape(-1))
                tail[rem * row :].zero_()
                dst[full_chunks + 1 :].zero_()
            return
        dst = dst.view((self.shard_size,) + self.padded_shard_shape)
        pad = self.chunk * self.shard_size - n
        if pad:
            grad = torch.nn.functional.pad(grad, [0, 0] * (grad.ndim - d - 1) + [0, pad])
        dst.copy_(grad.unflatten(d, (self.shard_size, self.chunk)).movedim(d, 0))

    def global_to_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full (global-shape) tensor for the sharded parameter."""
        for d, (size, start) in enumerate(zip(self.spec.local_shape, self.spec.local_offset, strict=True)):
            full = full.narrow(d, start, size)
        return full

    def zero_grad_slot(self, flat_in: torch.Tensor) -> None:
        flat_in[:, self.offset : self.offset + self.numel].zero_()

    def swap_to(self, param: nn.Parameter) -> None:
        """Register ``param`` (sharded or unsharded form) wherever this parameter is used."""
        for module, name in self.uses:
            module._parameters[name] = param
