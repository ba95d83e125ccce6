"""The trainer's error (its own module: the trainer and its metric sinks raise it, and neither
imports the other for it)."""

from __future__ import annotations

__all__ = ["TrainingError"]


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss)."""
