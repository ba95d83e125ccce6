"""Pure communication functions on local tensors, one per redistribution step kind.

Each function takes the local tensor and the process group of one mesh dim and returns a
``Pending``: the collective is issued asynchronously and ``Pending.wait()`` waits on it and
applies the local post-processing (unpadding, moving the gathered dim into place). The
synchronous path is ``fn(...).wait()``; async redistribution keeps the ``Pending`` and waits
on first use.

Uneven shards follow ``torch.chunk``: each piece is padded to the chunk size ``ceil(n / k)``
for the collective (collectives need equal sizes), and since the real pieces are full chunks
followed by one short one and empties, the valid data after a gather is simply the first
``n`` elements along the dim.

No function mutates its input unless told it owns it (``owned=True``), so redistributing a
DTensor never changes its source (AUDIT 1).

Under ``torch.compile`` (dynamo, or AOTAutograd tracing our dispatch on fake tensors) the same
functions issue torch's functional collectives instead (``torch.distributed._functional_collectives``),
which a graph records as ops; c10d's in-place async works cannot be traced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# torch 2.13 renamed the tensor-in/tensor-out collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_FUNCOL_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min", dist.ReduceOp.AVG: "avg"}


def tracing(x: torch.Tensor) -> bool:
    """Whether ``x`` is being traced by torch.compile (a fake tensor, or dynamo running)."""
    return torch.compiler.is_compiling() or is_fake(x)


class Pending:
    """An issued collective plus the local work to finish its result."""

    __slots__ = ("_finish", "_result", "_work")

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self._work, self._finish, self._result = work, finish, None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._work = self._finish = None
        return self._result


def done(tensor: torch.Tensor) -> Pending:
    p = Pending(None, None)
    p._result = tensor
    return p


def _then(p: Pending, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
    return Pending(None, lambda: fn(p.wait()))


# Dtypes a backend does not carry (gloo: 16-bit integers, unsigned 32/64-bit, float8; NCCL: the
# 16-bit integers; "Invalid scalar type"). Moving data needs only the bytes: a same-size dtype the
# backends carry is viewed in and out. Reducing needs the values: a wider integer, exact (a sum
# wraps as the narrow type's own sum does once cast back), or the same-size signed view for uint64's
# sum (two's complement adds alike); what has neither (uint64 max / min, float8) is refused.
_MOVE_AS = {
    torch.int16: torch.float16, torch.uint16: torch.float16, torch.uint32: torch.int32, torch.uint64: torch.int64,
    **{dt: torch.uint8 for dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)},
}  # fmt: skip
_REDUCE_AS = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _reduce_as(dtype: torch.dtype, reduce_op: str) -> torch.dtype | None:
    """The dtype a reduction of ``dtype`` travels in (None: ``dtype`` itself)."""
    if dtype in _REDUCE_AS:
        return _REDUCE_AS[dtype]
    if dtype == torch.uint64 and reduce_op == "sum":
        return torch.int64  # a bit view: the sum wraps identically
    if dtype in _MOVE_AS:
        raise TypeError(f"hpservice.dtensor: a {reduce_op} reduction of {dtype} is not supported by the collectives")
    return None


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: a bit view between same-size dtypes, else a (widening or narrowing) cast."""
    return x.view(dtype) if dtype.itemsize == x.dtype.itemsize else x.to(dtype)


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` up to ``size`` (returns ``x`` itself when already that size)."""
    missing = size - x.size(dim)
    if missing == 0:
        return x
    pad = [0, 0] * (x.ndim - dim - 1) + [0, missing]
    return F.pad(x, pad)


def _native_avg(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "nccl"


def _prepare_reduction(x: torch.Tensor, reduce_op: str, group: dist.ProcessGroup, owned: bool):
    """Return (buffer to reduce in place, torch ReduceOp, finish(buffer) -> result).

    ``avg`` uses the backend's AVG where it has one (NCCL). Elsewhere each rank divides by n
    first, in fp32 for fp16/bf16, then the values are summed: summing first overflows (4 x 60000
    in fp16; 4 x 3e38 even in fp32 for bf16's range), and fp32 keeps the pre-division exact to
    far below the 16-bit types' precision, so the result is rounded once.
    """
    if reduce_op == "avg" and not _native_avg(group):
        n = dist.get_world_size(group)
        dtype = x.dtype
        if not (x.is_floating_point() or x.is_complex()):
            buf = x if owned else x.clone()
            return buf, dist.ReduceOp.SUM, lambda b: b.div_(n, rounding_mode="floor")
        buf = (x.to(torch.float32) if dtype in _LOW_PRECISION else x) / n
        return buf, dist.ReduceOp.SUM, lambda b: b.to(dtype)
    op = dist.ReduceOp.AVG if reduce_op == "avg" else _REDUCE_OPS[reduce_op]
    return (x if owned else x.clone()), op, lambda b: b


class _Works:
    """Several issued collectives waited on as one."""

    __slots__ = ("works",)

    def __init__(self, *works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _nan_aware(buf: torch.Tensor, op: dist.ReduceOp) -> bool:
    """Whether a max/min reduction of ``buf`` needs its NaNs carried apart: ``torch.amax`` and
    ``amin`` propagate NaN, but the backends compare (gloo's max and NCCL's ``fmaxf`` return the
    other operand), so a NaN on one rank would silently vanish from the reduced result."""
    return op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN) and buf.is_floating_point()


def all_reduce_(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> torch.Tensor:
    """``dist.all_reduce(x, op)`` in place, synchronously; traceable. Max and min keep NaNs
    (``_nan_aware``)."""
    wire = _reduce_as(x.dtype, _FUNCOL_OPS[op])
    if wire is not None:
        return x.copy_(_as(all_reduce_(_as(x, wire), op, group), x.dtype))
    nan = x.isnan().to(x.dtype) if _nan_aware(x, op) else None
    if tracing(x):
        x.copy_(funcol.all_reduce(x, _FUNCOL_OPS[op], group))
        return x if nan is None else x.masked_fill_(funcol.all_reduce(nan, "max", group).bool(), float("nan"))
    dist.all_reduce(x, op=op, group=group)
    if nan is not None:
        dist.all_reduce(nan, op=dist.ReduceOp.MAX, group=group)
        x.masked_fill_(nan.bool(), float("nan"))
    return x


def all_reduce(x: torch.Tensor, reduce_op: str, group: dist.ProcessGroup, *, owned: bool = False) -> Pending:
    """Partial -> Replicate on one mesh dim."""
    wire = _reduce_as(x.dtype, reduce_op)
    if wire is not None:
        dtype = x.dtype
        return _then(all_reduce(_as(x, wire), reduce_op, group, owned=owned), lambda y: _as(y, dtype))
    buf, op, finish = _prepare_reduction(x.contiguous(), reduce_op, group, owned)
    nan = buf.isnan().to(buf.dtype) if _nan_aware(buf, op) else None
    if tracing(buf):
        out = funcol.all_reduce(buf, _FUNCOL_OPS[op], group)
        if nan is not None:
            out = out.masked_fill(funcol.all_reduce(nan, "max", group).bool(), float("nan"))
        return done(finish(out))
    work = dist.all_reduce(buf, op=op, group=group, async_op=True)
    if nan is None:
        return Pending(work, lambda: finish(buf))
    nan_work = dist.all_reduce(nan, op=dist.ReduceOp.MAX, group=group, async_op=True)
    return Pending(_Works(work, nan_work), lambda: finish(buf.masked_fill_(nan.bool(), float("nan"))))


def all_gather(x: torch.Tensor, dim: int, full_size: int, group: dist.ProcessGroup) -> Pending:
    """Shard(dim) -> Replicate on one mesh dim: the result has ``full_size`` along ``dim``."""
    if x.dtype in _MOVE_AS:
        dtype = x.dtype
        return _then(all_gather(_as(x, _MOVE_AS[dtype]), dim, full_size, group), lambda y: _as(y, dtype))
    k = dist.get_world_size(group)
    chunk = -(-full_size // k)
    src = _pad_dim(x, dim, chunk).contiguous()
    # Collectives concatenate along dim 0: gather (k * d0, ...) and view it as (k, d0, ...).

    def finish(out: torch.Tensor) -> torch.Tensor:
        y = out if dim == 0 else out.view((k,) + tuple(src.shape)).movedim(0, dim).flatten(dim, dim + 1)
        # Uneven: drop the padding; a narrow of a dim > 0 is copied so that local pieces stay
        # contiguous (composite ops pick ``view`` from the DTensor's contiguous strides).
        return y if y.size(dim) == full_size else y.narrow(dim, 0, full_size).contiguous()

    if tracing(src):
        return done(finish(funcol.all_gather_tensor(src, 0, group)))
    out = src.new_empty((k * src.size(0),) + tuple(src.shape[1:]))
    work = _all_gather_single(out, src, group=group, async_op=True)
    return Pending(work, lambda: finish(out))


def reduce_scatter(x: torch.Tensor, dim: int, reduce_op: str, group: dist.ProcessGroup, index: int) -> Pending:
    """Partial -> Shard(dim) on one mesh dim: one reduce-scatter; ``index`` is this rank's chunk."""
    wire = _reduce_as(x.dtype, reduce_op)
    if wire is not None:
        dtype = x.dtype
        return _then(reduce_scatter(_as(x, wire), dim, reduce_op, group, index), lambda y: _as(y, dtype))
    k = dist.get_world_size(group)
    full_size = x.size(dim)
    chunk = -(-full_size // k)
    padded = _pad_dim(x, dim, chunk * k)
    # Chunk j of dim must be the j-th contiguous block: (.., k*c, ..) -> (k, .., c, ..).
    src = padded if dim == 0 else padded.unflatten(dim, (k, chunk)).movedim(dim, 0)
    # The collective reads its input and writes ``out``: no copy of ``x`` is needed.
    buf, op, finish = _prepare_reduction(src.contiguous(), reduce_op, group, owned=True)
    if dim != 0:  # (k, d0, ..., c, ...) -> (k * d0, ..., c, ...): the collective splits dim 0 in k
        buf = buf.flatten(0, 1)
    size = max(0, min(chunk, full_size - index * chunk))

    def finish_rs(out: torch.Tensor) -> torch.Tensor:
        y = finish(out)
        return y if size == chunk else y.narrow(dim, 0, size).contiguous()

    nan = buf.isnan().to(buf.dtype) if _nan_aware(buf, op) else None
    if tracing(buf):
        out = funcol.reduce_scatter_tensor(buf, _FUNCOL_OPS[op], 0, group)
        if nan is not None:
            out = out.masked_fill(funcol.reduce_scatter_tensor(nan, "max", 0, group).bool(), float("nan"))
        return done(finish_rs(out))
    out = buf.new_empty((buf.size(0) // k,) + tuple(buf.shape[1:]))
    work = _reduce_scatter_single(out, buf, op=op, group=group, async_op=True)
    if nan is None:
        return Pending(work, lambda: finish_rs(out))
    nan_out = torch.empty_like(out)
    nan_work = _reduce_scatter_single(nan_out, nan, op=dist.ReduceOp.MAX, group=group, async_op=True)
    return Pending(_Works(work, nan_work), lambda: finish_rs(out.masked_fill_(nan_out.bool(), float("nan"))))


def all_to_all(
    x: torch.Tensor, src_dim: int, dst_dim: int, src_full: int, group: dist.ProcessGroup, index: int
) -> Pending:
    """Shard(src_dim) -> Shard(dst_dim) on one mesh dim with one all-to-all (works on gloo).

    Before: ``src_dim`` holds this rank's chunk of ``src_full``, ``dst_dim`` is whole.
    After: ``src_dim`` is whole (``src_full``), ``dst_dim`` holds chunk ``index``.
    """
    if x.dtype in _MOVE_AS:
        dtype = x.dtype
        return _then(
            all_to_all(x.view(_MOVE_AS[dtype]), src_dim, dst_dim, src_full, group, index), lambda y: y.view(dtype)
        )
    k = dist.get_world_size(group)
    dst_full = x.size(dst_dim)
    c_src, c_dst = -(-src_full // k), -(-dst_full // k)
    y = _pad_dim(_pad_dim(x, src_dim, c_src), dst_dim, c_dst * k)
    # (.., k*c_dst, ..) -> (k, ..., c_dst, ...): piece j goes to rank j; other dims keep their index + 1.
    send = y.unflatten(dst_dim, (k, c_dst)).movedim(dst_dim, 0).contiguous()
    dst_size = max(0, min(c_dst, dst_full - index * c_dst))

    def finish(recv: torch.Tensor) -> torch.Tensor:
        # recv[j] is rank j's chunk of src_dim: put the k axis just before src_dim and merge.
        z = recv.movedim(0, src_dim).flatten(src_dim, src_dim + 1)
        if z.size(src_dim) != src_full:
            z = z.narrow(src_dim, 0, src_full)
        z = z if dst_size == c_dst else z.narrow(dst_dim, 0, dst_size)
        return z.contiguous()

    if tracing(send):
        return done(finish(funcol.all_to_all_single(send, None, None, group)))
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return Pending(work, lambda: finish(recv))


def broadcast(x: torch.Tensor, group: dist.ProcessGroup, group_src: int) -> torch.Tensor:
    """Return group rank ``group_src``'s ``x`` on every rank (``x`` itself is not written)."""
    if x.dtype in _MOVE_AS:
        return broadcast(x.view(_MOVE_AS[x.dtype]), group, group_src).view(x.dtype)
    buf = x.contiguous().clone()
    dist.broadcast(buf, group=group, group_src=group_src)
    return buf


def scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, group_src: int, index: int) -> torch.Tensor:
    """Group rank ``group_src`` cuts ``x`` along ``dim`` (torch.chunk sizes) and sends chunk j to rank j."""
    if x.dtype in _MOVE_AS:
        return scatter(x.view(_MOVE_AS[x.dtype]), dim, group, group_src, index).view(x.dtype)
    k = dist.get_world_size(group)
    full_size = x.size(dim)
    chunk = -(-full_size // k)
    padded = _pad_dim(x, dim, chunk * k)
    pieces = [p.contiguous() for p in padded.split(chunk, dim)] if chunk > 0 else [padded.contiguous()] * k
    out = torch.empty_like(pieces[0])
    dist.scatter(out, pieces if dist.get_rank(group) == group_src else None, group=group, group_src=group_src)
    size = max(0, min(chunk, full_size - index * chunk))
    return out if size == chunk else out.narrow(dim, 0, size).contiguous()
