"""The TokenSource interface, shared argument checks and the seeding scheme.

A source is an endless, seekable stream of training samples. The trainer asks for the batch of
one step on one data-parallel rank::

    batch = source.batch(step, dp_rank, dp_size, global_batch, seq_len)  # a Batch

Each sample is a window of ``seq_len + 1`` tokens; ``batch.inputs`` is its first ``seq_len``
tokens and ``batch.labels`` its last ``seq_len`` (the same window shifted by one token): every
label of these sources counts in the loss (``every_label_valid``).

Why determinism matters: the *global* batch of a step (``global_batch`` samples) is a function
of the source's seed, the step and the sample shapes only -- never of ``dp_size`` or
``dp_rank``. Rank ``r`` gets rows ``[r * local_b, (r + 1) * local_b)`` of it, where
``local_b = global_batch // dp_size``. Hence

* changing the world size (same ``global_batch``) changes who computes which sample, not the
  samples the model is trained on, so runs on 1, 2 or 8 ranks see identical data; and
* a run resumed from a checkpoint at step ``k`` draws exactly the batches it would have drawn
  had it never stopped: there is no iterator state to save, the step number is the position.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod

import numpy as np
import torch

from ._batch import Batch

__all__ = ["TokenSource", "local_batch_size", "seeded_rng"]

# Domain tags keep the random streams of different purposes (synthetic transition table,
# synthetic samples, file window offsets) apart even when they share a seed and step.
TAG_TABLE = 1
TAG_SAMPLE = 2
TAG_WINDOWS = 3

_U32 = 0xFFFF_FFFF


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int (numpy ints allowed, bools and floats not), at least ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seed(seed) -> int:
    seed = check_int("seed", seed, 0)
    if seed >= 1 << 64:
        raise ValueError(f"seed must be < 2**64, got {seed}")
    return seed


def seeded_rng(tag: int, *values: int) -> np.random.Generator:
    """A numpy Generator that depends on ``tag`` and ``values`` (non-negative ints < 2**64) only.

    Every value is encoded as two 32-bit words so that the entropy has a fixed length per tag:
    numpy pads short entropy with zeros, which would otherwise make e.g. ``[s]`` and ``[s, 0]``
    the same stream.
    """
    words = [tag]
    for v in values:
        words += [v & _U32, (v >> 32) & _U32]
    return np.random.default_rng(words)


def local_batch_size(dp_rank, dp_size, global_batch) -> int:
    """``global_batch // dp_size``, after checking the rank and that the division is exact."""
    dp_size = check_int("dp_size", dp_size, 1)
    dp_rank = check_int("dp_rank", dp_rank, 0)
    global_batch = check_int("global_batch", global_batch, 1)
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
    if global_batch % dp_size:
        raise ValueError(f"global_batch={global_batch} is not divisible by dp_size={dp_size}")
    return global_batch // dp_size


class TokenSource(ABC):
    """A deterministic, seekable stream of token windows (see the module docstring).

    Attributes every source has:

    * ``vocab_size``: token ids lie in ``[0, vocab_size)``;
    * ``num_tokens``: tokens in the backing file, or ``None`` for a generated stream;
    * ``seed``: selects the sample order (and, for synthetic data, the data itself).

    Subclasses implement ``_rows``; ``batch`` does the argument checks and the shift.
    """

    vocab_size: int
    num_tokens: int | None
    seed: int
    # No label is IGNORE_INDEX: the step's count of valid labels is its token count, known
    # without asking the other ranks (hpservice.train._loss).
    every_label_valid: bool = True

    def batch(
        self, step: int, dp_rank: int, dp_size: int, global_batch: int, seq_len: int
    ) -> Batch:
        """This rank's batch of step ``step``: ``inputs`` and ``labels``, int64 CPU tensors ``[local_b, seq_len]``.

        ``local_b = global_batch // dp_size``; rank ``dp_rank`` gets rows
        ``[dp_rank * local_b, (dp_rank + 1) * local_b)`` of the step's global batch, which
        depends on ``(seed, step, global_batch, seq_len)`` only. ``labels[:, i]`` is the token
        after ``inputs[:, i]``. Raises ValueError when ``global_batch % dp_size != 0``.
        """
        step = check_int("step", step, 0)
        seq_len = check_int("seq_len", seq_len, 1)
        local_b = local_batch_size(dp_rank, dp_size, global_batch)
        rows = self._rows(step, global_batch, dp_rank * local_b, local_b, seq_len)
        windows = torch.from_numpy(rows)
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    @abstractmethod
    def _rows(self, step: int, global_batch: int, first: int, count: int, seq_len: int) -> np.ndarray:
        """Rows ``[first, first + count)`` of the global batch of ``step``: int64 ``[count, seq_len + 1]``."""
