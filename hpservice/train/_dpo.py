"""Direct Preference Optimization: the loss over preference pairs, its reference model, and the
metrics TRL's ``DPOTrainer`` reports under the same names.

A micro-batch holds pairs as rows ``[c0, r0, c1, r1, ...]`` (``hpservice.data.preference``), one
forward for both sides as TRL's concatenated forward. Each row's log-probability is the sum over
its completion tokens (its valid labels) of ``log p(token)``; with the reference's, per pair::

    delta = (logp_c - ref_c) - (logp_r - ref_r)
    sigmoid: -log sigmoid(beta * delta)                     (DPO)
    hinge:   relu(1 - beta * delta)                         (SLiC)
    ipo:     ((logp_c - ref_c) / n_c - (logp_r - ref_r) / n_r - 1 / (2 beta))^2    (n: completion tokens, as TRL)
    robust:  (-(1 - e) log sigmoid(beta delta) + e log sigmoid(-beta delta)) / (1 - 2e)   (e: label_smoothing)

and the step's loss is the mean over its global batch of pairs. Each rank computes its micro-batch's
share of it as ``TokenLoss`` does (``sum / P * ranks``: fully_shard averages the gradients of the
``ranks`` it reduces over), so gradient accumulation and any data-parallel size give the
one-process gradient.

The reference is the model as DPO starts, computed without gradients:

- ``adapters_off`` (LoRA on a fresh adapter): the same model with its adapters switched off;
- ``initial_adapter`` (LoRA from ``model.init_adapter``): the same model with a frozen copy of the
  starting adapter swapped in (adapter-sized; TRL's "ref" adapter);
- ``copy`` (full fine-tuning): a second model built like the policy, every parameter frozen and
  sharded the same way (no gradients, no optimizer state);
- ``precomputed``: the policy's own log-probabilities as it starts, for every micro-batch of every
  step, in one pass before training (TRL's ``precompute_ref_log_probs``): no reference model during
  training. They are computed again from the job's inputs when a run resumes (before the
  checkpoint is loaded), so a resume sees the same values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hpservice.data import IGNORE_INDEX, Batch
from hpservice.dtensor import DeviceMesh, DTensor
from hpservice.fsdp import FSDPModule
from hpservice.models.lora import LoRALinear

from ._loss import cross_entropy_loss
from ._memory import local_bytes

__all__ = ["DPOLoss", "PipelineDPOLoss", "build_reference", "pack_target", "pipelined_logps", "sequence_logps"]

# the step's sums behind the metrics, in this order (one all-reduce)
_SUMS = ("pairs", "loss", "chosen_rewards", "rejected_rewards", "accuracies", "chosen_logps", "rejected_logps")


class _SumOverSequenceParts(torch.autograd.Function):
    """Per-row sums of a sequence split over the context-parallel ranks: the forward all-reduces
    them; the backward passes each rank's gradient through as it is (every rank computes the same
    loss from the same sums, and fully_shard's average over the cp ranks makes it one)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of ``log p(label)`` over its valid labels (float32), and their count. With
    tensor parallelism the logits stay sharded on the vocabulary; with context parallelism (this
    rank's positions of each row) the sums are completed over ``cp_group``."""
    nll = cross_entropy_loss(logits, labels, reduction="none").view(labels.shape)
    valid = labels != IGNORE_INDEX
    logps, counts = -(nll * valid).sum(dim=1), valid.sum(dim=1)
    if cp_group is not None:
        logps = _SumOverSequenceParts.apply(logps, cp_group)
        counts = counts.clone()
        dist.all_reduce(counts, group=cp_group)
    return logps, counts


class DPOLoss:
    """``loss(logits, labels, reference_logps)``: the micro-batch's share of the step's DPO loss;
    ``begin`` before a step's first micro-batch, ``metrics`` after its last."""

    def __init__(self, objective, *, ranks: int, batch_mesh: Callable[[], DeviceMesh | None], microbatches: int = 1):
        self.beta, self.loss_type, self.smoothing = objective.beta, objective.loss_type, objective.label_smoothing
        # the pipeline divides its gradients by its micro-batch count (torch's scale_grads): a share is
        # multiplied by it, as TokenLoss's
        self.ranks, self._batch_mesh, self.microbatches = ranks, batch_mesh, microbatches
        self.global_pairs = None
        self._sums = None

    def begin(self, batch: Batch) -> int:
        pairs = torch.tensor(batch.shape[0] // 2, device=batch.inputs.device)
        mesh = self._batch_mesh()
        if mesh is not None:
            dist.all_reduce(pairs, group=mesh.get_group())
        self.global_pairs = int(pairs)
        self._sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=batch.inputs.device)
        return self.global_pairs

    def per_pair(self, logps, counts, ref_logps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each pair's loss, its chosen reward, its rejected reward)."""
        chosen, rejected = logps[0::2] - ref_logps[0::2], logps[1::2] - ref_logps[1::2]
        b = self.beta
        if self.loss_type == "sigmoid":
            losses = -F.logsigmoid(b * (chosen - rejected))
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - b * (chosen - rejected))
        elif self.loss_type == "ipo":
            n = counts.clamp(min=1).to(logps.dtype)
            losses = (chosen / n[0::2] - rejected / n[1::2] - 1 / (2 * b)) ** 2
        elif self.loss_type == "robust":
            e = self.smoothing
            delta = b * (chosen - rejected)
            losses = (-(1 - e) * F.logsigmoid(delta) + e * F.logsigmoid(-delta)) / (1 - 2 * e)
        else:
            raise ValueError(f"objective.loss_type: {self.loss_type!r} is not one of sigmoid, hinge, ipo, robust")
        return losses, b * chosen.detach(), b * rejected.detach()

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor, cp_group=None) -> torch.Tensor:
        if self.global_pairs is None:
            raise RuntimeError("DPOLoss: begin() was not called for this step")
        logps, counts = sequence_logps(logits, labels, cp_group)
        losses, chosen_rewards, rejected_rewards = self.per_pair(logps, counts, ref_logps)
        with torch.no_grad():
            self._sums += torch.stack([
                torch.tensor(float(losses.numel()), device=losses.device), losses.detach().sum(),
                chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).float().sum(),
                logps[0::2].detach().sum(), logps[1::2].detach().sum(),
            ]).to(self._sums)  # fmt: skip
        return losses.sum() / (max(self.global_pairs, 1) / (self.ranks * self.microbatches))

    def metrics(self, pp_group=None) -> dict:
        """The step's means over its global batch of pairs, under TRL's names (with a pipeline, the
        last stage's sums, given to every stage over ``pp_group``)."""
        sums = self._sums
        if pp_group is not None:
            dist.all_reduce(sums, group=pp_group)  # the other stages hold zeros
        mesh = self._batch_mesh()
        if mesh is not None:
            dist.all_reduce(sums, group=mesh.get_group())
        s = dict(zip(_SUMS, sums.tolist(), strict=True))
        n = max(s["pairs"], 1.0)
        chosen, rejected = s["chosen_rewards"] / n, s["rejected_rewards"] / n
        return {
            "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/accuracies": s["accuracies"] / n,
            "rewards/margins": chosen - rejected, "logps/chosen": s["chosen_logps"] / n,
            "logps/rejected": s["rejected_logps"] / n,
        }  # fmt: skip


# ---- the reference ---------------------------------------------------------------------------------


class _Live:
    """A reference computed by a forward: ``logps(forward, ...)`` of a micro-batch, ``forward(model)``
    giving the micro-batch's (logits, labels, cp group) through ``model()``'s model."""

    @torch.no_grad()
    def logps(self, forward, step: int, micro: int) -> torch.Tensor:
        with self.model() as model:
            return sequence_logps(*forward(model))[0]


def _reshard(parts: list[nn.Module]) -> None:
    """Every fully_shard module back on its sharded parameters (none left gathered from a forward)."""
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


class _AdaptersOff(_Live):
    """The policy with its LoRA adapters switched off: the base model."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts
        self.layers = [m for part in parts for m in part.modules() if isinstance(m, LoRALinear)]

    def held_bytes(self) -> int:
        return 0  # the policy's own weights

    @contextlib.contextmanager
    def model(self):
        for m in self.layers:
            m.adapters_enabled = False
        try:
            yield self.parts[0]
        finally:
            for m in self.layers:
                m.adapters_enabled = True


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _InitialAdapter(_Live):
    """The policy with a frozen copy of its starting adapter swapped in for the forward."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts
        _reshard(parts)
        self.params = [p for part in parts for n, p in part.named_parameters() if n.endswith((".lora_A", ".lora_B"))]
        self.initial = [_local(p).detach().clone() for p in self.params]

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.initial)

    @contextlib.contextmanager
    def model(self):
        _reshard(self.parts)  # the values live in the sharded parameters now
        trained = [_local(p).detach().clone() for p in self.params]
        with torch.no_grad():
            for p, v in zip(self.params, self.initial, strict=True):
                _local(p).copy_(v)
        try:
            yield self.parts[0]
        finally:
            _reshard(self.parts)  # nothing gathered from the initial adapter stays for the training forward
            with torch.no_grad():
                for p, v in zip(self.params, trained, strict=True):
                    _local(p).copy_(v)


class _Precomputed:
    """The policy's log-probabilities as it starts, per (step, micro-batch), computed by ``fill``."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts
        self.values: dict[tuple[int, int], torch.Tensor] = {}

    @torch.no_grad()
    def fill(self, data, steps: int, accum: int, forward, pipelined=None) -> None:
        """Before training (and before a resume loads the policy): every step's micro-batches,
        ``forward(model, micro_batch)`` giving (logits, labels, cp group); with a pipeline,
        ``pipelined(batch)`` each step's rows (its micro-batches are the schedule's)."""
        for step in range(steps):
            if pipelined is not None:
                self.values[(step, 0)] = pipelined(data(step))
                continue
            for micro, part in enumerate(data(step).chunk(accum)):
                self.values[(step, micro)] = sequence_logps(*forward(self.parts[0], part))[0]
        _reshard(self.parts)

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values.values())

    def logps(self, forward, step: int, micro: int) -> torch.Tensor:
        return self.values[(step, micro)]


class _FrozenCopy(_Live):
    """A second model built and laid out like the policy, every parameter frozen."""

    def __init__(self, parts: list[nn.Module], pipeline=None):
        self.parts, self.pipeline = parts, pipeline  # the copy's own schedule under pipeline parallelism
        for part in parts:
            part.requires_grad_(False)
            part.eval()
        self._bytes = sum(local_bytes(p) for part in parts for p in part.parameters())

    def held_bytes(self) -> int:
        return self._bytes

    @contextlib.contextmanager
    def model(self):
        yield self.parts[0]


def build_reference(objective, spec, parts: list[nn.Module], build_copy: Callable[[], tuple[list[nn.Module], object]]):
    """The reference of ``objective.reference`` (``auto`` resolved by the model, module docstring)."""
    kind = objective.reference
    if kind == "auto":
        if spec.model.lora is None:
            kind = "copy"
        else:
            kind = "initial_adapter" if spec.model.init_adapter is not None else "adapters_off"
    if kind == "adapters_off":
        return _AdaptersOff(parts)
    if kind == "initial_adapter":
        return _InitialAdapter(parts)
    if kind == "precomputed":
        return _Precomputed(parts)
    return _FrozenCopy(*build_copy())


# ---- under pipeline parallelism ---------------------------------------------------------------------


def pack_target(labels: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The pipeline's target of a step: each row's labels and, last, its reference log-probability
    (float64 holds the label ids exactly), split into micro-batches with the rows."""
    return torch.cat([labels.to(torch.float64), ref_logps.to(torch.float64)[:, None]], dim=1)


class PipelineDPOLoss:
    """The last stage's ``loss_fn(logits, target)``: ``DPOLoss`` on a packed target; while
    ``recording`` (a list), it appends each micro-batch's log-probabilities instead (the reference's
    pass, run by the schedule's ``eval``) and returns zero."""

    def __init__(self, dpo: DPOLoss):
        self.dpo, self.recording = dpo, None

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels = target[:, :-1].long() if target.dtype == torch.float64 else target
        if self.recording is not None:
            self.recording.append(sequence_logps(logits, labels)[0].detach())
            return torch.zeros((), device=logits.device)
        return self.dpo(logits, labels, target[:, -1].to(torch.float32))


@torch.no_grad()
def pipelined_logps(pipeline, loss: PipelineDPOLoss, batch: Batch) -> torch.Tensor:
    """Each row's log-probability through ``pipeline``'s forwards (no gradients): on the last stage
    the values, on the others zeros of the same shape (only the last stage's loss reads them)."""
    loss.recording = []
    try:
        pipeline.eval(batch.inputs, target=batch.labels, losses=[])
        got = loss.recording
    finally:
        loss.recording = None
    if got:
        return torch.cat(got)
    return torch.zeros(batch.shape[0], device=batch.inputs.device)
