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
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from hpservice.dtensor import DTensor, Replicate, Shard
from hpservice.dtensor._layout import DTensorSpec, local_shard_size_and_offset


class FSDPParam:
    """Metadata and views for one parameter managed by an FSDPParamGroup."""

    def __init__(self, param: nn.Parameter, uses: list[tuple[nn.Module, str]], shard_dim: int, mesh, hsdp: bool):
        self.uses = uses  # every (module, attribute name) that holds this parameter (tied weights)
        self.requires_grad = param.requires_grad
        self.orig_dtype = param.dtype
        self.shape = tuple(param.shape)
        if param.ndim == 0:
            raise NotImplementedError(
                f"fully_shard: 0-d parameter {uses[0][1]!r} cannot be sharded; pass it in ignored_params"
            )
        self.shard_dim = shard_dim % param.ndim
        self.mesh = mesh
        shard_mesh_dim = mesh.ndim - 1
        self.world = mesh.size(shard_mesh_dim)
        self.rank = mesh.get_local_rank(shard_mesh_dim)
        n = self.shape[self.shard_dim]
        self.chunk = -(-n // self.world)
        self.local_size, _ = local_shard_size_and_offset(n, self.world, self.rank)
        self.padded_shard_shape = self.shape[: self.shard_dim] + (self.chunk,) + self.shape[self.shard_dim + 1 :]
        self.numel = math.prod(self.padded_shard_shape)
        placements = (Replicate(), Shard(self.shard_dim)) if hsdp else (Shard(self.shard_dim),)
        self.spec = DTensorSpec(mesh, placements, self.shape, tuple(param.stride()))
        self.offset = 0  # set by the group
        self.sharded_param: nn.Parameter | None = None
        self.unsharded_param: nn.Parameter | None = None

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
        if not full.is_meta:
            start = min(self.rank * self.chunk, self.shape[self.shard_dim])
            with torch.no_grad():
                view.copy_(full.narrow(self.shard_dim, start, self.local_size))
        self.sharded_param = nn.Parameter(DTensor(view, self.spec), requires_grad=self.requires_grad)

    # ---- unsharded form -------------------------------------------------------------------
    def init_unsharded(self, flat_unsharded: torch.Tensor, offset: int) -> None:
        """The unsharded parameter: the unpadded view of this slot of the unsharded buffer."""
        self.unsharded_offset = offset
        padded_shape = self.shape[: self.shard_dim] + (self.chunk * self.world,) + self.shape[self.shard_dim + 1 :]
        slot = flat_unsharded[offset : offset + self.numel * self.world].view(padded_shape)
        self._unsharded_padded = slot
        self.unsharded_param = nn.Parameter(
            slot.narrow(self.shard_dim, 0, self.shape[self.shard_dim]), requires_grad=self.requires_grad
        )

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Rank-major all-gather output ``(S, C)`` -> this parameter's padded full slot."""
        d = self.shard_dim
        block = gathered[:, self.offset : self.offset + self.numel].view((self.world,) + self.padded_shard_shape)
        dst = self._unsharded_padded.unflatten(d, (self.world, self.chunk))
        dst.copy_(block.movedim(0, d))

    def copy_in_grad(self, grad: torch.Tensor, flat_in: torch.Tensor) -> None:
        """Full gradient -> its rank-major slots of the reduce-scatter input ``(S, C)`` (cast there).

        Padding positions get zeros; they reduce into padding, which is never read.
        """
        d = self.shard_dim
        dst = flat_in[:, self.offset : self.offset + self.numel]
        n = self.shape[d]
        if d == 0:
            # Row-major, the padded full gradient is the gradient followed by zero rows, and rank r's
            # slot holds rows [r*c, (r+1)*c): copy whole chunks, then the last partial one, no pad copy.
            full_chunks, rem = divmod(n, self.chunk)
            grad = grad.reshape(n, -1)
            row = grad.shape[1]
            if full_chunks:
                dst[:full_chunks].copy_(grad[: full_chunks * self.chunk].reshape(full_chunks, self.numel))
            if full_chunks < self.world:
                tail = dst[full_chunks]
                if rem:
                    tail[: rem * row].copy_(grad[full_chunks * self.chunk :].reshape(-1))
                tail[rem * row :].zero_()
                dst[full_chunks + 1 :].zero_()
            return
        dst = dst.view((self.world,) + self.padded_shard_shape)
        pad = self.chunk * self.world - n
        if pad:
            grad = torch.nn.functional.pad(grad, [0, 0] * (grad.ndim - d - 1) + [0, pad])
        dst.copy_(grad.unflatten(d, (self.world, self.chunk)).movedim(d, 0))

    def zero_grad_slot(self, flat_in: torch.Tensor) -> None:
        flat_in[:, self.offset : self.offset + self.numel].zero_()

    def swap_to(self, param: nn.Parameter) -> None:
        """Register ``param`` (sharded or unsharded form) wherever this parameter is used."""
        for module, name in self.uses:
            module._parameters[name] = param
