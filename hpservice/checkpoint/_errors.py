"""The checkpoint package's errors (their own module: the manager, the reader and the storage
backends all raise them, and none of them imports another for it)."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointStorageError", "UnsafeCheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model."""


class CheckpointStorageError(CheckpointError):
    """The checkpoint directory is not one storage for every rank (node-local disks): no
    checkpoint of this job can be committed there, whatever is retried."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something a safe loader does not build (a pickle that names code)."""
