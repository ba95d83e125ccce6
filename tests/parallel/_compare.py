"""Helpers shared by the tensor-parallel tests: compare an op on DTensors with the same op on full tensors."""

import torch

from hpservice.dtensor import DTensor, distribute_tensor


def _randn(*shape, seed=0):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _compare(fn, fulls, placements, mesh, atol=1e-5):
    """fn on DTensors == fn on full tensors, outputs and input gradients; inputs never mutated."""
    ref_in = [f.clone().requires_grad_(f.is_floating_point()) for f in fulls]
    ref = fn(*ref_in)
    w = _randn(*ref.shape, seed=123)
    (ref * w).sum().backward()
    dts = [
        distribute_tensor(f, mesh, p, src_data_rank=None).requires_grad_(f.is_floating_point())
        for f, p in zip(fulls, placements)
    ]
    before = [(d.placements, d.to_local().clone()) for d in dts]
    out = fn(*dts)
    assert isinstance(out, DTensor)
    full = out.full_tensor()
    assert full.shape == ref.shape
    torch.testing.assert_close(full, ref, atol=atol, rtol=1e-5)
    (full * w).sum().backward()
    for d, r, (pl, local) in zip(dts, ref_in, before):
        if r.requires_grad:
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, atol=atol, rtol=1e-5)
        assert d.placements == pl and torch.equal(d.to_local(), local)  # never mutated
    return out
