"""SyntheticTokens: a seeded random Markov chain over the vocabulary, learnable by a tiny model."""

from __future__ import annotations

import math

import numpy as np

from ._base import TAG_SAMPLE, TAG_TABLE, TokenSource, check_int, check_seed, seeded_rng

__all__ = ["SyntheticTokens"]


class SyntheticTokens(TokenSource):
    """An endless token stream from a fixed random Markov chain (no files, no downloads).

    What the stream looks like: the seed fixes a transition table ``successors[vocab_size,
    branching]`` (each row drawn uniformly from ``[0, vocab_size)``). A sample starts at a
    uniformly random token; every next token is ``successors[current, j]`` with ``j`` uniform
    in ``[0, branching)``. So every token is followed by one of (at most) ``branching`` tokens.

    Why it is learnable: an untrained model's loss starts near ``ln(vocab_size)``; a model that
    learns the bigram table reaches ``loss_floor = ln(branching)`` (slightly below where a row
    happens to repeat a successor). Even an embedding + linear head gets there in a few hundred
    steps, so "the loss visibly falls" is a cheap end-to-end check of a trainer.

    Sample ``i`` of step ``s`` is generated from its own generator seeded by
    ``(seed, s, i)``: it does not depend on ``global_batch``, ``dp_size`` or ``dp_rank``, and
    each rank generates only its own rows.
    """

    num_tokens = None

    def __init__(self, vocab_size: int, seed: int = 0, branching: int = 4):
        self.vocab_size = check_int("vocab_size", vocab_size, 2)
        self.seed = check_seed(seed)
        self.branching = check_int("branching", branching, 1)
        if self.branching > self.vocab_size:
            raise ValueError(f"branching={self.branching} must be <= vocab_size={self.vocab_size}")
        table_rng = seeded_rng(TAG_TABLE, self.seed, self.vocab_size, self.branching)
        self.successors = table_rng.integers(0, self.vocab_size, size=(self.vocab_size, self.branching))

    @property
    def loss_floor(self) -> float:
        """``ln(branching)``: the cross-entropy (nats) of a model that knows the transition table."""
        return math.log(self.branching)

    def _rows(self, step: int, global_batch: int, first: int, count: int, seq_len: int) -> np.ndarray:
        rows = np.empty((count, seq_len + 1), dtype=np.int64)
        choices = np.empty((count, seq_len), dtype=np.int64)
        for r in range(count):
            rng = seeded_rng(TAG_SAMPLE, self.seed, step, first + r)
            rows[r, 0] = rng.integers(0, self.vocab_size)
            choices[r] = rng.integers(0, self.branching, size=seq_len)
        for i in range(seq_len):  # walk the chain, all rows at once
            rows[:, i + 1] = self.successors[rows[:, i], choices[:, i]]
        return rows

    def __repr__(self) -> str:
        return f"SyntheticTokens(vocab_size={self.vocab_size}, seed={self.seed}, branching={self.branching})"
