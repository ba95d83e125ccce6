"""A rank's batch of one step: inputs, labels and what attention needs to know about them.

Every source returns a ``Batch``; the trainer's loss and mean know nothing else about where the
tokens came from. ``labels[b, i]`` is the token the model should predict after ``inputs[b, i]``,
or ``IGNORE_INDEX`` where the loss must not learn (a prompt, padding, a turn of another role):
``torch.nn.functional.cross_entropy``'s default ``ignore_index``, so the labels go to torch's
loss unchanged. The loss divides by the step's global number of valid labels
(``hpservice.train._loss``), so a masked batch trains the same at every layout.

``document_ids`` (``[B, S]``, where a sequence packs several documents) restricts attention to
each document; ``positions`` (``[B, S]``) are then each token's position inside its document.
Both are ``None`` for one document per sequence, attending causally over all of it.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["IGNORE_INDEX", "Batch"]

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S]; IGNORE_INDEX where no loss is taken
    document_ids: torch.Tensor | None = None  # int [B, S]
    positions: torch.Tensor | None = None  # int64 [B, S]

    def __post_init__(self):
        if self.labels.shape != self.inputs.shape:
            raise ValueError(f"Batch: labels {tuple(self.labels.shape)} != inputs {tuple(self.inputs.shape)}")
        for name in ("document_ids", "positions"):
            t = getattr(self, name)
            if t is not None and t.shape != self.inputs.shape:
                raise ValueError(f"Batch: {name} {tuple(t.shape)} != inputs {tuple(self.inputs.shape)}")

    def _map(self, fn) -> dict:
        return {
            f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
            for f in dataclasses.fields(self)
        }

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**self._map(lambda t: t.to(device)))

    def chunk(self, n: int) -> list[Batch]:
        """``n`` micro-batches of rows (``torch.chunk`` on dim 0)."""
        parts = self._map(lambda t: t.chunk(n))
        return [
            Batch(**{k: None if v is None else v[i] for k, v in parts.items()}) for i in range(len(parts["inputs"]))
        ]

    def num_valid(self) -> int:
        """Labels that count in the loss."""
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def shape(self) -> torch.Size:
        return self.inputs.shape
