"""More operator rules: max/min reductions (Partial(max/min)), cat/stack/split/slice/select,
dropout through the RNG tracker, batch-sharded cross-entropy (nll_loss), and norms keeping the
input's placements; each output and gradient compared with the single-device op, uneven
``torch.chunk`` shards (empty pieces included) over 2 and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

from hpservice.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh, random
from hpservice.dtensor._dispatch import dispatch
from hpservice.dtensor._ops import decide

from ._compare import _compare, _randn

R, P = Replicate(), Partial()
PMAX, PMIN = Partial("max"), Partial("min")


# ---- max / min reductions -------------------------------------------------------------------------


def _check_reductions(world):
    mesh = init_device_mesh("cpu", (world,))
    x = _randn(5, 7, 3, seed=1)  # 3 over 4 ranks leaves an empty piece
    cases = [
        (lambda t: t.amax(1), {Shard(1): PMAX, Shard(0): Shard(0), Shard(2): Shard(1)}),
        (lambda t: t.amax((0, 2), keepdim=True), {Shard(0): PMAX, Shard(2): PMAX, Shard(1): Shard(1)}),
        (lambda t: t.amin(-1), {Shard(2): PMIN, Shard(1): Shard(1)}),
        (lambda t: t.max(), {Shard(0): PMAX, Shard(2): PMAX}),
        (lambda t: t.min(), {Shard(1): PMIN}),
        (lambda t: t.max(1)[0], {Shard(1): R, Shard(0): Shard(0), Shard(2): Shard(1)}),
        (lambda t: t.min(2, keepdim=True)[0], {Shard(2): R, Shard(0): Shard(0)}),
        (lambda t: torch.max(t, dim=0).values, {Shard(0): R, Shard(2): Shard(1)}),
    ]
    for n, (fn, expect) in enumerate(cases):
        for pl in (Shard(0), Shard(1), Shard(2), R, P):
            if pl == P and n in (3, 4):
                # Whole-tensor max/min of a Partial(sum): the forward reduces it first, but autograd
                # runs the backward on the saved Partial input (isnan of it raises: not linear).
                out = fn(distribute_tensor(x, mesh, [pl]))
                assert out.placements == (R,) and torch.equal(out.full_tensor(), fn(x))
                continue
            out = _compare(fn, [x], [[pl]], mesh)
            if pl in expect:
                assert out.placements == (expect[pl],), (pl, out.placements)
            elif pl in (R, P):
                assert out.placements == (R,)
    # Indices: the reduced dim is gathered first, other shards stay.
    for pl in (Shard(0), Shard(1), Shard(2), R):
        d = distribute_tensor(x, mesh, [pl])
        for fn in (
            lambda t: t.argmax(1),
            lambda t: t.argmin(-1, keepdim=True),
            lambda t: t.argmax(),
            lambda t: t.max(1)[1],
            lambda t: t.min(0, keepdim=True).indices,
        ):
            got = fn(d)
            assert torch.equal(got.full_tensor(), fn(x)), pl
        assert d.argmax(1).placements == ((Shard(1) if pl == Shard(2) else pl) if pl != Shard(1) else R,)
    # A Partial(max) feeds later ops: pointwise ops reduce it first; softmax-style shifting works.
    _compare(lambda t: t - t.amax(-1, keepdim=True), [x], [[Shard(2)]], mesh)
    _compare(lambda t: torch.exp(t.amax(1)) * 2, [x], [[Shard(1)]], mesh)
    _compare(lambda t: t.amax(1).amax(0), [x], [[Shard(1)]], mesh)  # max of a Partial(max) stays Partial
    assert distribute_tensor(x, mesh, [Shard(1)]).amax(1).amax(0).placements == (PMAX,)
    ints = torch.randint(-50, 50, (5, 7), generator=torch.Generator().manual_seed(2))
    d = distribute_tensor(ints, mesh, [Shard(1)])
    assert torch.equal(d.amax(1).full_tensor(), ints.amax(1)) and torch.equal(d.min().full_tensor(), ints.min())
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_max_min_reductions(ranks, world):
    ranks(world).run(_check_reductions, world)


# ---- cat / stack / split / slice ------------------------------------------------------------------


def _check_cat_split(world):
    mesh = init_device_mesh("cpu", (world,))
    a, b, c = _randn(5, 7, seed=3), _randn(5, 3, seed=4), _randn(2, 7, seed=5)
    cat1 = lambda u, v: torch.cat([u, v], 1)  # noqa: E731
    cat0 = lambda u, v: torch.cat([u, v], 0)  # noqa: E731
    for fn, fulls, pls, expect in [
        (cat1, [a, b], [Shard(0), Shard(0)], Shard(0)),
        (cat1, [a, b], [Shard(1), Shard(1)], R),  # along the sharded dim: gathered
        (cat1, [a, b], [R, Shard(0)], Shard(0)),  # different placements: a common target
        (cat0, [a, c], [Shard(1), R], Shard(1)),
        (cat0, [a, c], [P, P], P),  # linear: the pending sum stays
        (cat0, [a, c], [P, R], R),
        (cat0, [a, c], [Shard(0), Shard(1)], Shard(1)),
    ]:
        out = _compare(fn, fulls, [[p] for p in pls], mesh)
        assert out.placements == (expect,), (pls, out.placements)
    out = _compare(lambda u, v, w: torch.cat([u, v, w], dim=-1), [a, b, a], [[Shard(0)], [R], [Shard(0)]], mesh)
    assert out.placements == (Shard(0),)
    for pls, expect in [([Shard(0), Shard(0)], Shard(0)), ([Shard(1), R], Shard(2)), ([R, R], R), ([P, P], P)]:
        out = _compare(lambda u, v: torch.stack([u, v], 1), [a, a * 2], [[p] for p in pls], mesh)
        assert out.placements == (expect,)
    # split / chunk / unbind, using all or only some outputs (autograd fills the others with zeros).
    for pl in (Shard(0), Shard(1), R, P):
        _compare(lambda t: t.split(3, 1)[1], [a], [[pl]], mesh)
        _compare(lambda t: torch.cat([s * (i + 1) for i, s in enumerate(t.split(3, 1))], 1), [a], [[pl]], mesh)
        _compare(lambda t: t.split([1, 4, 2], 1)[2], [a], [[pl]], mesh)
        _compare(lambda t: t.chunk(3, 0)[0] * t.chunk(3, 0)[1], [a], [[pl]], mesh)
        _compare(lambda t: t.unbind(1)[3], [a], [[pl]], mesh)
        _compare(lambda t: torch.stack(t.unbind(0)[::2]), [a], [[pl]], mesh)
    out = _compare(lambda t: t.split(2, 1)[2], [a], [[Shard(0)]], mesh)
    assert out.placements == (Shard(0),)
    out = _compare(lambda t: t.unbind(1)[0], [a], [[Shard(0)]], mesh)
    assert out.placements == (Shard(0),)
    # slice / narrow / select: a sliced sharded dim is gathered, other dims keep their shards.
    x = _randn(5, 7, 3, seed=6)
    for fn, expect in [
        (lambda t: t[:, 1:5], {Shard(0): Shard(0), Shard(1): R, Shard(2): Shard(2)}),
        (lambda t: t[1:4:2], {Shard(0): R, Shard(1): Shard(1)}),
        (lambda t: t.narrow(1, 2, 4), {Shard(1): R, Shard(0): Shard(0)}),
        (lambda t: t[:, -1], {Shard(0): Shard(0), Shard(2): Shard(1), Shard(1): R}),
        (lambda t: t[..., 0].select(0, 3), {Shard(1): Shard(0)}),
        (lambda t: t[:5], {Shard(0): Shard(0)}),  # the whole range: the shard stays
    ]:
        for pl in (Shard(0), Shard(1), Shard(2), R, P):
            out = _compare(fn, [x], [[pl]], mesh)
            if pl in expect:
                assert out.placements == (expect[pl],), (pl, out.placements)
    # Plain tensors in a DTensor list are refused (unless autograd's all-zero fillers).
    d = distribute_tensor(a, mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="tensor list"):
        torch.cat([d, torch.ones(5, 7)], 1)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_cat_stack_split_slice(ranks, world):
    ranks(world).run(_check_cat_split, world)


# ---- dropout --------------------------------------------------------------------------------------


def _dropout_run(x, mesh, placements, p, g, op):
    random.manual_seed(5)
    d = distribute_tensor(x, mesh, placements, src_data_rank=None).requires_grad_()
    out = op(d, p)
    assert isinstance(out, DTensor) and out.placements == tuple(placements)
    full = out.full_tensor()
    (full * g).sum().backward()
    return full, d.grad.full_tensor(), torch.get_rng_state()


def _check_dropout(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    n = len(mesh_shape)
    ops = {
        "F.dropout": lambda t, p: F.dropout(t, p, training=True),  # CPU: empty_like + bernoulli_ + mul
        "native_dropout": lambda t, p: torch.native_dropout(t, p, True)[0],  # the fused (CUDA) path
    }
    for shape in [(7, 9, 5), (3, 23000)]:  # uneven; the second spans two RNG blocks
        x = _randn(*shape, seed=7) + 3  # no zeros: a zero in the output is a dropped element
        g = _randn(*shape, seed=8)
        for name, op in ops.items():
            for p in (0.3, 0.5):
                # The single-device computation: every rank holds the whole tensor (Replicate).
                ref, ref_grad, state = _dropout_run(x, mesh, [R] * n, p, g, op)
                keep = ref != 0
                assert abs((1 - keep.float().mean()) - p) < 0.2, (name, p)
                torch.testing.assert_close(ref, x * keep / (1 - p))
                torch.testing.assert_close(ref_grad, g * keep / (1 - p))
                layouts = [[Shard(0)] * n, [Shard(1)] + [R] * (n - 1), [R] * (n - 1) + [Shard(len(shape) - 1)]]
                for placements in layouts:
                    out, grad, st = _dropout_run(x, mesh, placements, p, g, op)
                    assert torch.equal(out, ref), (name, placements)
                    assert torch.equal(grad, ref_grad), (name, placements)
                    assert torch.equal(st, state)  # the generator moves alike for every layout
    d = distribute_tensor(_randn(5, 3), mesh, [Shard(0)] * n)
    assert torch.equal(F.dropout(d, 0.5, training=False).to_local(), d.to_local())
    return True


@pytest.mark.parametrize("world,mesh_shape", [(2, (2,)), (4, (4,)), (4, (2, 2))])
def test_dropout_equals_single_device_for_any_sharding(ranks, world, mesh_shape):
    ranks(world).run(_check_dropout, mesh_shape)


# ---- cross-entropy on batch / sequence shards -----------------------------------------------------


def _check_cross_entropy(world):
    mesh = init_device_mesh("cpu", (world,))
    B, S, V = 5, 3, 11
    logits = _randn(B, S, V, seed=9) * 2
    target = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(10))
    weight = _randn(V, seed=11).abs() + 0.5
    for ignore in (-100, 4):
        t = target.clone()
        t[0, 2] = ignore
        t[4, :] = ignore  # a whole batch row ignored: one rank's piece may have no weight at all
        for reduction in ("mean", "sum", "none"):
            kw = dict(ignore_index=ignore, reduction=reduction)

            def ce3(lg, tg, kw=kw):  # [B, S, V] -> [B, V, S]: nll_loss2d
                return F.cross_entropy(lg.transpose(1, 2), tg, **kw)

            def ce2(lg, tg, kw=kw):  # [N, V]: nll_loss
                return F.cross_entropy(lg, tg, **kw)

            def ce_w(lg, tg, kw=kw):
                w = distribute_tensor(weight, mesh, [R]) if isinstance(lg, DTensor) else weight
                return F.cross_entropy(lg, tg, weight=w, **kw)

            for pl in (Shard(0), Shard(1), R):
                out = _compare(ce3, [logits, t], [[pl], [pl]], mesh)
                if reduction == "none":
                    assert out.placements == (pl,)
                else:
                    assert out.placements == ((R,) if pl == R else (P,)), (pl, reduction, out.placements)
            flat, tf = logits.flatten(0, 1), t.flatten()
            for pls in ([[Shard(0)], [Shard(0)]], [[Shard(0)], [R]], [[R], [Shard(0)]]):
                out = _compare(ce2, [flat, tf], pls, mesh)
                assert out.placements == ((Shard(0),) if reduction == "none" else (P,))
                _compare(ce_w, [flat, tf], pls, mesh)
    # total_weight: the global sum of the target weights (mean: Replicate; sum: Partial(sum)).
    lp = F.log_softmax(logits.flatten(0, 1), -1)
    tf = t.flatten()
    for reduction in (1, 2):
        ref = torch.ops.aten.nll_loss_forward(lp, tf, weight, reduction, 4)
        got = torch.ops.aten.nll_loss_forward(
            distribute_tensor(lp, mesh, [Shard(0)]),
            distribute_tensor(tf, mesh, [Shard(0)]),
            distribute_tensor(weight, mesh, [R]),
            reduction,
            4,
        )
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.full_tensor(), b)
    # Sharded on the class dim: a clear error naming vocab_parallel_cross_entropy.
    with pytest.raises(NotImplementedError, match="vocab_parallel_cross_entropy"):
        F.nll_loss(distribute_tensor(lp, mesh, [Shard(1)]), distribute_tensor(tf, mesh, [R]))
    # A plain target is refused before any rule, as torch refuses mixed tensors (RuntimeError).
    with pytest.raises(RuntimeError, match="mixes a DTensor with a torch"):
        F.cross_entropy(distribute_tensor(logits.flatten(0, 1), mesh, [Shard(0)]), tf)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_batch_sharded_cross_entropy(ranks, world):
    ranks(world).run(_check_cross_entropy, world)


# ---- norms keep the input's batch / sequence shards (AUDIT 9) -------------------------------------


def _check_audit_09_norms(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    n = len(mesh_shape)
    x, w, b = _randn(5, 7, 12, seed=12), _randn(12, seed=13), _randn(12, seed=14)
    norms = {
        "rms_norm": (lambda t, ww: F.rms_norm(t, (12,), ww, 1e-6), [x, w]),
        "rms_norm_default_eps": (lambda t, ww: F.rms_norm(t, (12,), ww), [x, w]),
        "layer_norm": (lambda t, ww, bb: F.layer_norm(t, (12,), ww, bb), [x, w, b]),
    }
    layouts = [[Shard(0)] + [R] * (n - 1), [Shard(1)] + [R] * (n - 1)]
    if n == 2:
        layouts += [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [Shard(1), Shard(0)]]
    for name, (fn, fulls) in norms.items():
        for placements in layouts:
            # _compare checks the output and the gradients of x, the weight (and the bias).
            out = _compare(fn, fulls, [placements] + [[R] * n] * (len(fulls) - 1), mesh, atol=1e-5)
            assert out.placements == tuple(placements), (name, placements, out.placements)
            assert out.to_local().shape == distribute_tensor(x, mesh, placements).to_local().shape
    # CUDA builds run F.rms_norm as aten._fused_rms_norm (+ backward), which then reaches the
    # dispatcher; on CPU it decomposes, so call the rule through dispatch directly here (the
    # backward kernel exists only on CUDA: its decision is checked).
    aten = torch.ops.aten
    ref_out, ref_rstd = aten._fused_rms_norm.default(x, [12], w, 1e-6)
    wd = distribute_tensor(w, mesh, [R] * n)
    for placements in [*layouts, [Shard(2)] + [R] * (n - 1)]:
        d = distribute_tensor(x, mesh, placements)
        out, rstd = dispatch(aten._fused_rms_norm.default, (d, [12], wd, 1e-6), {})
        keep = tuple(R if p == Shard(2) else p for p in placements)
        assert out.placements == rstd.placements == keep and rstd.shape == (5, 7, 1)
        torch.testing.assert_close(out.full_tensor(), ref_out)
        torch.testing.assert_close(rstd.full_tensor(), ref_rstd)
        frozen = (out._spec, d._spec, (12,), rstd._spec, wd._spec, (True, True))
        grad_in, grad_w = decide(aten._fused_rms_norm_backward.default, frozen, ()).out
        assert grad_in.placements == keep
        assert grad_w.placements == tuple(P if p.is_shard() else R for p in keep)
    return True


@pytest.mark.parametrize("world,mesh_shape", [(2, (2,)), (4, (4,)), (4, (2, 2))])
def test_audit_09_rms_norm_and_layer_norm_keep_batch_and_sequence_shards(ranks, world, mesh_shape):
    ranks(world).run(_check_audit_09_norms, mesh_shape)
