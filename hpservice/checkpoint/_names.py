"""The name of a checkpoint's folder under its root, both ways: ``step-00000100`` for step 100.

One place writes the format and one parses it: the manager, the storage backends, the trainer's
``resume_from`` check and the API's export folder all go through these two functions.
"""

from __future__ import annotations

import re

__all__ = ["step_dir_name", "step_of"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """The folder (or object-store prefix) of the checkpoint of ``step``: zero-padded, so names
    sort as steps do."""
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder name (``step-N``, any padding), or None for any other name
    (``step-N.tmp``, ``latest``, a file)."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None
