"""``hpservice.parallel.pipelining`` against ``torch.distributed.pipelining``, same code, same data.

Each schedule torch ships under the names we expose is built from ``PipelineStage``s of the same
blocks in both engines on 2 gloo ranks and stepped once (``step(*args, target=, losses=)``):
the returned outputs (last stage; None elsewhere), the per-micro-batch losses, and every
parameter's gradient (scaled by the micro-batch count, or not, ``scale_grads``) must equal
torch's; so must ``eval``'s outputs and losses, and the refusal of too few micro-batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

DIM, BATCH = 8, 8


def _blocks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(n)]


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _step(engine: str, schedule: str, per_rank: int, m: int, mode: str, scale_grads: bool):
    """One step (or eval) on this rank: (outputs, losses, {stage.param: grad}) or the error."""
    if engine == "torch":
        import torch.distributed.pipelining as lib
    else:
        import hpservice.parallel.pipelining as lib
    rank, world = dist.get_rank(), dist.get_world_size()
    n = world * per_rank
    blocks = _blocks(n)
    mine = [s for s in range(n) if s % world == rank]
    stages = [lib.PipelineStage(blocks[s], s, n, torch.device("cpu")) for s in mine]
    multi = per_rank > 1 or "Interleaved" in schedule
    try:
        runner = getattr(lib, schedule)(stages if multi else stages[0], m, loss_fn=_mse, scale_grads=scale_grads)
    except ValueError as e:
        return ("refused", str(e))
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    args = (x,) if 0 in mine else ()
    losses: list = []
    out = (runner.eval if mode == "eval" else runner.step)(*args, target=y, losses=losses)
    grads = {f"{s}.{k}": None if p.grad is None else p.grad.clone() for s in mine for k, p in blocks[s].named_parameters()}
    return ("ran", None if out is None else out.detach(), [loss.detach() for loss in losses], grads)


def _both(schedule, per_rank, m, mode, scale_grads):
    return [_step(engine, schedule, per_rank, m, mode, scale_grads) for engine in ("torch", "ours")]


@pytest.mark.parametrize(
    ("schedule", "per_rank", "m"),
    [
        ("ScheduleGPipe", 1, 4),
        ("Schedule1F1B", 1, 4),
        ("Schedule1F1B", 1, 2),
        ("ScheduleInterleaved1F1B", 2, 4),
        ("ScheduleInterleavedZeroBubble", 1, 4),
        ("ScheduleInterleavedZeroBubble", 2, 4),
        ("ScheduleInterleavedZeroBubble", 3, 4),
    ],
)
@pytest.mark.parametrize("scale_grads", [True, False])
def test_a_step_returns_torchs_outputs_losses_and_gradients(ranks, schedule, per_rank, m, scale_grads):
    for theirs, ours in ranks(2).run(_both, schedule, per_rank, m, "step", scale_grads):
        assert theirs[0] == ours[0] == "ran", (theirs, ours)
        _, out_t, losses_t, grads_t = theirs
        _, out_o, losses_o, grads_o = ours
        assert (out_t is None) == (out_o is None)  # the last stage's rank returns the outputs, others None
        if out_t is not None:
            torch.testing.assert_close(out_o, out_t, rtol=1e-6, atol=1e-7)
        assert len(losses_o) == len(losses_t)
        for a, b in zip(losses_o, losses_t, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert grads_o.keys() == grads_t.keys()
        for name, g in grads_t.items():
            torch.testing.assert_close(grads_o[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(("schedule", "per_rank"), [("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2)])
def test_eval_runs_forwards_only_with_torchs_outputs_and_losses(ranks, schedule, per_rank):
    for theirs, ours in ranks(2).run(_both, schedule, per_rank, 4, "eval", True):
        _, out_t, losses_t, grads_t = theirs
        _, out_o, losses_o, grads_o = ours
        assert (out_t is None) == (out_o is None)
        if out_t is not None:
            torch.testing.assert_close(out_o, out_t)
        torch.testing.assert_close(losses_o, losses_t)
        assert all(g is None for g in grads_o.values()) and all(g is None for g in grads_t.values())


def test_fewer_micro_batches_than_stages_are_refused_as_torch_refuses_them(ranks):
    for theirs, ours in ranks(2).run(_both, "Schedule1F1B", 1, 1, "step", True):
        assert theirs[0] == ours[0] == "refused", (theirs, ours)
        assert "must be >= pp (2)" in ours[1]


def _uneven(m: int):
    """Ours on a batch of 8 in ``m`` micro-batches (torch.tensor_split's uneven slices), and the
    one-process computation of the same mean of micro-batch losses."""
    ours = _step("ours", "Schedule1F1B", 1, m, "step", True)
    blocks = _blocks(2)
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    losses = []
    for xs, ys in zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True):
        loss = _mse(blocks[1](blocks[0](xs)), ys)
        (loss / m).backward()
        losses.append(loss.detach())
    rank = dist.get_rank()
    return ours, losses, {f"{rank}.{k}": p.grad for k, p in blocks[rank].named_parameters()}


def test_uneven_micro_batches_equal_one_process(ranks):
    """torch's stages fix each micro-batch's shape and fail on 8 rows in 3 micro-batches (a shape
    error on the last stage, while the first waits for a receive); ours sends shapes with each
    micro-batch and computes it (docs/compat.md)."""
    results = ranks(2).run(_uneven, 3)
    (_, _, _, grads0), _, want0 = results[0]
    (_, _, losses1, grads1), want_losses, want1 = results[1]
    torch.testing.assert_close(losses1, want_losses)
    for got, want in ((grads0, want0), (grads1, want1)):
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, msg=name)
