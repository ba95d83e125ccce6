"""More operator rules: max/min reductions (Partial(max/min)), cat/stack/split/slice/select,
dropout through the RNG tracker, batch-sharded cross-entropy (nll_loss), and norms keeping the
input's placements; each output and gradient compared with the single-device op, uneven
``torch.chunk`` shards (empty pieces included) over 2 and 4 ranks."""

import pytest
import torch

from hpservice.dtensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

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
