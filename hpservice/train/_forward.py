"""One micro-batch through a model that is not pipelined: the attention the job asks for, this
context-parallel rank's part of each sequence, and the loss.

``attention`` is the context the forward (and the backward: activation checkpointing recomputes
attention there) runs in: ring attention over the cp ranks, attention only within documents
(``Batch.document_ids``), both, or plain ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from hpservice.data import Batch
from hpservice.parallel import ParallelDims
from hpservice.parallel.context_parallel import context_parallel, document_masking
from hpservice.parallel.context_parallel import positions as cp_positions

from ._errors import TrainingError
from ._loss import TokenLoss

__all__ = ["attention", "micro_batch_loss"]


def _cp_positions(batch: Batch, dims: ParallelDims) -> torch.Tensor:
    """The sequence positions this cp rank holds (a head and a tail chunk: even causal work)."""
    return cp_positions(batch.shape[1], dims.cp, dims.cp_rank, device=batch.inputs.device)


@contextlib.contextmanager
def attention(batch: Batch, dims: ParallelDims):
    """Inside: the model's attention as the job asks for the micro-batch ``batch``."""
    docs = batch.document_ids
    if dims.cp > 1:
        if docs is not None:
            docs = docs.index_select(1, _cp_positions(batch, dims))
        context = context_parallel(dims.cp_mesh, rotate=dims.cp_rotate, document_ids=docs)
    elif docs is not None:
        context = document_masking(docs)
    else:
        yield
        return
    with context as active:
        yield
    if active.calls == 0:  # a model with its own attention would ignore both, without a word
        field = "parallelism.cp" if dims.cp > 1 else "data.document_mask"
        raise TrainingError(
            f"{field}: the model's attention never called scaled_dot_product_attention "
            "(torch.nn.functional's or hpservice.parallel.context_parallel's), so it cannot be split or masked"
        )


def micro_batch_loss(model: nn.Module, batch: Batch, dims: ParallelDims, loss: TokenLoss) -> torch.Tensor:
    """The micro-batch's share of the step's loss (``TokenLoss``). Under context parallelism, of
    this rank's part of each sequence, the model told the tokens' global positions; fully_shard
    averages the cp ranks' gradients as it does the data-parallel ranks'. Packed rows
    (``Batch.positions``) give the model each token's position within its document."""
    if dims.cp == 1:
        if batch.positions is None:
            return loss(model(batch.inputs), batch.labels)
        return loss(model(batch.inputs, positions=batch.positions), batch.labels)
    pos = _cp_positions(batch, dims)
    # rotary positions: each token's own in its document where rows are packed, else its global one
    rope = pos if batch.positions is None else batch.positions.index_select(1, pos)
    return loss(model(batch.inputs.index_select(1, pos), positions=rope), batch.labels.index_select(1, pos))
