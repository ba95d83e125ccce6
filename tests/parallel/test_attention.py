"""Scaled-dot-product attention on DTensors (CPU flash kernel, forward and backward): batch-,
head- and sequence-sharded (ring / all-gathered-KV, causal without a mask: AUDIT 14), 1-d and 2-d
meshes, uneven and empty shards, compared with single-device SDPA (outputs and q/k/v gradients)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hpservice.dtensor._dispatch as dispatch_module
from hpservice.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from hpservice.dtensor._ops import decide

from ._compare import _randn

R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default


def _qkv(b, h, sq, d, skv=None, seed=0):
    skv = sq if skv is None else skv
    return _randn(b, h, sq, d, seed=seed), _randn(b, h, skv, d, seed=seed + 1), _randn(b, h, skv, d, seed=seed + 2)


def _check(mesh, fulls, placements, causal, *, out_placements=None, grad_placements=None, scale=None, atol=1e-5):
    """SDPA on DTensors == SDPA on full tensors: output and q/k/v gradients; inputs untouched."""
    ref_in = [f.clone().requires_grad_() for f in fulls]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, scale=scale)
    w = _randn(*ref.shape, seed=123)
    (ref * w).sum().backward()
    dts = [distribute_tensor(f, mesh, p, src_data_rank=None).requires_grad_() for f, p in zip(fulls, placements)]
    before = [d.to_local().clone() for d in dts]
    out = F.scaled_dot_product_attention(*dts, is_causal=causal, scale=scale)
    assert isinstance(out, DTensor)
    if out_placements is not None:
        assert out.placements == tuple(out_placements), (placements, out.placements)
    full = out.full_tensor()
    torch.testing.assert_close(full, ref, atol=atol, rtol=1e-5)
    (full * w).sum().backward()
    for i, (d, r, b) in enumerate(zip(dts, ref_in, before)):
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, atol=atol, rtol=1e-5, msg=f"grad {'qkv'[i]}")
        assert torch.equal(d.to_local(), b)
    if grad_placements is not None:
        assert tuple(d.grad.placements for d in dts) == tuple(tuple(p) for p in grad_placements)
    return out


# ---- batch / head sharding ------------------------------------------------------------------------


def _check_batch_head(world):
    mesh = init_device_mesh("cpu", (world,))
    fulls = _qkv(3, 5, 6, 8)  # batch 3 and heads 5: uneven, and empty shards over 4 ranks
    cross = _qkv(3, 5, 6, 8, skv=9, seed=10)  # cross-attention: key length != query length
    for causal in (False, True):
        _check(mesh, fulls, [[S0]] * 3, causal, out_placements=[S0], grad_placements=[[S0]] * 3)
        _check(mesh, fulls, [[S1]] * 3, causal, out_placements=[S1], grad_placements=[[S1]] * 3)
        _check(mesh, fulls, [[S0], [R], [R]], causal, out_placements=[S0])  # k, v sliced, no communication
        _check(mesh, fulls, [[R], [S1], [S1]], causal, out_placements=[S1])  # q sliced
        _check(mesh, fulls, [[S0], [S1], [S1]], causal)  # incompatible: redistributed to one layout
        _check(mesh, fulls, [[P], [S0], [S0]], causal, out_placements=[S0])  # Partial q reduced first
        _check(mesh, fulls, [[R], [R], [R]], causal, out_placements=[R])
        _check(mesh, cross, [[S1]] * 3, causal, out_placements=[S1])
    # The decision on specs alone: which operands move.
    q, k, v = (distribute_tensor(f, mesh, [p], src_data_rank=None)._spec for f, p in zip(fulls, (S0, R, R)))
    d = decide(_FWD, (q, k, v, 0.0, True), ())
    assert [t.placements for t in d.targets] == [(S0,), (S0,), (S0,)]
    assert [o.placements for o in d.out] == [(S0,), (S0,)] and d.out[1].shape == (3, 5, 6)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_sdpa_batch_and_head_sharding_equals_single_device(ranks, world):
    ranks(world).run(_check_batch_head, world)


# ---- sequence parallel ----------------------------------------------------------------------------


def _check_sequence(world):
    mesh = init_device_mesh("cpu", (world,))
    seq3 = [[S2]] * 3
    for s in (16, 13):  # even and uneven (13 over 4: 4, 4, 4, 1)
        fulls = _qkv(2, 3, s, 8, seed=s)
        for causal in (True, False):
            _check(mesh, fulls, seq3, causal, out_placements=[S2], grad_placements=seq3)
    fulls = _qkv(2, 3, 13, 8, seed=3)
    _check(mesh, fulls, seq3, True, scale=0.3, out_placements=[S2])
    # q sequence-sharded, k/v replicated: no communication; k/v gradients are partial sums.
    _check(mesh, fulls, [[S2], [R], [R]], True, out_placements=[S2], grad_placements=[[S2], [P], [P]])
    # q replicated, k/v sequence-sharded: k/v are gathered and the output follows q.
    _check(mesh, fulls, [[R], [S2], [S2]], True, out_placements=[R])
    # Sequence shorter than the world (empty shards) and cross-attention (key length 11 != 7).
    _check(mesh, _qkv(1, 2, 3, 8, seed=4), seq3, True, out_placements=[S2], grad_placements=seq3)
    for causal in (True, False):
        _check(mesh, _qkv(2, 2, 7, 8, skv=11, seed=5), seq3, causal, out_placements=[S2])
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_sdpa_sequence_parallel_equals_single_device(ranks, world):
    ranks(world).run(_check_sequence, world)


# ---- 2-d meshes -----------------------------------------------------------------------------------


def _check_2d():
    mesh = init_device_mesh("cpu", (2, 2))
    fulls = _qkv(3, 5, 13, 8, seed=7)
    for causal in (True, False):
        # batch on mesh dim 0, heads on mesh dim 1
        _check(mesh, fulls, [[S0, S1]] * 3, causal, out_placements=[S0, S1], grad_placements=[[S0, S1]] * 3)
        # batch on mesh dim 0, sequence parallel on mesh dim 1 (and the other way round, with heads)
        _check(mesh, fulls, [[S0, S2]] * 3, causal, out_placements=[S0, S2], grad_placements=[[S0, S2]] * 3)
        _check(mesh, fulls, [[S2, S1]] * 3, causal, out_placements=[S2, S1], grad_placements=[[S2, S1]] * 3)
        # sequence parallel over both mesh dims (nested, uneven: 13 -> 7, 6 -> 4, 3, 3, 3)
        _check(mesh, fulls, [[S2, S2]] * 3, causal, out_placements=[S2, S2], grad_placements=[[S2, S2]] * 3)
        # mixed: q batch x heads, k/v replicated and sequence-sharded
        _check(mesh, fulls, [[S0, S1], [R, S2], [R, S2]], causal)
    return True


def test_sdpa_2d_mesh_equals_single_device(ranks):
    ranks(4).run(_check_2d)


# ---- AUDIT 14: no S x S and no local_q x global_kv mask ------------------------------------------


class _Recorder(TorchDispatchMode):
    """Records the shape of every plain tensor an op produces while active."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                self.log.append((str(func), tuple(t.shape), t.dtype))
        if func is _FWD:  # trailing default arguments are not passed: is_causal=False may be missing
            causal = bool(args[4] if len(args) > 4 else (kwargs or {}).get("is_causal", False))
            self.log.append(("kernel", tuple(args[0].shape), tuple(args[1].shape), causal))
        return out


def _recording(log):
    """Run every DTensor op's local computation (rules, kernels, collectives) under a _Recorder."""
    original = dispatch_module.dispatch

    def recorded(func, args, kwargs):
        with _Recorder(log):
            return original(func, args, kwargs)

    return original, recorded


def _violations(log, limit):
    """Produced tensors with two dims whose product reaches ``limit`` (a [local_q, global_kv] or
    [S, S] score / mask would: local_q * global_kv >= S * S / world)."""
    bad = []
    for entry in log:
        if entry[0] == "kernel":
            continue
        shape = entry[1]
        if any(shape[i] * shape[j] >= limit for i in range(len(shape)) for j in range(i + 1, len(shape))):
            bad.append(entry)
    return bad


def _check_audit_14():
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    b, h, s, d = 2, 2, 64, 8  # every legitimate tensor has max pairwise dims product s * d = 512
    limit = s * s // world  # 1024 = local_q (16) x global_kv (64)
    assert s * d < limit
    fulls = _qkv(b, h, s, d, seed=21)
    ref_in = [f.clone().requires_grad_() for f in fulls]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    g = _randn(b, h, s, d, seed=22)
    ref.backward(g)
    dts = [distribute_tensor(f, mesh, [S2], src_data_rank=None).requires_grad_() for f in fulls]
    gd = distribute_tensor(g, mesh, [S2], src_data_rank=None)
    log = []
    original, recorded = _recording(log)
    dispatch_module.dispatch = recorded
    try:
        out = F.scaled_dot_product_attention(*dts, is_causal=True)
        out.backward(gd)
    finally:
        dispatch_module.dispatch = original
    assert len(log) > 10
    assert not any(dt == torch.bool for *_, dt in log if _ != "kernel"), "a boolean (mask) tensor was produced"
    bad = _violations(log, limit)
    assert not bad, f"tensors of local_q x global_kv size or larger were produced: {bad[:5]}"
    kernels = [e for e in log if e[0] == "kernel"]
    rank = dist.get_rank()
    n = s // world
    # This rank's queries against the keys before them (unmasked), then the causal diagonal block.
    expected = [((b, h, n, d), (b, h, rank * n, d), False)] if rank else []
    expected.append(((b, h, n, d), (b, h, n, d), True))
    assert [k[1:] for k in kernels] == expected, kernels
    torch.testing.assert_close(out.full_tensor(), ref, atol=1e-5, rtol=1e-5)
    for x, r in zip(dts, ref_in):
        assert x.grad.placements == (S2,)
        torch.testing.assert_close(x.grad.full_tensor(), r.grad, atol=1e-5, rtol=1e-5)
    # The criterion is not vacuous: a masked local_q x global_kv attention trips it.
    naive = []
    with _Recorder(naive):
        q = dts[0].to_local().detach()
        k, v = fulls[1], fulls[2]
        mask = torch.ones(n, s, dtype=torch.bool).tril(rank * n)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert _violations(naive, limit)
    return True


def test_audit_14_sequence_parallel_causal_attention_allocates_no_s_by_s_mask(ranks):
    ranks(4).run(_check_audit_14)


# ---- clear errors ---------------------------------------------------------------------------------


def _check_errors():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (distribute_tensor(f, mesh, [S0], src_data_rank=None) for f in _qkv(2, 2, 4, 8))
    mask = torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match=r"flash_attention_for_cpu.*\(S\(0\)\).*attn_mask"):
        _FWD(q, k, v, attn_mask=mask)
    with pytest.raises(NotImplementedError, match=r"dropout_p=0\.5 is not supported"):
        _FWD(q, k, v, 0.5, False)
    with pytest.raises(NotImplementedError, match=r"_scaled_dot_product_efficient_attention.*no sharding rule"):
        aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True)
    with pytest.raises(NotImplementedError, match=r"_scaled_dot_product_flash_attention\.default.*no sharding rule"):
        aten._scaled_dot_product_flash_attention.default(q, k, v)
    k0, v0 = (distribute_tensor(f, mesh, [S0], src_data_rank=None) for f in _qkv(2, 2, 4, 8, skv=0)[1:])
    with pytest.raises(NotImplementedError, match="empty key sequence"):
        _FWD(q, k0, v0)
    return True


def test_sdpa_unsupported_cases_raise_clear_errors(ranks):
    ranks(2).run(_check_errors)
