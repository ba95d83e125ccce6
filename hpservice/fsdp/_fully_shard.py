"""fully_shard: shard a module's parameters over a mesh (FSDP on 1-D, HSDP on 2-D).

Apply it bottom-up (each block, then the root); every call makes one parameter group (one
all-gather and one reduce-scatter per step) out of the parameters of the module(s) that no
inner fully_shard already took. The module's class becomes ``FSDP<Class>``, a subclass of
both ``FSDPModule`` and the original class, so ``isinstance`` and methods keep working.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.dtensor import DeviceMesh, DTensor, Shard, init_device_mesh
from hpservice.dtensor.device_mesh import mesh_device

from ._fsdp_api import MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_common import mesh_info
from ._fsdp_param import FSDPParam
from ._fsdp_param_group import FSDPParamGroup, ShardState
from ._fsdp_state import FSDPState

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes that all-gather.

    As torch's: a wait after something else finished it (the forward that followed, which may
    also have resharded and, after an optimizer step, left it stale) does nothing; it never
    gathers again."""

    def __init__(self, group: FSDPParamGroup | None):
        self._group = group
        self._all_gather = group.unshard_count if group is not None else None

    def wait(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        if group.state is ShardState.UNSHARDING and group.unshard_count == self._all_gather:
            group.wait_for_unshard()
            group.use_unsharded()


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")


class FSDPModule:
    """Methods every fully_shard-ed module gains (same names as torch's FSDPModule)."""

    _fsdp_state: FSDPState

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        states = []
        for m in self.modules():
            s = getattr(m, "_fsdp_state", None)
            if s is not None and s not in states:
                states.append(s)
        return states

    def _fsdp_groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [s.group for s in self._fsdp_states(recurse) if s.group is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (ahead of forward)."""
        _check_bool("unshard(async_op)", async_op)
        group = self._fsdp_state.group
        if group is not None:
            group.unshard()
        if async_op:
            return UnshardHandle(group)
        if group is not None:  # now: gathered, and the module on its unsharded parameters, whatever came before
            group.wait_for_unshard()
            group.use_unsharded()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its sharded DTensor parameters again."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def __deepcopy__(self, memo):
        raise AssertionError(
            "fully_shard modules do not support deepcopy (as torch's FSDP); copy the model before fully_shard, "
            "or build a new one and load model.state_dict() into it"
        )

    def __reduce_ex__(self, protocol):
        import pickle

        raise pickle.PicklingError(
            "fully_shard modules cannot be pickled (as torch's FSDP); save model.state_dict() "
            "(torch.save or torch.distributed.checkpoint) instead"
        )

    def _apply(self, *args, **kwargs):
        """``to_empty``, ``.double()``, ``.to(dtype)``, ``.cpu()``...: convert the sharded
        parameters, then copy the results into the flat shard the all-gather reads (as torch's
        FSDPModule._apply resets its sharded parameters)."""
        group = self._fsdp_state.group
        if group is not None:
            group.reshard()
        out = super()._apply(*args, **kwargs)
        if group is not None:
            group.relink_params()
        return out

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally (no communication) until a
        backward with True reduces the sum once (gradient accumulation)."""
        _check_bool("set_requires_gradient_sync", requires_gradient_sync)
        for g in self._fsdp_groups(recurse):
            g.requires_gradient_sync = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of a step (micro-batching). torch's FSDP may leave
        the last reductions of a non-last backward in flight, to overlap them with the next
        micro-batch; ours completes them at the end of every backward, so the gradients after the
        last backward are the same either way, and correct between micro-batches too. The setting
        is kept (``is_last_backward``), as torch keeps it, until set again."""
        _check_bool("set_is_last_backward", is_last_backward)
        self._fsdp_state.is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the all-reduce over the replicate dim (reduce-scattered gradients
        accumulate locally and the next all-reduce reduces their sum)."""
        _check_bool("set_requires_all_reduce", requires_all_reduce)
        for g in self._fsdp_groups(recurse):
            g.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        _check_bool("set_reshard_after_forward", reshard_after_forward)
        for s in self._fsdp_states(recurse):
            s._reshard_after_forward = reshard_after_forward
            if s.group is not None:
                s.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        _check_bool("set_reshard_after_backward", reshard_after_backward)
        for g in self._fsdp_groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """After this module's all-gather in forward, issue these modules' (overrides the recorded order)."""
        self._fsdp_state.forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """At this module's backward, issue these modules' all-gathers (overrides the recorded order)."""
        self._fsdp_state.backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise TypeError(f"set_gradient_divide_factor: expected a positive number, got {factor!r}")
        for g in self._fsdp_groups(True):
            g.divide_factor = float(factor)

    def set_reduce_op(self, reduce_op: str) -> None:
        """ "avg" (default: divide by the divide factor) or "sum"; reaches every nested module."""
        if reduce_op not in ("avg", "sum"):
            raise ValueError(f"set_reduce_op: expected 'avg' or 'sum', got {reduce_op!r}")
        for g in self._fsdp_groups(True):
            g.reduce_op = reduce_op


def _states_of(modules, setter: str) -> list[FSDPState]:
    if not isinstance(modules, list | tuple) or not all(isinstance(m, FSDPModule) for m in modules):
        raise TypeError(f"{setter}: expected a list of fully_shard-ed modules, got {modules!r}")
    return [m._fsdp_state for m in modules]


@functools.lru_cache(maxsize=256)
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def _default_mesh() -> DeviceMesh:
    device_type = "cpu"
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        device_type = accelerator.current_accelerator().type
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return init_device_mesh(device_type, (world,))


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
):
    """Shard ``module``'s parameters (not already taken by an inner fully_shard) over ``mesh``.

    A 1-D mesh is FSDP (``Shard(0)`` parameters); a 2-D mesh ``(replicate, shard)`` is HSDP
    (``(Replicate(), Shard(0))``). Parameters that are already DTensors (tensor parallelism on
    another dim of the same root mesh) are sharded on a dim their placements leave whole; their
    sharded form lives on the combined ``(dp..., tp...)`` mesh. A list of modules forms one group (tied weights).
    ``reshard_after_forward=None`` reshards every module but the root after forward.
    ``ignored_params`` are left alone: not sharded, no communication.
    """
    modules = [module] if isinstance(module, nn.Module) else list(module)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard: expected an nn.Module or a list of them, got {module!r}")
    if any(isinstance(m, FSDPModule) for m in modules):
        raise ValueError("fully_shard: module is already fully_shard-ed")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard(mp_policy): expected a MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard(offload_policy): expected an OffloadPolicy, got {offload_policy!r}")
    mesh = mesh if mesh is not None else _default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard(mesh): expected a 1-D (FSDP) or 2-D (replicate, shard) DeviceMesh, got {mesh!r}")
    info = mesh_info(mesh)
    reshard_after_forward = _resolve_reshard_after_forward(reshard_after_forward, info.shard_mesh_size)
    ignored = {id(p) for p in ignored_params or ()}
    device = mesh_device(mesh)

    # Parameters of these modules not owned by an inner fully_shard, with every place they are used.
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]] = {}

    def walk(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            entry = found.setdefault(id(p), (p, [], []))
            entry[1].append((m, name))
            entry[2].append(prefix + name)
        for child_name, child in m._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                walk(child, f"{prefix}{child_name}.")

    for i, m in enumerate(modules):
        walk(m, "" if len(modules) == 1 else f"{i}.")
    params: list[FSDPParam] = []
    for p, uses, fqns in found.values():
        owner = getattr(p, _OWNER_ATTR, None)
        if owner is not None:  # torch's check (at lazy init there; here at once)
            raise ValueError(
                f"Parameter '{fqns[0]}' is shared with a parameter already managed by another FSDP group "
                f"('{owner}'). For shared/tied parameters, use fully_shard([module_a, module_b]) to place "
                "them in the same FSDP group."
            )
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None
        if placement is not None and not isinstance(placement, Shard):
            raise TypeError(f"shard_placement_fn must return Shard(dim) or None, got {placement!r}")
        shard_dim = placement.dim if placement is not None else None
        if shard_dim is not None and not -p.ndim <= shard_dim < max(p.ndim, 1):
            raise ValueError(f"shard_placement_fn returned {placement!r} for a parameter of shape {tuple(p.shape)}")
        params.append(FSDPParam(p, uses, shard_dim, info))

    group = None
    if params:
        group = FSDPParamGroup(params, info, device, mp_policy, offload_policy)
        for fp, (p, _, fqns) in zip(params, found.values(), strict=True):
            local = p._local_tensor if isinstance(p, DTensor) else p
            fp.init_sharded(local.detach() if local.is_meta else local.detach().to(device), group.flat_shard)
            fp.swap_to(fp.sharded_param)
            # The original stays reachable wherever a module outside this group still holds it.
            setattr(p, _OWNER_ATTR, f"{type(modules[0]).__name__}: {fqns[0]}")
    state = FSDPState(modules, group, mp_policy, reshard_after_forward)
    keys = {fqn: fp for fp, (_, _, fqns) in zip(params, found.values(), strict=True) for fqn in fqns}
    for i, m in enumerate(modules):
        m._fsdp_state = state
        m.__class__ = _fsdp_class(type(m))
        local = {k[len(f"{i}.") :]: v for k, v in keys.items() if k.startswith(f"{i}.")} if len(modules) > 1 else keys
        m.register_load_state_dict_pre_hook(functools.partial(_load_full_or_sharded, local, group))
        if group is not None:
            m.register_state_dict_pre_hook(lambda *_, g=group: g.reshard())
            m.register_load_state_dict_post_hook(lambda *_, g=group: g.relink_params())
    return module


# Marks a parameter object fully_shard has taken (its FQN there), to refuse it in another group.
_OWNER_ATTR = "_hpservice_fsdp_owner"


def _resolve_reshard_after_forward(value, shard_size: int) -> bool | None:
    """torch's rules: None, a bool, or an int that divides the shard group size; 1 means False
    (with torch's warning) and the shard size means True. Other ints (reshard to a smaller group
    after forward, e.g. within a node) are not built yet: a clear error, never a silent True."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size to reshard to, "
            f"not {value!r}"
        )
    if value < 1 or value > shard_size or shard_size % value != 0:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {shard_size}, not {value}")
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)",
            stacklevel=3,
        )
        return False
    if value == shard_size:
        return True
    raise NotImplementedError(
        f"fully_shard(reshard_after_forward={value}): resharding to a group of {value} of the {shard_size} "
        "shard ranks after forward is not built yet; use True (reshard fully) or False"
    )


def _load_full_or_sharded(params: dict[str, FSDPParam], group, module, state_dict, prefix, *args) -> None:
    """load_state_dict accepts sharded DTensors (any placements) or full tensors: each rank keeps its shard."""
    if group is not None:
        group.reshard()  # load into the sharded parameters (torch's pre-load hook does the same)
    for name, fp in params.items():
        key = prefix + name
        value = state_dict.get(key)
        if value is None:
            continue
        if isinstance(value, DTensor):
            if value.placements != fp.spec.placements:
                state_dict[key] = value.redistribute(fp.spec.mesh, fp.spec.placements)
        elif tuple(value.shape) == fp.spec.shape:  # otherwise the module's own shape check reports it
            local = fp.global_to_local(value.detach()).to(fp.sharded_param.device)
            state_dict[key] = DTensor(local, fp.spec)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run fully_shard's pre- and post-forward around it, as
    ``forward`` does (gather the parameters, then reshard by ``reshard_after_forward``): for a
    method such as ``generate`` called instead of ``forward``. torch's semantics: a module that is
    not fully_shard-ed is left alone; a missing method is a ``ValueError``."""
    if not isinstance(module, FSDPModule):
        return  # no-op, so one code path serves with and without fully_shard
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        state = self._fsdp_state
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
