"""The bytes a run may write: ``JobSpec.storage_limit_bytes``, enforced while it writes.

The service gives each job a budget when it admits it (``--max-job-bytes``, or what is left of
the owner's ``--max-owner-bytes``, whichever is less). Rank 0 measures the run's directories (its
run directory: metrics, traces, tokenized data; and its checkpoint directory when that lies
elsewhere) after each checkpoint and every ``EVERY_STEPS`` steps, and stops the run with
``StorageLimitError`` past the budget: a clear failure, not a full disk. Unset (``hpservice run``):
nothing is measured.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._errors import TrainingError

__all__ = ["EVERY_STEPS", "StorageBudget", "StorageLimitError", "directory_bytes"]

EVERY_STEPS = 50  # besides after each checkpoint: metrics and traces grow between checkpoints


class StorageLimitError(TrainingError):
    """The run's directories hold more than its storage budget."""


def directory_bytes(path: str | os.PathLike) -> int:
    """Bytes the regular files under ``path`` take on disk (links not followed; 0 if absent)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # removed while we looked (a pruned checkpoint)
                continue
            if not os.path.islink(os.path.join(root, name)):
                total += max(st.st_size, st.st_blocks * 512 if hasattr(st, "st_blocks") else 0)
    return total


def _outermost(paths: list[str]) -> list[Path]:
    """Local directories of ``paths`` (URLs left out), each once: one inside another counts with it."""
    local = sorted({Path(os.path.abspath(p)) for p in paths if p and "://" not in p}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in local:
        if not any(p == k or k in p.parents for k in kept):
            kept.append(p)
    return kept


class StorageBudget:
    def __init__(self, limit: int | None, directories: list[str]):
        self.limit = limit
        self.directories = _outermost(directories)

    def used(self) -> int:
        return sum(directory_bytes(d) for d in self.directories)

    def check(self) -> None:
        """``StorageLimitError`` when the directories hold more than the budget."""
        if self.limit is None:
            return
        used = self.used()
        if used > self.limit:
            where = ", ".join(map(str, self.directories))
            raise StorageLimitError(
                f"the job's directories ({where}) hold {used} bytes, more than the {self.limit} bytes this server "
                "allows it (the operator's --max-job-bytes, or what is left of the owner's --max-owner-bytes): keep "
                "fewer checkpoints (checkpoint.keep), save less often (checkpoint.interval), or ask the operator"
            )
