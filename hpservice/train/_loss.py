"""The training loss: cross entropy over the valid labels of a step, divided by their global count.

A step's loss is ``sum of -log p(label) over every valid label of the global batch / N``, where
``N`` counts the valid labels (not ``IGNORE_INDEX``) of the whole step: every data-parallel rank,
micro-batch (gradient accumulation, pipeline micro-batches) and context-parallel part. The mean of
per-micro-batch means is a different number as soon as micro-batches hold different numbers of
valid labels (a chat's prompt tokens are masked), and it changes with the layout; the global count
does not (torchtitan's rule).

Each rank computes its micro-batch's share so that the sums fully_shard and the pipeline already
make give the step's loss and its gradient:

- fully_shard averages gradients over the ``ranks`` it reduces over (data parallel and context
  parallel): a share is multiplied by ``ranks``;
- the pipeline divides its gradients by its micro-batch count ``k`` (torch's ``scale_grads``):
  a share is multiplied by ``k``.

So a micro-batch's loss is ``sum / (N / (ranks * k))``. Where every label counts
(``every_label_valid``), it is taken as torch's mean of the micro-batch divided by
``N / (n * ranks * k)`` instead, ``n`` its token count: the same value, and for the sources of
today bitwise the loss of before (``N / (n * ranks)`` is exactly the accumulation count, and
``N / (n * ranks * k)`` exactly 1.0 in a pipeline), with no count to gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.data import IGNORE_INDEX, Batch
from hpservice.dtensor import DeviceMesh, DTensor
from hpservice.parallel import vocab_parallel_cross_entropy

__all__ = ["TokenLoss", "cross_entropy_loss"]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy in float32 over the labels that are not ``IGNORE_INDEX``; with
    tensor parallelism the logits are sharded on the vocabulary and the loss never gathers them."""
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
        )
    return nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


class TokenLoss:
    """The loss function of the trainer and of the pipeline schedule: ``loss(logits, labels)``
    is the micro-batch's share of the step's loss (module docstring). ``begin`` sets the step's
    global count before the step's first micro-batch.

    ``ranks``: the ranks gradients are averaged over (data parallel x context parallel);
    ``batch_mesh()``: the ranks whose batches differ (data parallel; None for one), over which
    ``N`` is summed when labels can be masked (asked for then only: it may make a group)."""

    def __init__(self, *, ranks: int, batch_mesh: Callable[[], DeviceMesh | None], compile: bool):
        self.ranks, self._batch_mesh = ranks, batch_mesh
        self._ce = torch.compile(cross_entropy_loss) if compile else cross_entropy_loss
        self.global_valid: int | None = None
        self.every_label_valid = True
        self.microbatches = 1

    def begin(self, batch: Batch, *, global_tokens: int, every_label_valid: bool, microbatches: int = 1) -> int:
        """Before a step (or an evaluation batch) of which ``batch`` is this rank's part:
        ``global_tokens`` is the global batch's token count, ``every_label_valid`` whether its
        source masks none, ``microbatches`` the pipeline's ``k``. Returns ``N``, the step's valid
        labels."""
        self.microbatches, self.every_label_valid = microbatches, every_label_valid
        if every_label_valid:
            self.global_valid = global_tokens
        else:
            count = (batch.labels != IGNORE_INDEX).sum()  # on the batch's device, as nccl needs
            mesh = self._batch_mesh()
            if mesh is not None:
                dist.all_reduce(count, group=mesh.get_group())
            self.global_valid = int(count)
        return self.global_valid

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.global_valid is None:
            raise RuntimeError("TokenLoss: begin() was not called for this step")
        if self.every_label_valid:
            return self._ce(logits, labels) / (self.global_valid / (labels.numel() * self.ranks * self.microbatches))
        # no valid label in the whole step: every sum is 0, and so is the loss (not 0 / 0)
        return self._ce(logits, labels, "sum") / (max(self.global_valid, 1) / (self.ranks * self.microbatches))
