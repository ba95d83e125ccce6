"""``eager_under_compile``: torch.compiler.disable without importing torch.compile at import time."""

from __future__ import annotations

import functools
import sys

import torch


def eager_under_compile(fn):
    """``torch.compiler.disable(fn)``: under torch.compile, ``fn`` runs eagerly (a graph break).
    Made at the first call once torch.compile is loaded: importing it here (dynamo) would cost
    every process that imports hpservice a second of CPU or more; before it is loaded nothing
    compiles, and ``fn`` is called as it is."""
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal disabled
        # is_compiling() first: dynamo folds it to True while it traces a caller, so it never
        # reads sys.modules here (it used to wrap all ~3000 entries of it, on every compiled
        # frame that calls one of these: a sixth of the CPU of compiling a tensor-parallel block).
        if not torch.compiler.is_compiling() and "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return wrapper
