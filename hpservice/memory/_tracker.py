"""``TensorMemoryTracker``: the bytes of every tensor storage alive in this process, and their
peak, counted as torch's ops create and free them (on any device, CPU included).

A ``TorchDispatchMode`` sees each op's outputs; each new storage is counted once (a view shares
its base's) until its last reference dies (a weak reference's finalizer). ``resize_`` on a
storage (how fully_shard frees and regrows its unsharded parameters) is patched for the
context's duration, as torch's ``MemTracker`` does. Tensor subclasses (hpservice's DTensor,
torchao's NF4) are counted by the plain tensors they hold: a mode returns ``NotImplemented``
for them so the subclass dispatches first and its local ops pass through here.

This is what ``torch.distributed._tools.mem_tracker.MemTracker`` measures (its total), without
its per-module attribution: that attribution installs backward hooks on every module's outputs
whose closures form reference cycles, which keep a step's activations alive until Python's
garbage collector runs, so its totals between steps (and after backward) are larger than what
training holds. ``tests/memory/test_tracker.py`` checks the two agree where neither is hampered.

Tensors created before the context (or outside the dispatcher: ``torch.from_numpy``,
``torch.tensor`` of a list) are not counted: enter it before the model is built.
"""

from __future__ import annotations

import weakref
from functools import wraps

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["TensorMemoryTracker"]

_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)  # a fake tensor stands for a plain one


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    if t.device.type == "meta":
        return []
    return [t.untyped_storage()]


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker() as mem: ...``; ``mem.current``, ``mem.peak`` (bytes, over
    every device but meta), ``mem.reset_peak()`` to start a new high-water mark from now."""

    def __init__(self, *, track_resize: bool = True):
        super().__init__()
        self.track_resize = track_resize  # patches a torch method process-wide: off where threads share it
        self._sizes: dict[int, int] = {}  # id of the storage's C object -> bytes counted
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self._grow(size)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def _grow(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            size = storage.nbytes()
            self._grow(size - self._sizes[key])
            self._sizes[key] = size

    def __enter__(self):
        if not self.track_resize:
            return super().__enter__()
        original = self._original_resize = torch.UntypedStorage.resize_

        @wraps(original)
        def resize_(storage, size):
            out = original(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        if self.track_resize:
            torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN for t in types):
            return NotImplemented  # a subclass: its own dispatch runs the local ops we count
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in _storages(t):
                    self._count(storage)
        return out
