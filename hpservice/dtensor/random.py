"""Random numbers for DTensors: seeded by torch's own generators, independent of the sharding.

The state is torch's, not ours (as in torch's DTensor since 2.x, which "no longer maintains a
separate copy of generator state"): every random op on a DTensor takes a 63-bit *key* from the
default generator of the mesh's device type (or from the op's ``generator=``) and advances that
generator, so

- ``torch.manual_seed(s)`` re-seeds DTensor random ops: the same seed, the same program and the
  same layout give the same values, on every device type (torch's DTensor: CUDA only);
- consecutive ops draw different keys, and a DTensor op moves the generator as a plain random op
  does, so later plain draws differ too.

Element ``i`` (row-major global flat index) of an op's result is a function of ``(key, i)`` only:
elements are grouped in blocks of ``BLOCK`` indices, each block drawn from its own generator seeded
by mixing ``(key, block)``. A rank draws only the blocks its local piece touches and keeps the
elements it owns, so a sharded tensor reassembles to the one a fully replicated placement (or one
device) draws from the same generator state, whatever the mesh, and ranks that replicate a piece
hold identical values. (torch's CUDA tracker gives shard ``k`` the Philox offsets
``k * local_numel``: its values change with the layout, except for even shards of a contiguous
dim 0; ours do not. ``docs/compat.md``.)

Ranks agree when their generators agree, which is torch's rule: seed every rank of a mesh with the
same seed. As torch does, the first DTensor random op of a process without a ``manual_seed`` here
copies the state of the mesh's first rank into every rank's generator (``run_state_sync``), so
ranks that seeded differently (``seed + rank`` for data) still start in agreement; after that, a
``torch.manual_seed`` on every rank is followed as it is.

Per-parameter streams (``parameter_streams``): inside it, a draw into a named parameter uses a key
made from one draw at entry and the parameter's name, so a model's initial values do not depend
on which other parameters were drawn before: a pipeline stage that holds blocks 2 and 3
initialises them as the whole model does.

Values differ between device types, as torch's own generators do.
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
    "is_rng_supported_mesh",
    "manual_seed",
    "parameter_streams",
    "set_rng_state",
]

BLOCK = 1 << 16
_MASK64 = (1 << 64) - 1
_KEY_BOUND = (1 << 63) - 1


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
    return h & _KEY_BOUND


def _default_generator(device_type: str) -> torch.Generator:
    if device_type == "cpu":
        return torch.default_generator
    handle = getattr(torch, device_type)
    return handle.default_generators[handle.current_device()]


def _take_key(gen: torch.Generator, numel: int) -> int:
    """A key for one op of ``numel`` global elements, and ``gen`` advanced past it.

    A Philox generator (CUDA and the like: 16 bytes of seed and offset) moves its offset by the
    op's numel rounded up to 4, as torch's DTensor and its plain random ops do; any other (the
    CPU's Mersenne Twister) gives one 63-bit draw."""
    if gen.device.type == "cpu":
        return int(torch.randint(0, _KEY_BOUND, (), generator=gen))
    state = gen.get_state()
    if state.numel() != 16:
        key = int.from_bytes(hashlib.sha256(state.numpy().tobytes()).digest()[:8], "little") & _KEY_BOUND
        torch.empty((), dtype=torch.int64, device=gen.device).random_(generator=gen)
        return key
    seed, offset = (int(v) for v in state.view(torch.int64))
    state[8:] = torch.tensor([offset + (numel + 3) // 4 * 4], dtype=torch.int64).view(torch.uint8)
    gen.set_state(state)
    return _mix(seed, offset)


def _sync_state(mesh) -> None:
    """Copy the generator state of the mesh's first rank into every rank's (torch's run_state_sync):
    one broadcast along each mesh dim from its coordinate 0."""
    gen = _default_generator(mesh.device_type)
    state = gen.get_state()
    buf = state if mesh.device_type == "cpu" else state.to(mesh.device_type)
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.broadcast(buf, group=mesh.get_group(dim), group_src=0)
    gen.set_state(buf.cpu())


class OffsetBasedRNGTracker:
    """How DTensor random ops use torch's generators (the name of torch's class; see the module
    docstring). It holds no seed: ``distribute_region_enabled`` (torch's switch) off makes every
    rank draw its local piece straight from its own generator, as a plain tensor would."""

    def __init__(self, device_mesh=None, run_state_sync: bool = True):
        self.distribute_region_enabled = True
        self.streams: dict[int, int] = {}  # id(local piece) -> its key (parameter_streams)
        if run_state_sync and device_mesh is not None:
            _sync_state(device_mesh)

    def fill(self, local: torch.Tensor, spec, draw, generator: torch.Generator | None = None) -> None:
        """Fill ``local`` (the piece of ``spec`` on this rank) with ``draw(buffer, generator)``."""
        gen = generator if generator is not None else _default_generator(spec.mesh.device_type)
        if not self.distribute_region_enabled:
            draw(local, gen)
            return
        numel = 1
        for s in spec.shape:
            numel *= s
        key = self.streams.get(id(local))
        if key is None:
            key = _take_key(gen, numel)  # every rank, even one whose piece is empty
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
        block_gen = torch.Generator(device=local.device)
        for b, lo, hi in zip(blocks.tolist(), bounds[:-1], bounds[1:], strict=True):
            if lo == hi:
                continue
            block_gen.manual_seed(_mix(key, b))
            buf = torch.empty(min(BLOCK, numel - b * BLOCK), dtype=local.dtype, device=local.device)
            draw(buf, block_gen)
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


# torch's name: None until the first DTensor random op (which syncs the ranks) or manual_seed.
_rng_tracker: OffsetBasedRNGTracker | None = None


def _tracker(mesh) -> OffsetBasedRNGTracker:
    global _rng_tracker
    if _rng_tracker is None:
        _rng_tracker = OffsetBasedRNGTracker(mesh)
    return _rng_tracker


def is_rng_supported_mesh(device_mesh) -> bool:
    """torch's check; every device type is supported here (torch's DTensor: CUDA-like only)."""
    return True


def manual_seed(seed: int, device_mesh=None) -> None:
    """torch's ``manual_seed(seed, device_mesh)``: ``torch.manual_seed(seed)`` on the calling rank,
    and no state sync at the first random op after it. Call it with the same seed on every rank of
    the mesh (``device_mesh`` is optional here; given, the calling rank must be part of it)."""
    global _rng_tracker
    if device_mesh is not None and device_mesh.get_coordinate() is None:
        raise RuntimeError(
            "manual_seed requires the current rank to be a part of the device mesh, otherwise the "
            "DTensor RNG state on this rank is not initialized"
        )
    if _rng_tracker is None:
        _rng_tracker = OffsetBasedRNGTracker(device_mesh, run_state_sync=False)
    torch.manual_seed(seed)


@contextlib.contextmanager
def parameter_streams(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Inside: random draws into each of the ``(name, DTensor)`` pairs come from a key made of one
    draw of the CPU generator at entry and ``name`` (the same on every rank and in every layout),
    not from a draw per op. For initialising a model whose parts live on different ranks
    (pipeline stages): a parameter's values are a function of the generator state at entry, its
    name and its elements' global indices only."""
    tracker = _rng_tracker if _rng_tracker is not None else OffsetBasedRNGTracker(run_state_sync=False)
    base = _take_key(torch.default_generator, 1)
    streams = {}
    for name, t in named:
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        streams[id(t._wait_local())] = _mix(base, key)
    saved, tracker.streams = tracker.streams, streams
    try:
        with _installed(tracker):
            yield
    finally:
        tracker.streams = saved


@contextlib.contextmanager
def _installed(tracker: OffsetBasedRNGTracker) -> Iterator[None]:
    global _rng_tracker
    saved, _rng_tracker = _rng_tracker, tracker
    try:
        yield
    finally:
        _rng_tracker = saved


def get_rng_state() -> dict[str, torch.Tensor]:
    """The generator states DTensor random ops draw from (the CPU's, and the current CUDA
    device's where CUDA is initialised), for a checkpoint."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state) -> None:
    """Restore what ``get_rng_state`` returned. A checkpoint written before the DTensor RNG
    followed torch's generators holds ``(seed, offset)``: nothing of it applies now (the
    checkpoint's torch state, restored beside it, is what the draws follow)."""
    if not isinstance(state, dict):
        return
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
