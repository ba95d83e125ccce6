"""Validation: the loss (and perplexity) on ``eval.steps`` fixed held-out batches.

Each data-parallel rank takes its part of each batch, the same batches every time. A batch's
loss is over its valid labels (``TokenLoss``: the same rule as training, one micro-batch, or the
pipeline's forwards alone); ``val_loss`` is the mean over the batches.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.parallel import ParallelDims

from ._dataset import RankBatches
from ._forward import attention, micro_batch_loss
from ._loss import TokenLoss

__all__ = ["Evaluator"]


class Evaluator:
    def __init__(
        self,
        data: RankBatches,
        steps: int,
        model_parts: list[nn.Module],
        dims: ParallelDims,
        loss: TokenLoss,
        pipeline=None,
    ):
        self.data, self.steps, self.model_parts, self.dims = data, steps, model_parts, dims
        self.loss, self.pipeline = loss, pipeline

    @torch.no_grad()
    def __call__(self) -> dict:
        device = self.data.device
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), device=device)
        try:
            for k in range(self.steps):
                batch = self.data(k)
                self.loss.begin(
                    batch, global_tokens=self.data.global_tokens, every_label_valid=self.data.every_label_valid
                )
                if self.pipeline is not None:  # the loss on the last stage; zero on the others
                    losses: list[torch.Tensor] = []
                    self.pipeline.eval(batch.inputs, target=batch.labels, losses=losses)
                    total += sum(losses) if losses else 0.0
                    continue
                with attention(batch, self.dims):
                    total += micro_batch_loss(self.model_parts[0], batch, self.dims, self.loss)
        finally:
            for part in self.model_parts:
                part.train()
        if dist.get_world_size() > 1:  # each loss holder's share (tp ranks the same value): the mean
            dist.all_reduce(total)
            total /= dist.get_world_size() // self.dims.pp
        val_loss = float(total) / self.steps
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
