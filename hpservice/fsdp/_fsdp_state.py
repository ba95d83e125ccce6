"""FSDPState: the hooks of one fully_shard call, and the root's per-step bookkeeping.

Per step, for each state (module group) in forward order:

  pre-forward   unshard: issue the all-gather if no prefetch did, wait, copy out, register
                the unsharded params; then prefetch the next group's all-gather
  post-forward  reshard (unless reshard_after_forward is off; the root keeps its params);
                hook the outputs so backward starts by unsharding this group again
  pre-backward  (first output grad of this group) unshard, prefetch the group that runs
                next in backward
  post-backward (the group's last gradient was accumulated: post-accumulate-grad hooks)
                copy the grads into the reduce-scatter bucket, issue it, reshard
  end of backward (a callback queued on the autograd engine by the root) reduce groups whose
                hooks did not all fire (unused params), wait for every reduce-scatter, issue
                the HSDP all-reduces, wait, write the sharded DTensor grads, reshard everything

The pre-forward order (forward prefetch) and the post-forward order (reversed: backward
prefetch) are recorded during the first step and drive prefetch from then on (AUDIT 18); ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch`` override it. All state
lives on the states of one model: two models in one process share nothing.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._fsdp_api import MixedPrecisionPolicy
from ._fsdp_common import TrainingState
from ._fsdp_param_group import FSDPParamGroup


def _phase(name: str):
    """Run a hook under the profiler label FSDP2 gives it (``FSDP::pre_forward``, ...)."""

    def decorate(hook):
        @functools.wraps(hook)
        def labelled(self, *args, **kwargs):
            with record_function(f"FSDP::{name}"):
                return hook(self, *args, **kwargs)

        return labelled

    return decorate


class FSDPState:
    def __init__(
        self,
        modules: list[torch.nn.Module],
        group: FSDPParamGroup | None,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | None,
    ):
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self._reshard_after_forward = reshard_after_forward
        self.root: FSDPState | None = None
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.training_state = TrainingState.IDLE
        # Root only.
        self._states: list[FSDPState] = []
        self._order: list[FSDPState] = []  # pre-forward order: forward prefetch
        self._post_order: list[FSDPState] = []  # post-forward order, reversed: backward prefetch
        self._order_recorded = False
        self._callback_queued = False
        # set_is_last_backward: kept as torch keeps it; every backward completes its reductions
        self.is_last_backward = True
        for m in modules:
            m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            m.register_forward_hook(self._post_forward)

    @property
    def is_root(self) -> bool:
        return self.root is self

    # ---- lazy init ------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        """The first state whose forward runs becomes the root of every state below it."""
        seen: list[FSDPState] = []
        for m in self.modules:
            for sub in m.modules():
                s = getattr(sub, "_fsdp_state", None)
                if s is not None and s not in seen:
                    seen.append(s)
        names = {sub: name for m in self.modules for name, sub in m.named_modules()}
        for s in seen:
            if s.group is not None:
                s.group.fqn = names.get(s.modules[0], "")
            if s.root is not None and s.root is not self:
                raise RuntimeError("fully_shard: a module is part of two FSDP roots")
            s.root = self
            if s.group is not None:
                default = s is not self  # the root keeps its params for the backward that follows
                s.group.reshard_after_forward = (
                    default if s._reshard_after_forward is None else s._reshard_after_forward
                )
        self._states = seen

    # ---- forward --------------------------------------------------------------------------
    @_phase("pre_forward")
    def _pre_forward(self, module, args, kwargs):
        if self.root is None:
            self._lazy_init()
        if self.is_root:
            with record_function("FSDP::root_pre_forward"):  # FSDP2's range around the root's own work
                return self._pre_forward_group(args, kwargs)
        return self._pre_forward_group(args, kwargs)

    def _pre_forward_group(self, args, kwargs):
        root = self.root
        if torch._C._current_graph_task_id() == -1:  # not activation checkpointing's recompute
            self.training_state = TrainingState.FORWARD
        mp = self.mp_policy
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        if self.group is not None:
            if not self.group.params_linked():  # a parameter or its data was replaced since the last step
                self.group.relink_params()
            if not root._order_recorded and self not in root._order:
                root._order.append(self)
            self.group.unshard()
            self.group.wait_for_unshard()
            self.group.use_unsharded()
            for target in self._forward_targets():
                with record_function(f"FSDP::forward_prefetch for {target.group.fqn}"):
                    target.group.unshard()
            if self.group.has_frozen and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                args, kwargs = _mark_inputs((args, kwargs), self.group)
        return args, kwargs

    @_phase("post_forward")
    def _post_forward(self, module, args, output):
        if torch._C._current_graph_task_id() != -1:
            # A forward run inside backward is activation checkpointing's recomputation: the
            # parameters must stay unsharded for the backward that follows (post-backward
            # reshards them), as in torch's FSDP.
            return output
        grad = torch.is_grad_enabled()
        root = self.root
        if not root._order_recorded and self.group is not None and self not in root._post_order:
            root._post_order.append(self)
        if self.group is not None and (not grad or self.group.reshard_after_forward):
            self.group.reshard()
        self.training_state = TrainingState.IDLE
        if grad:
            tree_map(self._register_pre_backward, output)
        if self.is_root:
            self._order_recorded = True
        if self.mp_policy.output_dtype is not None:  # every fully_shard module's outputs, as torch's FSDP
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return [s for s in self.forward_prefetch if s.group is not None]
        order = self.root._order
        if not self.root._order_recorded or self not in order:
            return []
        i = order.index(self)
        return [order[i + 1]] if i + 1 < len(order) else []

    # ---- backward -------------------------------------------------------------------------
    def _register_pre_backward(self, x):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(self._pre_backward)
        return x

    @_phase("pre_backward")
    def _pre_backward(self, grad):
        root = self.root
        if not root._callback_queued:
            root._callback_queued = True
            Variable._execution_engine.queue_callback(root._finalize_backward)
        if self.training_state is not TrainingState.PRE_BACKWARD:  # the first output gradient of this backward
            self.training_state = TrainingState.PRE_BACKWARD
            if self.group is not None:
                self.group.wait_for_unshard()
                # registered as in forward (torch's pre-backward does the same): a group left
                # unsharded after backward (set_reshard_after_backward(False)) then needs no
                # all-gather, nor a relink, in the next forward
                self.group.use_unsharded()
                for target in self._backward_targets():
                    with record_function(f"FSDP::backward_prefetch for {target.group.fqn}"):
                        target.group.unshard()
        return grad

    def _backward_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return [s for s in self.backward_prefetch if s.group is not None]
        # Backward runs modules in reverse post-forward order (a parent's own params, used after
        # its children's forward, come first in backward).
        order = self.root._post_order
        if not self.root._order_recorded or self not in order:
            return []
        i = order.index(self)
        return [order[i - 1]] if i > 0 else []

    @_phase("root_post_backward_callback")
    def _finalize_backward(self) -> None:
        """End of backward (root): reduce what is left, wait for all reductions, reshard."""
        groups = [s.group for s in self._states if s.group is not None]
        for g in groups:
            g.post_backward()
        for g in groups:
            g.wait_reduce_scatter()
        for g in groups:
            g.finish_reduction()
        needs_sync = False
        for g in groups:
            if g.reshard_after_backward:
                g.reshard()
            needs_sync |= g.reset_backward()
        if needs_sync:  # any offloaded gradient copy was asynchronous (AUDIT 7: any, not the last)
            torch.get_device_module(groups[0].device.type).current_stream().synchronize()
        for s in self._states:
            s.training_state = TrainingState.IDLE
        self._callback_queued = False


def _cast_floats(tree, dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


class _InputsGradReady(torch.autograd.Function):
    """Identity on a module's inputs, all in one node: its backward runs once every input's
    gradient is computed, i.e. when the module's backward is done, and tells the module's group
    (torch FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, group_ref, *xs):
        ctx.group_ref = group_ref
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group_ref()
        if group is not None:
            group.inputs_grad_ready()
        return (None, *grads)


def _mark_inputs(tree, group):
    """The forward arguments with the floating tensors that require grad passed through one
    ``_InputsGradReady`` (a module whose inputs need no gradient leaves it to the root's final
    callback)."""
    leaves, spec = tree_flatten(tree)
    marked = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()]
    if not marked:
        return tree
    outs = _InputsGradReady.apply(weakref.ref(group), *(leaves[i] for i in marked))
    for i, y in zip(marked, outs, strict=True):
        leaves[i] = y
    return tree_unflatten(leaves, spec)
