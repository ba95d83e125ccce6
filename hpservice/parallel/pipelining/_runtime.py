"""Running a schedule: ``PipelineStage`` and the schedule classes, with torch's names and ``step``.

A rank holds one stage (or ``virtual_stages`` of them, interleaved) and runs its program from
``compute_order`` + ``with_communication`` action by action:

- ``F``: the stage's forward on its micro-batch (stage 0: a slice of ``step``'s inputs; others:
  what ``RECV_F`` brought, or the previous stage's output when that stage is on this rank). The
  last stage applies ``loss_fn`` to its output and the micro-batch's slice of ``target``.
- ``B``: backward from the loss (last stage) or from the gradient ``RECV_B`` brought; ``I`` and
  ``W`` split it (``torch.autograd.grad`` for the input's gradient keeping the graph, then for the
  parameters'), as zero-bubble schedules need.
- ``SEND_*`` / ``RECV_*``: point-to-point over the pp group. Each message has its own tag
  (direction, stage, micro-batch), so a rank's sends and the receiver's receives may come in any
  order; a small header (dims, shape, dtype) goes first, so no shapes are declared up front.

Gradients are those of the mean of the micro-batches' losses (torch's ``scale_grads``): each
stage's parameter gradients are divided by the number of micro-batches after the last backward.
A stage whose module is one of hpservice's fully_shard modules syncs gradients and reshards only in
the last micro-batch's backward (``set_requires_gradient_sync``, ``set_reshard_after_backward``),
as torch's stages do with torch's fully_shard.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ._actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, W
from ._orders import compute_order, stage_rank
from ._simulate import with_communication

__all__ = [
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_HEADER = 8  # dtype code, ndim, up to 6 sizes


class PipelineStage:
    """One stage of a pipeline: ``submodule`` holds stage ``stage_index`` of ``num_stages``; the
    stages are laid out over the ranks of ``group`` (default: the world) in loop order, stage
    ``s`` on the group's rank ``s % size``."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device, group=None):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} outside 0..{num_stages - 1}")
        self.submod, self.stage_index, self.num_stages = submodule, stage_index, num_stages
        self.device, self.group = torch.device(device), group
        self.pp = dist.get_world_size(group)
        if stage_rank(stage_index, self.pp) != dist.get_rank(group):
            raise ValueError(
                f"PipelineStage: stage {stage_index} belongs on pp rank {stage_rank(stage_index, self.pp)} "
                f"(stage s on rank s % {self.pp}), not on rank {dist.get_rank(group)}"
            )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _peer(self, stage: int) -> int:
        """The global rank that holds ``stage``."""
        rank = stage_rank(stage, self.pp)
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


class _Schedule:
    """Runs ``schedule``'s actions for this rank's stages (see the module doc)."""

    _name = ""

    def __init__(self, stages, n_microbatches: int, loss_fn=None, scale_grads: bool = True):
        self.stages = list(stages) if isinstance(stages, list | tuple) else [stages]
        if not self.stages:
            raise ValueError(f"{type(self).__name__}: no stage")
        self.n_microbatches, self.loss_fn, self.scale_grads = n_microbatches, loss_fn, scale_grads
        first = self.stages[0]
        self.pp, self.group, self.num_stages = first.pp, first.group, first.num_stages
        virtual = self.num_stages // self.pp
        if self.num_stages != virtual * self.pp or len(self.stages) != virtual:
            raise ValueError(
                f"{type(self).__name__}: {self.num_stages} stages on {self.pp} ranks: each rank must hold "
                f"{self.num_stages // max(self.pp, 1)} of them, this one holds {len(self.stages)}"
            )
        rank = dist.get_rank(self.group)
        order = compute_order(self._name, self.pp, n_microbatches, virtual)
        self.program = with_communication(order, self.pp)[rank]
        self.by_index = {s.stage_index: s for s in self.stages}
        self._eval_program: list[Action] | None = None
        # per stage, the micro-batch whose backward (or weight gradient) runs last: fully_shard syncs there
        self._last_backward = {a.stage: a.microbatch for a in self.program if a.kind in (B, W)}

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True):
        """One step over ``n_microbatches`` slices (dim 0) of ``args`` (used by stage 0) and
        ``target`` (used by the last stage, with ``loss_fn``); the last stage appends each
        micro-batch's loss to ``losses``. Returns the last stage's outputs, concatenated, or with
        ``return_outputs=False`` (torch's argument) None: every micro-batch's output (a language
        model's logits) is then not kept to the end of the step."""
        split = any(a.kind is W for a in self.program)
        with _gathered([s.submod for s in self.stages]) if split else contextlib.nullcontext():
            out = self._execute(self.program, args, target, losses, return_outputs)
        if self.scale_grads:
            for stage in self.stages:
                for p in stage.submod.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.n_microbatches)
        return out

    @torch.no_grad()
    def eval(self, *args, target=None, losses: list | None = None):
        """Forwards only, without autograd (torch's ``eval``): the same micro-batches, losses and
        outputs as ``step``, no gradients. Each rank runs its stages in order, every micro-batch
        through one before the next (a stage only waits for a lower one: no deadlock)."""
        if self._eval_program is None:
            rank, m = dist.get_rank(self.group), self.n_microbatches
            order = {r: [Action(s, F, i) for s in range(r, self.num_stages, self.pp) for i in range(m)] for r in range(self.pp)}
            self._eval_program = with_communication(order, self.pp)[rank]
        return self._execute(self._eval_program, args, target, losses)

    def _execute(self, program: list[Action], args, target, losses: list | None, return_outputs: bool = True):
        m = self.n_microbatches
        inputs = [torch.tensor_split(a, m) for a in args] if args else None
        targets = torch.tensor_split(target, m) if target is not None else None
        state: dict[tuple, object] = {}  # (kind, stage, micro-batch) -> tensors
        self._losses: dict[int, torch.Tensor] = {}
        pending: list = []  # sends in flight, with their tensors
        outputs: dict[int, torch.Tensor] | None = {} if return_outputs else None
        for action in program:
            self._run(action, state, pending, inputs, targets, outputs)
        for work in pending:
            work.wait()
        if losses is not None and self._losses:
            losses.extend(self._losses[i] for i in range(m))
        return torch.cat([outputs[i] for i in range(m)]) if outputs else None

    # ---- one action ----------------------------------------------------------------------------
    def _run(self, a: Action, state, pending, inputs, targets, outputs) -> None:
        s, i = a.stage, a.microbatch
        if a.kind is F:
            stage = self.by_index[s]
            if stage.is_first:
                x = tuple(part[i] for part in inputs)
            elif ("act", s - 1, i) in state:  # the previous stage is on this rank: hand over
                x = (state.pop(("act", s - 1, i)).detach().requires_grad_(),)
            else:
                x = (state.pop(("recv_f", s, i)).requires_grad_(),)
            out = stage.submod(*x)
            state[("in", s, i)] = x
            if not stage.is_last:  # the last stage's backward starts from the loss: its output is not kept
                state[("out", s, i)] = out
            if stage.is_last:
                if self.loss_fn is not None:
                    loss = self.loss_fn(out, targets[i])
                    state[("loss", s, i)] = loss
                    self._losses[i] = loss.detach()
                if outputs is not None:
                    outputs[i] = out.detach()
            elif s + 1 in self.by_index:
                state[("act", s, i)] = out
            else:
                state[("send_f", s, i)] = out.detach()
        elif a.kind is SEND_F:
            pending[:] = [send for send in pending if not send.done()]  # their tensors go as they are sent
            pending.append(self._send(state.pop(("send_f", s, i)), s + 1, _tag(0, s + 1, i, self.n_microbatches)))
        elif a.kind is RECV_F:
            state[("recv_f", s, i)] = self._recv(s - 1, _tag(0, s, i, self.n_microbatches))
        elif a.kind is RECV_B:
            state[("recv_b", s, i)] = self._recv(s + 1, _tag(1, s, i, self.n_microbatches))
        elif a.kind is SEND_B:
            pending[:] = [send for send in pending if not send.done()]
            pending.append(self._send(state.pop(("send_b", s, i)), s - 1, _tag(1, s - 1, i, self.n_microbatches)))
        elif a.kind in (B, I, W):
            self._backward(a, state)

    def _backward(self, a: Action, state) -> None:
        s, i = a.stage, a.microbatch
        stage = self.by_index[s]
        if a.kind in (B, W):
            self._sync_grads(stage, i == self._last_backward[s])
        if a.kind is W:  # into .grad, as a backward would (fully_shard's hooks reduce from there)
            roots, grads = state.pop(("w", s, i))
            params = [p for p in stage.submod.parameters() if p.requires_grad]  # unsharded: see _gathered
            torch.autograd.backward(roots, grads, inputs=params)
            return
        if stage.is_last:
            roots, grads = [state.pop(("loss", s, i)) if a.kind is B else state[("loss", s, i)]], None
        else:
            grad = state.pop(("recv_b", s, i), None)
            if grad is None:  # the next stage is on this rank: its input's gradient
                grad = state.pop(("grad_in", s + 1, i))
            roots, grads = [state.pop(("out", s, i))], [grad]
        x = state.pop(("in", s, i))
        needs = [t for t in x if isinstance(t, torch.Tensor) and t.requires_grad]
        if a.kind is B:
            # no inputs=: fully_shard's gradients flow through its unsharded parameters (its hooks
            # reduce them into the sharded ones), which a list of the module's parameters would skip
            torch.autograd.backward(roots, grads)
            input_grads = [t.grad for t in needs]
        else:  # I: the input's gradient now, the weights' at W (the graph is kept for it)
            input_grads = list(torch.autograd.grad(roots, needs, grads, retain_graph=True)) if needs else []
            state[("w", s, i)] = (roots, grads)
        if stage.is_first or not input_grads:
            return
        if s - 1 in self.by_index:
            state[("grad_in", s, i)] = input_grads[0]
        else:
            state[("send_b", s, i)] = input_grads[0].detach()

    @staticmethod
    def _sync_grads(stage: PipelineStage, last: bool) -> None:
        """hpservice's fully_shard, as torch's stages drive torch's: reduce-scatter and reshard in
        the stage's last backward only (the parameters stay gathered between micro-batches)."""
        if hasattr(stage.submod, "set_requires_gradient_sync"):
            stage.submod.set_requires_gradient_sync(last)
            stage.submod.set_reshard_after_backward(last)

    # ---- point to point -----------------------------------------------------------------------
    def _send(self, t: torch.Tensor, to_stage: int, tag: int):
        peer = self.stages[0]._peer(to_stage)
        t = t.contiguous()
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(t.dtype), t.ndim
        header[2 : 2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
        return _Sends([dist.isend(header, peer, group=self.group, tag=2 * tag), dist.isend(t, peer, group=self.group, tag=2 * tag + 1)], (header, t))

    def _recv(self, from_stage: int, tag: int) -> torch.Tensor:
        peer = self.stages[0]._peer(from_stage)
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(header, peer, group=self.group, tag=2 * tag)
        ndim = int(header[1])
        out = torch.empty(header[2 : 2 + ndim].tolist(), dtype=_DTYPES[int(header[0])])
        dist.recv(out, peer, group=self.group, tag=2 * tag + 1)
        return out


@contextlib.contextmanager
def _gathered(modules: list[nn.Module]):
    """hpservice's fully_shard modules keep their parameters gathered (no reshard after forward
    or backward) for a step that splits backward into ``I`` and ``W``, then reshard: ``W`` runs
    after other micro-batches' forwards and input gradients, and differentiates with respect to
    the unsharded parameters those used, which must still be the ones registered (and their
    storage alive) by then. The price is the stage's unsharded parameters for the whole step."""
    states = [s for m in modules if hasattr(m, "_fsdp_states") for s in m._fsdp_states(recurse=True)]
    saved = [(s._reshard_after_forward, s.group and s.group.reshard_after_backward) for s in states]
    for m in modules:
        if hasattr(m, "_fsdp_states"):
            m.set_reshard_after_forward(False)
            m.set_reshard_after_backward(False)
    try:
        yield
    finally:
        for s, (after_forward, after_backward) in zip(states, saved, strict=True):
            s._reshard_after_forward = after_forward
            if s.group is not None:
                s.group.reshard_after_forward, s.group.reshard_after_backward = after_forward, after_backward
        for m in modules:  # every fully_shard module inside (FSDPModule.reshard is this module's alone)
            for inner in m.modules():
                if hasattr(inner, "_fsdp_state"):
                    inner.reshard()


class _Sends:
    """Sends in flight and the tensors they read (kept alive until they are done)."""

    def __init__(self, works, tensors):
        self.works, self.tensors = works, tensors

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _tag(direction: int, to_stage: int, microbatch: int, n_microbatches: int) -> int:
    return (to_stage * 2 + direction) * n_microbatches + microbatch


class ScheduleGPipe(_Schedule):
    _name = "gpipe"


class Schedule1F1B(_Schedule):
    _name = "1f1b"


class ScheduleInterleaved1F1B(_Schedule):
    _name = "interleaved_1f1b"


class ScheduleInterleavedZeroBubble(_Schedule):
    """Our zero-bubble schedule (``compute_order("zero_bubble")``, one stage per rank) under the
    name torch gives its own."""

    _name = "zero_bubble"
