"""FSDPParamGroup: the parameters of one fully_shard call, communicated as one flat bucket.

Buffers (S = shard group size, C = sum of the parameters' padded per-rank shard sizes):

- ``flat_shard`` (C, original dtype, on the shard device): the sharded parameters; each
  registered DTensor parameter's local tensor is a view into it, so the optimizer updates it
  in place and it is the all-gather input as is (no copy-in) unless mixed precision or offload
  needs a cast/copy into ``ag_in``.
- ``ag_out`` (S*C, param dtype): rank-major all-gather output, copied out into
- ``flat_unsharded`` (S*C, param dtype): one padded full slot per parameter, param-major; the
  unsharded parameters are views of it.
- ``rs_in`` (S*C, reduce dtype) and ``rs_out`` (C): reduce-scatter input and output.
- ``grad_flat`` (C, original dtype, shard device): the sharded gradients are views into it.

Each phase runs under a ``record_function`` label with FSDP2's name (``FSDP::all_gather``,
``FSDP::all_gather_copy_out``, ``FSDP::post_backward_reduce``, ``FSDP::post_backward_rs_wait``,
``FSDP::post_backward_reshard``, ...; with the module's name once the root has named its
groups), so a profiler trace reads like one of torch's FSDP; finer ranges (copy-in, the waits,
the collectives themselves) are nested inside them.

All are allocated once and reused every step (AUDIT 13). The unsharded parameters' storage is
freed on reshard and regrown before the next use (``untyped_storage().resize_``), which keeps
every view, and every tensor autograd saved, valid while the memory is returned in between:
that is what makes the model fit. The collective scratch buffers (``ag_out``, ``rs_in``: the
group's unsharded size in the param and the reduce dtype) are freed the same way after each use
on an accelerator, where the caching allocator hands the blocks back at once: kept, every
group's would hold the whole unsharded model twice (50 GiB per rank for an 8B Llama in bf16,
``bench plan``). On CPU they stay allocated: there memory comes from the OS, and fresh pages
cost a page fault per 4 KiB on every step (measured with ``bench fsdp``), for little saved at
the sizes CPU jobs train.
"""

from __future__ import annotations

import enum
import functools
import weakref

import torch
from torch.profiler import record_function

from hpservice.dtensor import DTensor

from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_collectives import all_gather_flat, all_reduce_flat, reduce_scatter_flat
from ._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from ._fsdp_param import FSDPParam

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ShardState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited
    UNSHARDED = "unsharded"


def _free(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _regrow(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _predivide_factor(world: int) -> int:
    """Split a division by ``world`` into a pre- and post-factor near sqrt(world), so neither the
    values before the sum nor the sum itself leave fp16/bf16 range."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return factor


class FSDPParamGroup:
    def __init__(
        self,
        params: list[FSDPParam],
        mesh_info: FSDPMeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ):
        self.params = params
        self.mesh_info = mesh_info
        self.mesh = mesh_info.mesh
        self.fqn = ""  # the module's name in the root, set at the root's lazy init (profiler labels)
        self.state = ShardState.SHARDED
        self.unshard_count = 0  # all-gathers issued so far
        self.shard_group = mesh_info.shard_process_group
        self.shard_size = mesh_info.shard_mesh_size  # S
        hsdp = isinstance(mesh_info, HSDPMeshInfo)
        self.replicate_group = mesh_info.replicate_process_group if hsdp else None
        self.replicas = mesh_info.replicate_mesh_size if hsdp else 1
        self.mp_policy = mp_policy
        self.device = device
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self._pin = self.offload and offload_policy.pin_memory and device.type == "cuda"
        dtypes = {p.orig_dtype for p in params}
        if len(dtypes) != 1:
            raise TypeError(f"fully_shard: parameters of one group must share a dtype, got {sorted(map(str, dtypes))}")

        offset = 0
        for p in params:
            p.offset = offset
            offset += p.numel
        self.numel = offset  # C
        self._allocate(dtypes.pop())

        self.state = ShardState.SHARDED
        self._ag_work = None
        # Settings (FSDPModule setters).
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.divide_factor: float | None = None
        self.reduce_op = "avg"
        # Per-backward state.
        self._n_grad_params = sum(p.requires_grad for p in params)
        self._grads_seen = 0
        self._inputs_done = False  # the module's inputs got their gradient (groups with frozen params)
        self._post_backward_done = False
        self._rs_work = None
        self._ar_work = None
        self._reduce_pending = False
        self._unreduced: torch.Tensor | None = None  # reduce-scattered grads awaiting the replicate all-reduce
        self._needs_host_sync = False
        self._sync_requires_grad()

    def _allocate(self, orig_dtype: torch.dtype) -> None:
        """(Re)allocate the flat buffers for parameters of ``orig_dtype`` and (re)build the
        unsharded parameters as views of them; the sharded parameters are relinked by the caller."""
        self.orig_dtype = orig_dtype
        self.param_dtype = self.mp_policy.param_dtype or orig_dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.param_dtype
        shard_device = torch.device("cpu") if self.offload else self.device
        S, C, pin = self.shard_size, self.numel, self._pin
        self.flat_shard = torch.zeros(C, dtype=orig_dtype, device=shard_device, pin_memory=pin)
        self.grad_flat = torch.zeros(C, dtype=orig_dtype, device=shard_device, pin_memory=pin)
        same = self.param_dtype == orig_dtype and not self.offload
        self.ag_in = self.flat_shard if same else torch.empty(C, dtype=self.param_dtype, device=self.device)
        self.ag_out = torch.empty(S * C, dtype=self.param_dtype, device=self.device)
        self.flat_unsharded = torch.empty(S * C, dtype=self.param_dtype, device=self.device)
        self.rs_in = torch.empty(S * C, dtype=self.reduce_dtype, device=self.device)
        self.rs_out = torch.empty(C, dtype=self.reduce_dtype, device=self.device)
        for p in self.params:
            p.init_unsharded(self.flat_unsharded, S * p.offset)
        _free(self.flat_unsharded)
        self.keep_scratch = self.device.type == "cpu"  # see the module doc
        if not self.keep_scratch:
            _free(self.ag_out)
            _free(self.rs_in)

    def _sync_requires_grad(self) -> None:
        """Follow the sharded parameters' live ``requires_grad`` (torch does): the unsharded
        parameter of a frozen one gets no gradient, so nothing is reduced or written for it."""
        n = 0
        for p in self.params:
            live = p.requires_grad
            u = p.unsharded_param
            if u.requires_grad != live:
                u.requires_grad_(live)
            if live:
                n += 1
                if not p.grad_hooked:
                    # Through a weak reference: the hook lives in the tensor's C++ autograd
                    # metadata, which the garbage collector cannot see, so a strong one would make
                    # param -> hook -> group -> param a cycle never freed (nor the mesh's groups).
                    u.register_post_accumulate_grad_hook(functools.partial(_grad_accumulated, weakref.ref(self)))
                    p.grad_hooked = True
        self._n_grad_params = n

    @property
    def has_frozen(self) -> bool:
        """Some parameter gets no gradient: the last gradient accumulated does not mean the
        module's backward is over (its frozen weights still carry the input's gradient: LoRA's
        base, a frozen layer inside a trained block), so the group stays unsharded until its
        inputs' gradient is computed (``inputs_grad_ready``), as torch's FSDP2 waits for it."""
        return self._n_grad_params < len(self.params)

    # ---- parameter swaps ------------------------------------------------------------------------
    def params_linked(self) -> bool:
        """Cheap (identity checks): whether every registered parameter is still ours."""
        if self.state is ShardState.UNSHARDED:
            return all(
                p.registered_param() is p.unsharded_param and p.sharded_param._local_tensor is p._local_view
                for p in self.params
            )
        return all(p.is_linked() for p in self.params)

    def relink_params(self) -> None:
        """After something replaced registered parameters or their data (``to_empty``,
        ``load_state_dict(assign=True)``, ``.double()``, ``_apply``), copy their values into
        the flat shard the all-gather reads and register our DTensor views again, reallocating
        the buffers when the dtype changed. As torch's ``reset_sharded_param``."""
        # Whatever is registered now replaces our parameter, unless it is our unsharded form
        # (reshard below re-registers the sharded form, which must not undo an assignment).
        replaced = [p.registered_param() for p in self.params]
        self.reshard()
        for p, r in zip(self.params, replaced, strict=True):
            if r is not None and r is not p.unsharded_param and r is not p.sharded_param:
                p.swap_to(r)
        registered = [p.registered_param() for p in self.params]
        dtypes = {r.dtype for r in registered if r is not None}
        if len(dtypes) > 1:
            raise TypeError(
                f"fully_shard: parameters of one group must share a dtype, got {sorted(map(str, dtypes))}"
            )
        devices = {
            (r._local_tensor if isinstance(r, DTensor) else r).device.type for r in registered if r is not None
        } - {"meta"}
        expected = self.flat_shard.device.type
        if devices and devices != {expected}:
            raise RuntimeError(
                f"fully_shard: parameters moved to {sorted(devices)}; this group keeps its shards on {expected!r} "
                "(the mesh's device, or cpu with CPU offload)"
            )
        if dtypes and dtypes != {self.orig_dtype}:
            self._allocate(dtypes.pop())
        for p in self.params:
            p.relink(self.flat_shard)
        self._sync_requires_grad()

    def _label(self, phase: str) -> record_function:
        return record_function(f"FSDP::{phase} ({self.fqn})" if self.fqn else f"FSDP::{phase}")

    # ---- unshard / reshard ------------------------------------------------------------------
    def unshard(self) -> None:
        """Issue the all-gather (asynchronous); ``wait_for_unshard`` finishes it."""
        if self.state is not ShardState.SHARDED:
            return
        with self._label("all_gather"):
            with self._label("all_gather_copy_in"):
                _regrow(self.flat_unsharded)
                _regrow(self.ag_out)
                if self.ag_in is not self.flat_shard:
                    self.ag_in.copy_(self.flat_shard, non_blocking=True)
            self._ag_work = all_gather_flat(self.ag_in, self.ag_out, self.shard_group)
        self.state = ShardState.UNSHARDING
        self.unshard_count += 1  # names this all-gather, for an UnshardHandle that waits for it later

    def wait_for_unshard(self) -> None:
        if self.state is ShardState.SHARDED:
            self.unshard()
        if self.state is ShardState.UNSHARDING:
            with self._label("all_gather_copy_out"):
                if self._ag_work is not None:
                    with self._label("all_gather_wait"):
                        self._ag_work.wait()
                    self._ag_work = None
                gathered = self.ag_out.view(self.shard_size, self.numel)
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat_unsharded):
                    for p in self.params:
                        p.copy_out(gathered)
                if not self.keep_scratch:
                    _free(self.ag_out)
            self.state = ShardState.UNSHARDED

    def use_unsharded(self) -> None:
        self._sync_requires_grad()
        for p in self.params:
            p.swap_to(p.unsharded_param)

    def reshard(self) -> None:
        if self.state is ShardState.UNSHARDING:
            self.wait_for_unshard()
        if self.state is ShardState.UNSHARDED:
            with self._label("reshard"):
                for p in self.params:
                    p.swap_to(p.sharded_param)
                _free(self.flat_unsharded)
            self.state = ShardState.SHARDED

    # ---- backward ---------------------------------------------------------------------------
    def _on_grad_accumulated(self, _param) -> None:
        self._grads_seen += 1
        if self._grads_seen == self._n_grad_params and (self._inputs_done or not self.has_frozen):
            self.post_backward()

    def inputs_grad_ready(self) -> None:
        """The module's inputs have their gradient: its whole backward is done."""
        self._inputs_done = True
        if self._grads_seen == self._n_grad_params:
            self.post_backward()

    def has_unsharded_grads(self) -> bool:
        return any(p.requires_grad and p.unsharded_param.grad is not None for p in self.params)

    def post_backward(self) -> None:
        """All of this group's gradients are ready: issue the reduce-scatter, free the params."""
        if self._post_backward_done:
            return
        self._post_backward_done = True
        if self.requires_gradient_sync and self.has_unsharded_grads():
            with self._label("post_backward_reduce"):
                self._issue_reduce_scatter()
        if self.reshard_after_backward:
            with self._label("post_backward_reshard"):
                self.reshard()

    def _divide_factors(self) -> tuple[float, float]:
        if self.reduce_op == "sum":
            return 1.0, 1.0
        factor = self.divide_factor if self.divide_factor is not None else float(self.shard_size * self.replicas)
        if self.reduce_dtype in _LOW_PRECISION and self.divide_factor is None:
            pre = float(_predivide_factor(self.shard_size * self.replicas))
            return pre, factor / pre
        # fp32/fp64 cannot overflow here: divide only the reduced shard (S times less work).
        return 1.0, factor

    def _issue_reduce_scatter(self) -> None:
        _regrow(self.rs_in)
        flat_in = self.rs_in.view(self.shard_size, self.numel)
        with self._label("reduce_scatter_copy_in"), torch.no_grad():
            for p in self.params:
                grad = p.unsharded_param.grad if p.requires_grad else None
                if grad is None:
                    p.zero_grad_slot(flat_in)
                else:
                    p.copy_in_grad(grad, flat_in)
                    p.unsharded_param.grad = None
            pre, _ = self._divide_factors()
            if pre != 1.0:
                self.rs_in.div_(pre)
        with self._label("reduce_scatter"):
            self._rs_work = reduce_scatter_flat(self.rs_in, self.rs_out, self.shard_group)
        self._reduce_pending = True

    def wait_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter; on HSDP issue the replicate all-reduce (asynchronous)."""
        if not self._reduce_pending:
            return
        if self._rs_work is not None:
            with self._label("post_backward_rs_wait"):
                self._rs_work.wait()
            self._rs_work = None
        if not self.keep_scratch:
            _free(self.rs_in)
        if self.replicas > 1:
            if self._unreduced is not None:
                self.rs_out.add_(self._unreduced)
            if not self.requires_all_reduce:
                # Accumulate locally; the next step that all-reduces reduces the sum once.
                if self._unreduced is None:
                    self._unreduced = self.rs_out.clone()
                else:
                    self._unreduced.copy_(self.rs_out)
                self._reduce_pending = False
                return
            self._unreduced = None
            with self._label("all_reduce"):
                self._ar_work = all_reduce_flat(self.rs_out, self.replicate_group)

    def finish_reduction(self) -> None:
        """Wait for the all-reduce, post-divide, and accumulate into the sharded DTensor grads."""
        if not self._reduce_pending:
            return
        self._reduce_pending = False
        if self._ar_work is not None:
            with self._label("all_reduce_wait"):
                self._ar_work.wait()
            self._ar_work = None
        _, post = self._divide_factors()
        with self._label("post_backward_accumulate"), torch.no_grad():
            if post != 1.0:
                self.rs_out.div_(post)
            for p in self.params:
                if not p.requires_grad:
                    continue
                reduced = p.shard_view(self.rs_out)
                sp = p.sharded_param
                if sp.grad is None:
                    view = p.shard_view(self.grad_flat)
                    view.copy_(reduced, non_blocking=self.offload)
                    sp.grad = DTensor(view, p.spec)
                else:
                    sp.grad._local_tensor.add_(reduced.to(sp.grad.device, non_blocking=False))
                self._needs_host_sync |= self.offload and self.device.type != "cpu"

    def reset_backward(self) -> bool:
        """Clear per-backward state; True if a host sync is needed for offloaded grads (AUDIT 7)."""
        needs_sync = self._needs_host_sync
        self._needs_host_sync = False
        self._grads_seen = 0
        self._inputs_done = False
        self._post_backward_done = False
        return needs_sync


def _grad_accumulated(group_ref: weakref.ref, param: torch.Tensor) -> None:
    group = group_ref()
    if group is not None:
        group._on_grad_accumulated(param)
