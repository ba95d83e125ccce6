"""torch.compile of a model's transformer blocks and of the loss (``training.compile``)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn

from ._activation_checkpointing import transformer_blocks


def check_compile_available(device_type: str) -> str | None:
    """Why torch.compile cannot run on this machine (None if it can). Inductor compiles CPU
    kernels with a C++ compiler and Python's headers; on CUDA it generates Triton kernels."""
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "training.compile on CUDA needs Triton (pip install triton), which is not installed"
        return None
    from torch._inductor import cpp_builder

    try:
        compiler = cpp_builder.get_cpp_compiler()
    except Exception as e:  # inductor's own error names what it searched for
        return f"training.compile on CPU needs a C++ compiler (g++ or $CXX): {e}"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return f"training.compile on CPU needs Python's C headers (Python.h) beside the compiler {compiler}"
    return None


def isolate_compile_cache(run_dir: str) -> None:
    """Inductor's caches (compiled kernels, and Triton's under them) in the run's own directory:
    by default they go to one folder per user in the machine's temp directory, which the jobs of
    every tenant on a node would share. The service's workers call this for each job."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(run_dir) / "compile-cache")


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """``torch.compile`` each transformer block's forward, as torchtitan does: the blocks share
    one code object, so they share one compiled graph. Only ``forward`` is replaced, after
    activation checkpointing wrapped it, so the checkpoint is traced into the graph (op-level
    selective checkpointing included) while fully_shard's module hooks, applied next, stay
    outside the compiled region and keep gathering and freeing the parameters. ``fullgraph``
    off for context parallelism: ring attention runs eagerly between a block's compiled parts."""
    for block in transformer_blocks(model, "training.compile"):
        block.forward = torch.compile(block.forward, fullgraph=fullgraph)
