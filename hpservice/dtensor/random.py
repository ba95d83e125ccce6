"""Random numbers for DTensors that do not depend on how the tensor is sharded.

The value of global element ``i`` (row-major flat index) of the ``n``-th random op is a function
of ``(seed, offset, i)`` only: elements are grouped in blocks of ``BLOCK`` indices, each block is
drawn from its own generator seeded by mixing ``(seed, offset, block)``. A rank draws only the
blocks its local piece touches and keeps the elements it owns, so

- a sharded random init reassembles to the tensor a single device (or fully replicated
  placements) gets from the same seed, whatever the mesh;
- ranks that replicate a piece draw identical values;
- after each op the offset advances by the tensor's *global* numel (AUDIT 6), so consecutive
  ops never reuse a stream, on any rank.

Per-parameter streams (``parameter_streams``): inside it, a draw into a named parameter uses a
stream keyed by the parameter's name instead of the running offset, so a model's initial values
do not depend on which other parameters were drawn before: a pipeline stage that holds blocks 2
and 3 initialises them as the whole model does. The running offset does not move for those draws.

The same code runs on CPU and CUDA generators (values differ between device types, as torch's
own generators do).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

__all__ = [
    "BLOCK",
    "OffsetBasedRNGTracker",
    "get_rng_state",
    "manual_seed",
    "parameter_streams",
    "set_rng_state",
]

BLOCK = 1 << 16
_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 over the values: decorrelated 63-bit seeds for neighbouring blocks."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h & ((1 << 63) - 1)


class OffsetBasedRNGTracker:
    """Seed + running offset (in elements) shared by all ranks that run the same program."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self.offset = 0
        self.streams: dict[int, int] = {}  # id(local piece) -> its own stream (parameter_streams)

    def ensure_seed(self, mesh) -> None:
        if self.seed is not None:
            return
        if mesh.size() != dist.get_world_size():
            raise RuntimeError(
                "hpservice.dtensor.random: no seed set and the mesh does not span the world; "
                "call hpservice.dtensor.random.manual_seed(seed) with the same seed on every rank first"
            )
        # Every rank must use one seed: take rank 0's.
        seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64)
        if mesh.device_type != "cpu":
            seed = seed.to(mesh.device_type)
        dist.broadcast(seed, src=0)
        self.seed = int(seed.item())

    def fill(self, local: torch.Tensor, spec, draw) -> None:
        """Fill ``local`` (the piece of ``spec`` on this rank) with ``draw(buffer, generator)``."""
        numel = 1
        for s in spec.shape:
            numel *= s
        start_offset = self.streams.get(id(local))
        if start_offset is None:
            start_offset = self.offset
            self.offset += numel
        if local.numel() == 0:
            return
        index = _global_flat_index(spec.local_shape, spec.local_offset, spec.shape, local.device)
        blocks = torch.arange(int(index[0]) // BLOCK, int(index[-1]) // BLOCK + 1, device=local.device)
        bounds = torch.searchsorted(index, blocks * BLOCK).tolist() + [index.numel()]
        flat = (
            local.view(-1)
            if local.is_contiguous()
            else torch.empty(local.numel(), dtype=local.dtype, device=local.device)
        )
        gen = torch.Generator(device=local.device)
        for b, lo, hi in zip(blocks.tolist(), bounds[:-1], bounds[1:], strict=True):
            if lo == hi:
                continue
            gen.manual_seed(_mix(self.seed, start_offset, b))
            buf = torch.empty(min(BLOCK, numel - b * BLOCK), dtype=local.dtype, device=local.device)
            draw(buf, gen)
            flat[lo:hi] = buf[index[lo:hi] - b * BLOCK]
        if flat.data_ptr() != local.data_ptr() or not local.is_contiguous():
            local.copy_(flat.view(local.shape))


def _global_flat_index(local_shape, local_offset, global_shape, device) -> torch.Tensor:
    """Row-major global flat indices of the local piece, in local row-major order (increasing)."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    strides = []
    for s in reversed(global_shape):
        strides.append(stride)
        stride *= s
    strides.reverse()
    for d, (n, off) in enumerate(zip(local_shape, local_offset, strict=True)):
        shape = [1] * len(local_shape)
        shape[d] = n
        index = index + (torch.arange(off, off + n, device=device) * strides[d]).view(shape)
    return index.reshape(-1)


_default_tracker = OffsetBasedRNGTracker()


def manual_seed(seed: int) -> None:
    """Seed DTensor random ops; call with the same seed on every rank (like torch.manual_seed)."""
    _default_tracker.seed = int(seed) & ((1 << 63) - 1)
    _default_tracker.offset = 0


@contextlib.contextmanager
def parameter_streams(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Inside: random draws into each of the ``(name, DTensor)`` pairs come from a stream keyed
    by ``name`` (the same on every rank and in every layout), not from the running offset. For
    initialising a model whose parts live on different ranks (pipeline stages): a parameter's
    values are a function of the seed, its name and its elements' global indices only."""
    streams = {}
    for name, t in named:
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        streams[id(t._wait_local())] = key | (1 << 63)  # above every running offset
    saved, _default_tracker.streams = _default_tracker.streams, streams
    try:
        yield
    finally:
        _default_tracker.streams = saved


def get_rng_state() -> tuple[int | None, int]:
    return _default_tracker.seed, _default_tracker.offset


def set_rng_state(state: tuple[int | None, int]) -> None:
    _default_tracker.seed, _default_tracker.offset = state
