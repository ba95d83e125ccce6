"""Tensor parallelism, second slice: embedding (replicated, embedding-dim and vocab-parallel),
layer norm / RMSNorm, softmax / log-softmax rules and the vocab-parallel cross-entropy, compared
with the single-device computation (forward and gradients), uneven shards included."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpservice.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module, vocab_parallel_cross_entropy

from ._compare import _compare, _randn

R, P = Replicate(), Partial()
VOCAB, DIM = 37, 16


def _ids(*shape, seed=0):
    """Ids covering every vocab shard, with repeats."""
    ids = torch.randint(0, VOCAB, tuple(shape), generator=torch.Generator().manual_seed(seed))
    flat = ids.view(-1)
    flat[: min(flat.numel(), 6)] = torch.tensor([0, 36, 18, 9, 27, 0])[: min(flat.numel(), 6)]
    return ids


# ---- embedding ------------------------------------------------------------------------------------


def _check_embedding_rules(world):
    mesh = init_device_mesh("cpu", (world,))
    weight, ids = _randn(VOCAB, DIM, seed=1), _ids(3, 5, seed=2)
    emb = F.embedding
    # (a) replicated weight: the output follows the ids.
    out = _compare(lambda i, w: emb(i, w), [ids, weight], [[Shard(0)], [R]], mesh)
    assert out.placements == (Shard(0),)
    out = _compare(lambda i, w: emb(i, w), [ids, weight], [[Shard(1)], [R]], mesh)
    assert out.placements == (Shard(1),)
    # (b) embedding dim sharded (16 and an odd 7): output Shard(-1).
    out = _compare(lambda i, w: emb(i, w), [ids, weight], [[R], [Shard(1)]], mesh)
    assert out.placements == (Shard(2),)
    out = _compare(lambda i, w: emb(i, w), [ids, weight[:, :7]], [[Shard(0)], [Shard(1)]], mesh)
    assert out.placements == (Shard(2),)
    # (c) vocab-parallel: Partial(sum); padding_idx still excludes its row from the gradient.
    out = _compare(lambda i, w: emb(i, w), [ids, weight], [[R], [Shard(0)]], mesh)
    assert out.placements == (P,)
    _compare(lambda i, w: emb(i, w, padding_idx=9), [ids, weight], [[R], [Shard(0)]], mesh)
    _compare(lambda i, w: emb(i, w, scale_grad_by_freq=True), [ids, weight], [[Shard(0)], [R]], mesh)
    # 5 rows over 4 ranks: an empty vocabulary chunk.
    small = ids.remainder(5)
    _compare(lambda i, w: emb(i, w), [small, weight[:5]], [[R], [Shard(0)]], mesh)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_embedding_rules(ranks, world):
    ranks(world).run(_check_embedding_rules, world)


def _check_audit_17(world):
    mesh = init_device_mesh("cpu", (world,))
    weight = _randn(VOCAB, DIM, seed=3)
    ids = _ids(4, 9, seed=4)
    assert set(ids.view(-1).tolist()) >= {0, 9, 18, 27, 36}
    ref_w = weight.clone().requires_grad_()
    ref = F.embedding(ids, ref_w)
    g = _randn(*ref.shape, seed=5)
    (ref * g).sum().backward()
    w = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    local_before = w.to_local().clone()
    i = distribute_tensor(ids, mesh, [R])
    out = F.embedding(i, w)
    assert out.placements == (P,)  # each rank looked up only its own vocabulary range
    # The local piece holds only this rank's rows: ids outside the range contribute zeros.
    lo = sum(c.shape[0] for c in weight.chunk(world)[: dist.get_rank()])
    hi = lo + w.to_local().shape[0]
    mine = (ids >= lo) & (ids < hi)
    torch.testing.assert_close(out.to_local()[~mine], torch.zeros_like(out.to_local()[~mine]))
    full = out.full_tensor()
    torch.testing.assert_close(full, ref, atol=1e-6, rtol=1e-6)
    (full * g).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), ref_w.grad, atol=1e-6, rtol=1e-6)
    assert torch.equal(w.to_local(), local_before)
    # The style: RowwiseParallel on nn.Embedding, the gradient in the parameter's placements.
    torch.manual_seed(0)
    ref_m = nn.Embedding(VOCAB, DIM)
    model = copy.deepcopy(ref_m)
    parallelize_module(model, mesh, RowwiseParallel())
    assert model.weight.placements == (Shard(0),)
    out = model(ids)
    assert type(out) is torch.Tensor
    ref_out = ref_m(ids)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    (out * g).sum().backward()
    (ref_out * g).sum().backward()
    assert model.weight.grad.placements == (Shard(0),)
    torch.testing.assert_close(model.weight.grad.full_tensor(), ref_m.weight.grad, atol=1e-6, rtol=1e-6)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_audit_17_vocab_parallel_embedding_equals_unsharded(ranks, world):
    ranks(world).run(_check_audit_17, world)


def _check_vocab_parallel_style_local_gradient(world, vocab, padding_idx, scale_grad_by_freq):
    """RowwiseParallel on nn.Embedding: padding_idx and scale_grad_by_freq as nn.Embedding, and the
    backward never builds a [V, D] gradient (only this rank's rows)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if type(t) is torch.Tensor:  # memory; a DTensor is a wrapper without storage
                    self.seen.append(tuple(t.shape))
            return out

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, DIM, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, RowwiseParallel())
    ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(6))
    ids.view(-1)[:3] = torch.tensor([0, vocab - 1, padding_idx if padding_idx is not None else 1])
    g = _randn(3, 5, DIM, seed=7)
    out = model(ids)
    torch.testing.assert_close(out, ref(ids), atol=1e-6, rtol=1e-6)
    with Shapes() as shapes:
        (out * g).sum().backward()
    (ref(ids) * g).sum().backward()
    assert model.weight.grad.placements == (Shard(0),)
    torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad, atol=1e-6, rtol=1e-6)
    assert not [s for s in shapes.seen if len(s) == 2 and s[0] >= vocab], shapes.seen


@pytest.mark.parametrize(
    "world,vocab,padding_idx,scale",
    [(2, VOCAB, 9, False), (4, VOCAB, None, True), (4, 3, 2, False)],  # 3 over 4 ranks: an empty piece
)
def test_vocab_parallel_embedding_style_builds_only_local_gradient(ranks, world, vocab, padding_idx, scale):
    ranks(world).run(_check_vocab_parallel_style_local_gradient, world, vocab, padding_idx, scale)


def _check_colwise_embedding():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = nn.Embedding(VOCAB, 7)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, ColwiseParallel(use_local_output=False))
    assert model.weight.placements == (Shard(1),)
    ids = _ids(2, 5, seed=6)
    out = model(ids)
    assert out.placements == (Shard(2),)
    torch.testing.assert_close(out.full_tensor(), ref(ids))
    g = _randn(2, 5, 7, seed=7)
    (out.full_tensor() * g).sum().backward()
    (ref(ids) * g).sum().backward()
    assert model.weight.grad.placements == (Shard(1),)
    torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_colwise_embedding_style(ranks, world):
    ranks(world).run(_check_colwise_embedding)


# ---- norms and softmax ----------------------------------------------------------------------------


def _rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _check_norm_rules(world):
    mesh = init_device_mesh("cpu", (world,))
    x, w, b = _randn(3, 5, 13, seed=8), _randn(13, seed=9), _randn(13, seed=10)
    ln = lambda t, ww, bb: F.layer_norm(t, (13,), ww, bb)  # noqa: E731
    for pl, expect in [(Shard(0), Shard(0)), (Shard(1), Shard(1)), (Shard(2), R), (P, R)]:
        out = _compare(ln, [x, w, b], [[pl], [R], [R]], mesh)
        assert out.placements == (expect,)
    _compare(ln, [x, w, b], [[Shard(1)], [Shard(0)], [R]], mesh)  # a sharded weight is gathered
    out = _compare(lambda t: F.layer_norm(t, (5, 13)), [x], [[Shard(0)]], mesh)
    assert out.placements == (Shard(0),)
    out = _compare(lambda t: F.layer_norm(t, (5, 13)), [x], [[Shard(1)]], mesh)
    assert out.placements == (R,)
    # RMSNorm as users write it: mean over a non-sharded last dim keeps the batch shard.
    out = _compare(lambda t: t.pow(2).mean(-1, keepdim=True), [x], [[Shard(1)]], mesh)
    assert out.placements == (Shard(1),)
    out = _compare(lambda t: t.mean(-1), [x], [[Shard(0)]], mesh)
    assert out.placements == (Shard(0),)
    for pl in (Shard(0), Shard(1)):
        out = _compare(_rms_norm, [x, w], [[pl], [R]], mesh)
        assert out.placements == (pl,)
        out = _compare(lambda t, ww: F.rms_norm(t, (13,), ww, 1e-6), [x, w], [[pl], [R]], mesh)
        assert out.placements == (pl,)
    # The normalised dim sharded: the mean is a pending Partial, reduced before "+ eps" (torch's rule).
    _compare(_rms_norm, [x, w], [[Shard(2)], [R]], mesh)
    gather = lambda t: t.redistribute(mesh, [R]) if isinstance(t, DTensor) else t  # noqa: E731
    _compare(lambda t, ww: _rms_norm(gather(t), ww), [x, w], [[Shard(2)], [R]], mesh)
    # softmax / log-softmax: local over a non-sharded dim, gathered over a sharded one.
    for fn in (F.softmax, F.log_softmax):
        for dim, pl, expect in [
            (-1, Shard(0), Shard(0)),
            (-1, Shard(1), Shard(1)),
            (-1, Shard(2), R),
            (0, Shard(0), R),
        ]:
            out = _compare(lambda t, fn=fn, dim=dim: fn(t, dim=dim), [x], [[pl]], mesh)
            assert out.placements == (expect,)
        _compare(lambda t, fn=fn: fn(t, dim=1), [x], [[P]], mesh)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_norm_and_softmax_rules(ranks, world):
    ranks(world).run(_check_norm_rules, world)


def _check_audit_09():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(_randn(6, 4, 10, seed=11), mesh, [Shard(1)])
    w = distribute_tensor(_randn(10, seed=12), mesh, [R])
    out, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [10], w, None, 1e-5)
    # The main output has the input's shape and placements, never the statistics' ([6, 4, 1]).
    assert out.placements == x.placements and out.shape == x.shape
    assert out.to_local().shape == x.to_local().shape
    assert mean.shape == rstd.shape == (6, 4, 1) and mean.placements == rstd.placements == (Shard(1),)
    ref = F.layer_norm(x.full_tensor(), (10,), w.full_tensor())
    torch.testing.assert_close(out.full_tensor(), ref)
    out = F.layer_norm(x, (4, 10))  # the sharded dim normalised: gathered, output replicated
    assert out.placements == (R,) and out.shape == x.shape
    return True


def test_audit_09_norm_output_keeps_input_placements(ranks):
    ranks(2).run(_check_audit_09)


# ---- vocab-parallel cross-entropy -----------------------------------------------------------------


def _check_vocab_ce(world):
    mesh = init_device_mesh("cpu", (world,))
    logits = _randn(4, 6, VOCAB, seed=13) * 3
    target = _ids(4, 6, seed=14)
    target[3, 0] = 7
    for reduction in ("mean", "sum", "none"):
        for ignore in (-100, 7):
            target[1, 2] = ignore
            ref_l = logits.clone().requires_grad_()
            ref = F.cross_entropy(ref_l.flatten(0, 1), target.flatten(), ignore_index=ignore, reduction=reduction)
            ref = ref.view(4, 6) if reduction == "none" else ref
            g = _randn(*ref.shape, seed=15)
            (ref * g).sum().backward()
            dl = distribute_tensor(logits, mesh, [Shard(2)], src_data_rank=None).requires_grad_()
            local_before = dl.to_local().clone()
            loss = vocab_parallel_cross_entropy(dl, target, ignore_index=ignore, reduction=reduction)
            assert type(loss) is torch.Tensor
            torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
            (loss * g).sum().backward()
            assert dl.grad.placements == (Shard(2),)
            torch.testing.assert_close(dl.grad.full_tensor(), ref_l.grad, atol=1e-5, rtol=1e-5)
            assert torch.equal(dl.to_local(), local_before)
    # 5 classes over 4 ranks: an empty vocabulary chunk; replicated logits also work.
    small_t = target.remainder(5)
    for pl in (Shard(1), R):
        ref_l = logits[0, :, :5].clone().requires_grad_()
        ref = F.cross_entropy(ref_l, small_t[0])
        ref.backward()
        dl = distribute_tensor(logits[0, :, :5], mesh, [pl]).requires_grad_()
        loss = vocab_parallel_cross_entropy(dl, small_t[0])
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        loss.backward()
        torch.testing.assert_close(dl.grad.full_tensor(), ref_l.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(IndexError, match="out of bounds"):
        vocab_parallel_cross_entropy(distribute_tensor(logits, mesh, [Shard(2)]), target + 1)
    with pytest.raises(ValueError, match="Shard"):
        vocab_parallel_cross_entropy(distribute_tensor(logits, mesh, [Shard(0)]), target)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy(ranks, world):
    ranks(world).run(_check_vocab_ce, world)


# ---- end to end -----------------------------------------------------------------------------------


class _TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 24)
        self.act = nn.GELU()
        self.down = nn.Linear(24, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.head(self.norm(self.down(self.act(self.up(self.emb(ids))))))


def _check_tiny_lm():
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = _TinyLM()
    with torch.no_grad():
        ref.down.bias.normal_()
        ref.norm.weight.normal_()
    model = copy.deepcopy(ref)
    plan = {
        "emb": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(use_local_output=False),
    }
    parallelize_module(model, mesh, plan)
    assert model.emb.weight.placements == (Shard(0),)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ids, target = _ids(2, 5, seed=20 + step), _ids(2, 5, seed=30 + step)
        logits_ref = ref(ids)
        loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), target.flatten())
        logits = model(ids)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
        loss = vocab_parallel_cross_entropy(logits, target)
        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
        loss_ref.backward()
        loss.backward()
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            g = p.grad.full_tensor() if isinstance(p, DTensor) else p.grad
            if isinstance(p, DTensor):
                assert p.grad.placements == p.placements, name
            torch.testing.assert_close(g, p_ref.grad, atol=1e-5, rtol=1e-5, msg=name)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            torch.testing.assert_close(full.detach(), p_ref.detach(), atol=1e-5, rtol=1e-5)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_tiny_lm_matches_single_device(ranks, world):
    ranks(world).run(_check_tiny_lm)
