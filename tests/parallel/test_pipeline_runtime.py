"""Pipeline schedules run on gloo ranks: one step of every schedule on pp 2 and 4 (interleaved with
2 stages per rank) gives the micro-batch losses and the parameter gradients of one process
computing the mean loss of the same micro-batches."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hpservice.parallel.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

LAYERS, WIDTH, BATCH = 8, 16, 8
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _reference(m):
    model = _model()
    x, y = _batch()
    losses = [F.mse_loss(model(xm), ym) for xm, ym in zip(x.tensor_split(m), y.tensor_split(m), strict=True)]
    torch.stack(losses).mean().backward()
    return [loss.item() for loss in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipelined(schedule, m, virtual):
    pp, rank = dist.get_world_size(), dist.get_rank()
    n_stages = pp * virtual
    per_stage = LAYERS // n_stages
    model = _model()
    stages = []
    for stage_index in range(rank, n_stages, pp):  # loop placement: stage s on rank s % pp
        first = stage_index * per_stage
        part = nn.Sequential(*model[first : first + per_stage])
        stages.append((first, PipelineStage(part, stage_index, n_stages, "cpu")))
    runner = SCHEDULES[schedule]([s for _, s in stages], m, loss_fn=F.mse_loss)
    x, y = _batch()
    losses = []
    runner.step(x, target=y, losses=losses)
    grads = {}
    for first, stage in stages:
        for name, p in stage.submod.named_parameters():
            block, rest = name.split(".", 1)
            grads[f"{first + int(block)}.{rest}"] = p.grad.clone()
    return [loss.item() for loss in losses], grads


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "virtual"),
    [
        ("gpipe", 2, 4, 1),
        ("1f1b", 2, 4, 1),
        ("zero_bubble", 2, 4, 1),
        ("interleaved_1f1b", 2, 4, 2),
        ("gpipe", 4, 4, 1),
        ("1f1b", 4, 8, 1),
        ("zero_bubble", 4, 8, 1),
        ("interleaved_1f1b", 4, 4, 2),
        ("interleaved_1f1b", 1, 4, 2),  # consecutive stages on one rank: handed over without a transfer
    ],
)
def test_a_pipelined_step_gives_one_process_losses_and_gradients(ranks, schedule, pp, m, virtual):
    want_losses, want_grads = _reference(m)
    results = ranks(pp).run(_pipelined, schedule, m, virtual)
    grads = {}
    for _, rank_grads in results:
        grads.update(rank_grads)
    last_rank = (pp * virtual - 1) % pp
    assert results[last_rank][0] == pytest.approx(want_losses, abs=1e-6)
    assert all(not losses for r, (losses, _) in enumerate(results) if r != last_rank)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert (grads[name] - g).abs().max().item() < 1e-6, name


def _torchs(schedule, m, virtual):
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B as T1F1B
    from torch.distributed.pipelining import ScheduleGPipe as TGPipe
    from torch.distributed.pipelining import ScheduleInterleaved1F1B as TInterleaved

    pp, rank = dist.get_world_size(), dist.get_rank()
    n_stages = pp * virtual
    per_stage = LAYERS // n_stages
    model = _model()
    parts, stages = [], []
    for stage_index in range(rank, n_stages, pp):
        part = nn.Sequential(*model[stage_index * per_stage : (stage_index + 1) * per_stage])
        parts.append((stage_index * per_stage, part))
        stages.append(TorchStage(part, stage_index, n_stages, torch.device("cpu")))
    runner_cls = {"gpipe": TGPipe, "1f1b": T1F1B, "interleaved_1f1b": TInterleaved}[schedule]
    runner = runner_cls(stages if virtual > 1 else stages[0], m, loss_fn=F.mse_loss)
    x, y = _batch()
    losses = []
    holds_first, holds_last = 0 in range(rank, n_stages, pp), (n_stages - 1) % pp == rank
    runner.step(*((x,) if holds_first else ()), target=y if holds_last else None, losses=losses)
    grads = {}
    for first, part in parts:
        for name, p in part.named_parameters():
            block, rest = name.split(".", 1)
            grads[f"{first + int(block)}.{rest}"] = p.grad.clone()
    return [loss.item() for loss in losses], grads


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_ours_equals_torchs_pipelining_on_the_same_stages_and_micro_batches(ranks, schedule, virtual):
    ours = ranks(2).run(_pipelined, schedule, 4, virtual)
    theirs = ranks(2).run(_torchs, schedule, 4, virtual)
    assert ours[1][0] == pytest.approx(theirs[1][0], abs=1e-6)
    for (_, mine), (_, torch_grads) in zip(ours, theirs, strict=True):
        assert mine.keys() == torch_grads.keys()
        for name, g in torch_grads.items():
            assert (mine[name] - g).abs().max().item() < 1e-6, name
