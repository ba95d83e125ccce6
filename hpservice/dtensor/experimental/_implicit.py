"""``implicit_replication``: plain tensors among a DTensor op's operands taken as replicated."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .. import _dispatch

__all__ = ["implicit_replication"]


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Within this context, a plain ``torch.Tensor`` operand of an op whose other operands are
    DTensors is treated as a Replicate DTensor on their mesh, as torch's does, instead of being
    refused (outside it, only 0-d and one-element 1-d tensors are). The caller promises the plain
    tensor holds the same values on every rank; nothing checks it."""
    previous = _dispatch.IMPLICIT_REPLICATION.enabled
    _dispatch.IMPLICIT_REPLICATION.enabled = True
    try:
        yield
    finally:
        _dispatch.IMPLICIT_REPLICATION.enabled = previous
