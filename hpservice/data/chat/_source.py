"""Batches of an encoded chat corpus: epochs, mixture weights, padding or packing.

An epoch is the corpus's records, each source's repeated by its weight (2.0: every record twice;
0.5: a seeded half), in a seeded order (``seed``, epoch); the stream is epoch after epoch. Its
rows (the samples of a step's global batch) are, by ``packing``:

- ``none``: one record per row, padded;
- ``first_fit`` / ``best_fit``: records in order, each into the first (or the fullest) of the open
  rows it fits in, up to ``PACK_WINDOW`` open rows (the oldest closes when one more is needed).

The global batch of step ``s`` is rows ``[s * global_batch, (s + 1) * global_batch)`` of the
stream, whatever the data-parallel size (``TokenSource``'s rule), so a resumed or resized run
trains on the same rows.

A record of ``n`` tokens fills ``n`` positions of a row: its tokens are the inputs, and the label
at position ``i`` is token ``i + 1`` where that token is trained (``Corpus.mask``), else
``IGNORE_INDEX``; its last position predicts nothing (the next token is another record's). Packed
rows carry ``document_ids`` (attention stays inside each record) and ``positions`` restarting at
0 per record, so a packed batch computes what the records would unpacked.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from .._base import TokenSource, check_int, local_batch_size, seeded_rng
from .._batch import IGNORE_INDEX, Batch
from ._corpus import Corpus

__all__ = ["PACKING", "PACK_WINDOW", "ChatSource"]

PACKING = ("none", "first_fit", "best_fit")
PACK_WINDOW = 64
TAG_CHAT_ORDER = 11
_MAX_EPOCH_CACHE = 4


class ChatSource(TokenSource):
    every_label_valid = False
    num_tokens = None

    def __init__(self, corpus: Corpus, *, seq_len: int, seed: int = 0, packing: str = "none",
                 weights: list[float] | None = None, vocab_size: int | None = None, pad_id: int = 0):  # fmt: skip
        if packing not in PACKING:
            raise ValueError(f"packing must be one of {', '.join(PACKING)}, got {packing!r}")
        self.corpus, self.seq_len, self.seed, self.packing = corpus, seq_len, seed, packing
        n_sources = int(corpus.source.max()) + 1 if corpus.num_records else 0
        self.weights = list(weights) if weights is not None else [1.0] * n_sources
        self.lengths = np.diff(np.asarray(corpus.starts))
        if int(self.lengths.max()) > seq_len:
            raise ValueError(f"the corpus holds a record of {int(self.lengths.max())} tokens, longer than seq_len {seq_len}")
        self.vocab_size = vocab_size if vocab_size is not None else int(np.asarray(corpus.tokens).max()) + 1
        self.pad_id = pad_id
        self._epochs: dict[int, list[np.ndarray]] = {}
        self._ends: list[int] = []  # cumulative rows after each planned epoch

    # ---- the stream -------------------------------------------------------------------------------

    def epoch_records(self, epoch: int) -> np.ndarray:
        """The record indices of ``epoch``, in its order."""
        rng = seeded_rng(TAG_CHAT_ORDER, self.seed, epoch)
        picked = []
        source = np.asarray(self.corpus.source)
        for s, w in enumerate(self.weights):
            idx = np.flatnonzero(source == s)
            whole, frac = int(w), w - int(w)
            picked += [idx] * whole
            if frac > 0:
                picked.append(np.sort(rng.permutation(idx)[: round(frac * len(idx))]))
        records = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
        return records[rng.permutation(len(records))]

    def _rows_of_epoch(self, epoch: int) -> list[np.ndarray]:
        rows = self._epochs.get(epoch)
        if rows is None:
            rows = self._pack(self.epoch_records(epoch))
            if not rows:
                raise ValueError("chat data: an epoch with no records (every source weight 0?)")
            if len(self._epochs) >= _MAX_EPOCH_CACHE:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = rows
        return rows

    def _pack(self, records: np.ndarray) -> list[np.ndarray]:
        if self.packing == "none":
            return [np.asarray([r]) for r in records]
        closed: list[tuple[int, list[int]]] = []  # (opening order, records)
        open_rows: list[tuple[int, list[int], int]] = []  # (opening order, records, room)
        opened = 0
        for r in records:
            n = int(self.lengths[r])
            fits = [i for i, (_, _, room) in enumerate(open_rows) if room >= n]
            if fits:
                i = fits[0] if self.packing == "first_fit" else min(fits, key=lambda i: open_rows[i][2])
                order, members, room = open_rows[i]
                members.append(int(r))
                open_rows[i] = (order, members, room - n)
                continue
            if len(open_rows) == PACK_WINDOW:
                order, members, _ = open_rows.pop(0)
                closed.append((order, members))
            open_rows.append((opened, [int(r)], self.seq_len - n))
            opened += 1
        closed += [(order, members) for order, members, _ in open_rows]
        closed.sort()
        return [np.asarray(members) for _, members in closed]

    def _locate(self, row: int) -> tuple[int, int]:
        """(epoch, row within it) of the stream's row ``row``."""
        while not self._ends or self._ends[-1] <= row:
            epoch = len(self._ends)
            self._ends.append((self._ends[-1] if self._ends else 0) + len(self._rows_of_epoch(epoch)))
        epoch = bisect.bisect_right(self._ends, row)
        return epoch, row - (self._ends[epoch - 1] if epoch else 0)

    def epoch_of_step(self, step: int, global_batch: int) -> float:
        """Epochs completed at the start of ``step`` (fractional)."""
        epoch, within = self._locate(step * global_batch)
        return epoch + within / len(self._rows_of_epoch(epoch))

    def describe(self) -> str:
        """One line: what encoding the corpus kept, dropped, cut and skipped, and how it packs."""
        s = self.corpus.stats
        line = (
            f"{s['encoded']} of {s['records']} conversations ({s['trained_tokens']:,} trained tokens of {s['tokens']:,}); "
            f"{s['dropped_too_long']} dropped and {s['truncated']} truncated (longer than seq_len {self.seq_len}), "
            f"{s['skipped_no_trained_token']} without a trained token, {s['skipped_bad']} malformed skipped; "
            f"packing {self.packing}: {self.packing_efficiency():.0%} of positions hold conversation tokens"
        )
        return line + "".join(f"\n  skipped: {example}" for example in s.get("bad_examples", []))

    def step_records(self, step: int, global_batch: int) -> list[int]:
        """The records of a step's global batch, row after row."""
        out: list[int] = []
        for g in range(step * global_batch, (step + 1) * global_batch):
            epoch, row = self._locate(g)
            out += [int(r) for r in self._rows_of_epoch(epoch)[row]]
        return out

    def step_facts(self, step: int, global_batch: int) -> dict:
        """The metrics of a step's global batch: its epoch and its packing efficiency (record
        tokens over all positions)."""
        first = step * global_batch
        filled = 0
        for g in range(first, first + global_batch):
            epoch, row = self._locate(g)
            filled += int(self.lengths[self._rows_of_epoch(epoch)[row]].sum())
        return {"epoch": self.epoch_of_step(step, global_batch), "packing_efficiency": filled / (global_batch * self.seq_len)}

    def packing_efficiency(self, epoch: int = 0) -> float:
        """Record tokens / row positions in ``epoch``."""
        rows = self._rows_of_epoch(epoch)
        return float(sum(int(self.lengths[r].sum()) for r in rows)) / (len(rows) * self.seq_len)

    # ---- a rank's batch -----------------------------------------------------------------------------

    def batch(self, step: int, dp_rank: int, dp_size: int, global_batch: int, seq_len: int) -> Batch:
        step = check_int("step", step, 0)
        if seq_len != self.seq_len:
            raise ValueError(f"chat data was encoded for seq_len {self.seq_len}, asked for {seq_len}")
        local_b = local_batch_size(dp_rank, dp_size, global_batch)
        first = step * global_batch + dp_rank * local_b
        S = self.seq_len
        inputs = torch.full((local_b, S), self.pad_id, dtype=torch.int64)
        labels = torch.full((local_b, S), IGNORE_INDEX, dtype=torch.int64)
        packed = self.packing != "none"
        docs = torch.zeros((local_b, S), dtype=torch.int64) if packed else None
        positions = torch.zeros((local_b, S), dtype=torch.int64) if packed else None
        tokens, mask, starts = self.corpus.tokens, self.corpus.mask, self.corpus.starts
        for b in range(local_b):
            epoch, row = self._locate(first + b)
            at = 0
            members = self._rows_of_epoch(epoch)[row]
            for k, r in enumerate(members):
                lo, hi = int(starts[r]), int(starts[r + 1])
                n = hi - lo
                t = torch.from_numpy(np.array(tokens[lo:hi], dtype=np.int64))  # a copy: the arrays are read-only maps
                m = torch.from_numpy(np.array(mask[lo + 1 : hi], dtype=bool))
                inputs[b, at : at + n] = t
                labels[b, at : at + n - 1] = torch.where(m, t[1:], IGNORE_INDEX)
                if packed:
                    docs[b, at : at + n] = k
                    positions[b, at : at + n] = torch.arange(n)
                at += n
            if packed and at < S:  # the padding: a document of its own
                docs[b, at:] = len(members)
                positions[b, at:] = torch.arange(S - at)
        return Batch(inputs, labels, docs, positions)

    def _rows(self, step, global_batch, first, count, seq_len):  # batch() is overridden whole
        raise NotImplementedError
