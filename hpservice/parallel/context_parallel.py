"""Context parallelism: attention over a sequence sharded across the ranks of one mesh dim.

Every activation of a long sequence is split on the sequence dim over the ``cp`` ranks, so a
rank holds ``seq_len / cp`` tokens of each sequence. Everything but attention is per token and
runs on the shard as it is; attention needs every earlier key and value, which
``ring_attention`` brings to each rank in turn.

Layout (``load_balance=True``, the default, as torch's ``context_parallel``): the sequence is cut
into ``2 x cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``, a head chunk
and a tail chunk, so that under a causal mask every rank does the same work (with contiguous
shards the last rank would attend to the whole sequence and the first to its own shard only).
``load_balance=False`` gives rank ``r`` the ``r``-th contiguous ``seq_len / cp`` slice.
``positions(seq_len, cp, rank)`` says which global positions a rank holds: rotary embeddings
are computed from them, never from the local index.

Ring attention (``rotate="ring"``): each rank starts with its own keys/values and passes them to
the next rank ``cp - 1`` times (point-to-point send/recv). At each hop a rank attends its queries
to the block it holds, chunk pair by chunk pair: a key chunk after the query chunk is skipped
outright (causal), one before it is attended in full, the same chunk with the causal mask.
Partial results are merged with the online softmax: each carries its log-sum-exp, and
``out = sum_i exp(lse_i - lse) out_i`` with ``lse = logsumexp_i lse_i``. The backward is flash
attention's, block by block from the saved output and log-sum-exp; each block's key/value
gradients travel round the ring with it, and one last hop brings them to their owner (every rank
makes the same sends in the same order, whatever its mask skips, so none waits for a send that
never comes). ``rotate="allgather"`` gathers every rank's keys/values at once (one collective,
more memory: all keys and values of the sequence on every rank) and reduce-scatters their
gradients.

Packed sequences: ``document_ids`` ([B, S] per token, sharded like the tokens;
``document_ids_from_eos`` derives them from the end-of-text tokens) restrict attention to tokens
of the same document. Masks are built per chunk pair (``chunk x chunk``), never as a
``[seq, seq]`` tensor, and a chunk pair with no document in common is skipped. Without context
parallelism, ``document_masking(document_ids)`` runs the same blockwise attention on one rank
(chunks of ``LOCAL_BLOCK`` tokens): what the trainer uses for ``data.document_mask``.

Memory: the attention scores a rank keeps for backward are ``seq_len / cp x seq_len`` per head
(``1/cp`` of one device's), and every other activation is ``1/cp`` as well.

Sliding windows: ``window`` is one more condition of a chunk pair's mask (a key chunk wholly
``window`` or more tokens back is skipped), under the ring, the all-gather and on one rank.

``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` has torch's name and shape
(``torch.distributed.tensor.experimental.context_parallel``): inside it the buffers are sharded in
place and the models' attention (``hpservice.models.attention``, and torch's
``F.scaled_dot_product_attention`` through its function mode) runs as ring attention over
``mesh``: this module supplies the layout and that backend, the models' module the entry point.
The differences from torch's are in ``docs/context-parallel.md``.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist

from ..models.attention import ActiveAttention, in_force

__all__ = [
    "context_parallel",
    "context_parallel_unshard",
    "document_ids_from_eos",
    "document_masking",
    "positions",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]


# ---- layout ------------------------------------------------------------------------------------
def chunks_of(cp: int, rank: int, load_balance: bool = True) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in local order: ``(rank, 2cp - 1 - rank)`` of
    ``2 x cp`` chunks when load-balanced, else ``(rank,)`` of ``cp``."""
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def _check_divisible(seq_len: int, cp: int, load_balance: bool) -> int:
    parts = 2 * cp if load_balance else cp
    if seq_len % parts:
        how = f"2 x cp = {parts}" if load_balance else f"cp = {parts}"
        raise ValueError(f"sequence length {seq_len} is not divisible by {how} (context parallelism)")
    return seq_len // parts


def positions(seq_len: int, cp: int, rank: int, *, load_balance: bool = True, device=None) -> torch.Tensor:
    """The global positions (``LongTensor [seq_len / cp]``) of the tokens rank ``rank`` holds."""
    chunk = _check_divisible(seq_len, cp, load_balance)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks_of(cp, rank, load_balance)])


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int, *, load_balance: bool = True) -> torch.Tensor:
    """This rank's shard of ``x`` (the whole sequence on dim ``dim``)."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, load_balance=load_balance, device=x.device))


def unshard_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None, *, load_balance: bool = True) -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` (an all-gather, then the chunks put back in
    order). Not differentiable: for outputs and checks."""
    cp, x = dist.get_world_size(group), x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x, group=group)
    n = len(chunks_of(cp, 0, load_balance))
    pieces: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        for c, piece in zip(chunks_of(cp, rank, load_balance), part.chunk(n, dim), strict=True):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in sorted(pieces)], dim)


# ---- communication --------------------------------------------------------------------------
def _shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    """Send ``x`` to the rank ``step`` ahead on the ring, receive the one from ``step`` behind."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    dst = dist.get_global_rank(group, (rank + step) % n) if group is not None else (rank + step) % n
    src = dist.get_global_rank(group, (rank - step) % n) if group is not None else (rank - step) % n
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def _gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


# ---- attention by chunk pairs and the online-softmax merge ---------------------------------------
_EMPTY_LSE = -1e30  # the log-sum-exp of a row with nothing to attend to: finite, so no NaN in backward


def _attend(q, k, v, mask, scale):
    """Softmax attention of ``q [.., cq, D]`` to ``k, v [.., ck, D]``: (out, lse [.., cq, 1]). A row
    with nothing to attend to (all masked) gives out 0 and lse ``_EMPTY_LSE``, a finite stand-in
    for -inf: the merge gives it weight 0, and no ``-inf - -inf`` ever reaches autograd."""
    scores = (q @ k.transpose(-2, -1)) * scale
    empty = None
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        empty = ~mask.any(-1, keepdim=True)
        if empty.any():
            scores = scores.masked_fill(empty, 0.0)  # finite; this row's results are replaced below
        else:
            empty = None
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v
    if empty is not None:
        out, lse = out.masked_fill(empty, 0.0), lse.masked_fill(empty, _EMPTY_LSE)
    return out, lse


def _merge(out, lse, part_out, part_lse):
    """The online-softmax merge of two partial results over disjoint keys."""
    if out is None:
        return part_out, part_lse
    new = torch.logaddexp(lse, part_lse)
    return torch.exp(lse - new) * out + torch.exp(part_lse - new) * part_out, new


def _pair_mask(q_chunk, k_chunk, size, causal, window, q_docs, k_docs, device):
    """The mask of one chunk pair ([B or 1, 1, size, size] bools; None: attend to all), or
    False when there is nothing to compute: the key chunk wholly after the query chunk (causal),
    wholly ``window`` or more tokens before it, or no document in common. Chunk ``c`` holds the
    global positions ``[c * size, (c + 1) * size)``, so a query's distance to a key is
    ``(q_chunk - k_chunk) * size + a - b`` for in-chunk rows ``a`` and columns ``b``."""
    mask = None
    base = (q_chunk - k_chunk) * size
    if causal:
        if k_chunk > q_chunk:
            return False
        if window is not None and base - (size - 1) >= window:  # the nearest pair is too far back
            return False
        if k_chunk == q_chunk or (window is not None and base + size - 1 >= window):
            i = torch.arange(size, device=device)
            offset = base + i[:, None] - i[None, :]
            mask = offset >= 0
            if window is not None:
                mask = mask & (offset < window)
            mask = mask[None, None]
    if q_docs is not None:
        same = (q_docs[:, :, None] == k_docs[:, None, :])[:, None]  # [B, 1, size, size]
        mask = same if mask is None else mask & same
        if not bool(mask.any()):
            return False
    return mask


class _Ring:
    """One call's layout: which chunk pairs to compute for a key/value block from rank ``src``,
    with which mask."""

    def __init__(self, q, group, is_causal, document_ids, load_balance, window=None):
        self.group, self.is_causal, self.load_balance, self.window = group, is_causal, load_balance, window
        self.local = group is LOCAL
        if self.local:  # one rank, the whole sequence in blocks of LOCAL_BLOCK tokens
            self.cp, self.rank = 1, 0
            self.mine = tuple(range(_local_chunks(q.shape[-2])))
        else:
            self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
            self.mine = chunks_of(self.cp, self.rank, load_balance)
        n = len(self.mine)
        if q.shape[-2] % n:
            raise ValueError(f"the local sequence ({q.shape[-2]}) does not split into {n} chunks")
        self.n, self.size, self.device = n, q.shape[-2] // n, q.device
        self.q_docs = document_ids.split(self.size, dim=-1) if document_ids is not None else (None,) * n

    def sources(self):
        """The rank whose keys/values this rank holds at each hop of the ring."""
        return [(self.rank - hop) % self.cp for hop in range(self.cp)]

    def pairs(self, src: int, docs_blk):
        """(query chunk i, key chunk j, mask) of every pair with something to attend to."""
        k_docs = docs_blk.split(self.size, dim=-1) if docs_blk is not None else (None,) * self.n
        for i, qc in enumerate(self.mine):
            for j, kc in enumerate(self.mine if self.local else chunks_of(self.cp, src, self.load_balance)):
                mask = _pair_mask(qc, kc, self.size, self.is_causal, self.window, self.q_docs[i], k_docs[j], self.device)
                if mask is not False:
                    yield i, j, mask


class _RingAttention(torch.autograd.Function):
    """Forward: the online-softmax merge over key/value blocks as they come round the ring (or
    all at once). Backward (flash attention's): for each block again, the probabilities from the
    saved output's log-sum-exp, ``dS = P * (dP - rowsum(dO * O))``; each block's key/value
    gradients travel round the ring with it and a last hop brings them home. Nothing per block
    is kept between forward and backward: memory is q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, group, is_causal, scale, load_balance, rotate, window):
        ring = _Ring(q, group, is_causal, document_ids, load_balance, window)
        size = ring.size
        q_parts = q.split(size, dim=-2)
        outs, lses = [None] * ring.n, [None] * ring.n
        for src, k_blk, v_blk, docs_blk in _blocks(ring, k, v, document_ids, rotate):
            k_parts, v_parts = k_blk.split(size, dim=-2), v_blk.split(size, dim=-2)
            for i, j, mask in ring.pairs(src, docs_blk):
                o, lse = _attend(q_parts[i], k_parts[j], v_parts[j], mask, scale)
                outs[i], lses[i] = _merge(outs[i], lses[i], o, lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-2)
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.ring, ctx.scale, ctx.rotate = ring, scale, rotate
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        ring, scale, size = ctx.ring, ctx.scale, ctx.ring.size
        dout = dout.contiguous()
        q_parts, lse_parts, do_parts = q.split(size, -2), lse.split(size, -2), dout.split(size, -2)
        delta = (dout * out).sum(-1, keepdim=True).split(size, -2)  # rowsum(dO * O)
        dq_parts = [torch.zeros_like(p) for p in q_parts]

        def block_grads(src, k_blk, v_blk, docs_blk):
            dk, dv = torch.zeros_like(k_blk), torch.zeros_like(v_blk)
            k_parts, v_parts = k_blk.split(size, -2), v_blk.split(size, -2)
            dk_parts, dv_parts = dk.split(size, -2), dv.split(size, -2)
            for i, j, mask in ring.pairs(src, docs_blk):
                scores = (q_parts[i] @ k_parts[j].transpose(-2, -1)) * scale
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                prob = torch.exp(scores - lse_parts[i])
                dv_parts[j].add_(prob.transpose(-2, -1) @ do_parts[i])
                dscores = prob * (do_parts[i] @ v_parts[j].transpose(-2, -1) - delta[i])
                dq_parts[i].add_((dscores @ k_parts[j]) * scale)
                dk_parts[j].add_((dscores.transpose(-2, -1) @ q_parts[i]) * scale)
            return dk, dv

        if ctx.rotate == "allgather":
            grads = [block_grads(src, kb, vb, db) for src, kb, vb, db in _blocks(ring, k, v, document_ids, "allgather")]
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            dist.reduce_scatter(dk, [g[0].contiguous() for g in grads], group=ring.group)
            dv_list = [g[1].contiguous() for g in grads]
            dist.reduce_scatter(dv, dv_list, group=ring.group)
        else:
            k_blk, v_blk, docs_blk = k, v, document_ids
            dk_blk = dv_blk = None
            for hop, src in enumerate(ring.sources()):
                if hop:  # the block and the gradients gathered for it so far move on together
                    k_blk, v_blk = _shift(k_blk, ring.group, +1), _shift(v_blk, ring.group, +1)
                    dk_blk, dv_blk = _shift(dk_blk, ring.group, +1), _shift(dv_blk, ring.group, +1)
                    if docs_blk is not None:
                        docs_blk = _shift(docs_blk, ring.group, +1)
                dk_hop, dv_hop = block_grads(src, k_blk, v_blk, docs_blk)
                dk_blk = dk_hop if dk_blk is None else dk_blk + dk_hop
                dv_blk = dv_hop if dv_blk is None else dv_blk + dv_hop
            # the last block held is rank + 1's: one more hop takes its gradients home
            dk, dv = (_shift(dk_blk, ring.group, +1), _shift(dv_blk, ring.group, +1)) if ring.cp > 1 else (dk_blk, dv_blk)
        return torch.cat(dq_parts, dim=-2), dk, dv, None, None, None, None, None, None, None


def _blocks(ring: _Ring, k, v, document_ids, rotate):
    """(source rank, its keys, values, document ids) of every block, in the order they arrive."""
    if rotate == "allgather":
        ks, vs = _gather(k, ring.group), _gather(v, ring.group)
        docs = _gather(document_ids, ring.group) if document_ids is not None else [None] * ring.cp
        yield from zip(range(ring.cp), ks, vs, docs, strict=True)
        return
    k_blk, v_blk, docs_blk = k, v, document_ids
    for hop, src in enumerate(ring.sources()):
        if hop:
            k_blk, v_blk = _shift(k_blk, ring.group, +1), _shift(v_blk, ring.group, +1)
            if docs_blk is not None:
                docs_blk = _shift(docs_blk, ring.group, +1)
        yield src, k_blk, v_blk, docs_blk


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    is_causal: bool = True,
    document_ids: torch.Tensor | None = None,
    scale: float | None = None,
    load_balance: bool = True,
    rotate: str = "ring",
    window: int | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries to the keys/values of the whole sequence, sharded over
    ``group`` as ``shard_sequence`` lays it out. ``q``: ``[B, H, S/cp, D]``; ``k``, ``v``: the
    same heads (expand grouped-query heads first, as for SDPA). Equals
    ``F.scaled_dot_product_attention`` on the whole sequence (``is_causal``), restricted to tokens
    of one document where ``document_ids`` ([B, S/cp], sharded the same way) is given, and to the
    ``window`` keys up to and including its own position where ``window`` is given (a sliding
    window, causal only); returns this rank's rows of it. Differentiable in q, k and v."""
    if rotate not in ("ring", "allgather"):
        raise ValueError(f"rotate: expected 'ring' or 'allgather', got {rotate!r}")
    if window is not None and (not is_causal or window < 1):
        raise ValueError(f"window: a sliding window needs is_causal=True and window >= 1, got {window}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, document_ids, group, is_causal, scale, load_balance, rotate, window)


# ---- packed documents on one rank ---------------------------------------------------------------
LOCAL = object()  # the "group" of blockwise attention on one rank: no communication
LOCAL_BLOCK = 256  # tokens per chunk there: masks and scores are [LOCAL_BLOCK, LOCAL_BLOCK] per pair


def _local_chunks(seq_len: int) -> int:
    """How many equal chunks of about LOCAL_BLOCK tokens a sequence is cut into (a divisor)."""
    n = max(1, -(-seq_len // LOCAL_BLOCK))
    while seq_len % n:
        n += 1
    return n


def document_ids_from_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per token (``[B, S]``), which document of its row it belongs to: the number of end-of-text
    tokens before it, so the EOS closing a document is that document's last token."""
    eos = tokens == eos_id
    return torch.cumsum(eos, dim=-1) - eos.long()


# ---- the backend in force -------------------------------------------------------------------------
# The models' attention (hpservice.models.attention) runs the backend put in force here.


def document_masking(document_ids: torch.Tensor):
    """Inside: the built-in models' attention (``hpservice.models.attention``, and torch's
    ``F.scaled_dot_product_attention`` through its mode) attends only within a document, on one
    rank, blockwise (no ``[seq, seq]`` mask); ``document_ids`` is ``[B, S]``."""
    backend = functools.partial(ring_attention, group=LOCAL, load_balance=False, rotate="ring", document_ids=document_ids)
    return in_force(ActiveAttention(backend))


@contextlib.contextmanager
def context_parallel(
    mesh,
    *,
    buffers: list[torch.Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    load_balance: bool = True,
    rotate: str = "ring",
    document_ids: torch.Tensor | None = None,
):
    """Inside: each of ``buffers`` holds this rank's shard of itself (on ``buffer_seq_dims``, in
    place), and ``F.scaled_dot_product_attention`` runs as ring attention over ``mesh`` (1-d).
    On exit the buffers get their whole values back, except those in ``no_restore_buffers``.
    ``document_ids`` (this rank's shard) restricts attention to one document (packed sequences)."""
    if mesh.ndim != 1:
        raise ValueError(f"context_parallel needs a 1-d mesh (the cp dim), got {mesh.ndim} dims")
    group, cp, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    buffers, dims = list(buffers or []), list(buffer_seq_dims or [])
    if len(buffers) != len(dims):
        raise ValueError(f"{len(buffers)} buffers but {len(dims)} buffer_seq_dims")
    no_restore = {id(b) for b in (no_restore_buffers or ())}
    originals = []
    for buf, dim in zip(buffers, dims, strict=True):
        whole = buf.detach().clone()
        shard = shard_sequence(whole, dim, cp, rank, load_balance=load_balance)
        with torch.no_grad():
            buf.resize_(shard.shape).copy_(shard)
        originals.append((buf, whole))
    backend = functools.partial(
        ring_attention, group=group, load_balance=load_balance, rotate=rotate, document_ids=document_ids
    )
    try:
        with in_force(ActiveAttention(backend)) as active:
            yield active
    finally:
        for buf, whole in originals:
            if id(buf) not in no_restore:
                with torch.no_grad():
                    buf.resize_(whole.shape).copy_(whole)


def context_parallel_unshard(mesh, buffers: list[torch.Tensor], seq_dims: list[int], *, load_balance: bool = True):
    """The whole sequences of ``buffers`` (each this rank's shard), as torch's function of the name."""
    return [unshard_sequence(b, d, mesh.get_group(), load_balance=load_balance) for b, d in zip(buffers, seq_dims, strict=True)]
