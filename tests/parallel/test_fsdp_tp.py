"""fully_shard composed with tensor parallelism on 2-D and 3-D meshes (dp_shard x tp,
dp_replicate x dp_shard x tp): parameters sharded by tp are sharded again over the data-parallel
dims of the same mesh; training equals a single device, and checkpoints reshard across layouts."""

import copy

import pytest
import torch
from torch import nn

from hpservice.dtensor import DTensor, Replicate, Shard, init_device_mesh
from hpservice.fsdp import fully_shard
from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hpservice.train import clip_grad_norm_

from .._jobs import tiny_llama_job
from .._jobs import train as _run


def _mlp(bias=False):
    torch.manual_seed(0)
    # hidden 37: uneven over tp 2 (19 + 18), and each tp piece uneven again over dp 2.
    return nn.Sequential(nn.Linear(16, 37, bias=bias), nn.GELU(), nn.Linear(37, 16), nn.LayerNorm(16))


def _fsdp_tp_mlp_vs_single(shape, names, bias=False):
    ref = _mlp(bias)
    model = copy.deepcopy(ref)
    world = init_device_mesh("cpu", shape, mesh_dim_names=names)
    parallelize_module(model, world["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp_names = tuple(n for n in names if n != "tp")
    fully_shard(model, mesh=world[dp_names])
    dp_mesh = world[dp_names]
    hsdp = len(dp_names) == 2
    layouts = {n: p.placements for n, p in model.named_parameters()}
    dp = (Replicate(), Shard) if hsdp else (Shard,)

    def expect(dim, *tp):
        return (*dp[:-1], Shard(dim), *tp)

    expected = {
        "0.weight": expect(1, Shard(0)),  # colwise: tp cuts rows, FSDP cuts columns
        "2.weight": expect(0, Shard(1)),  # rowwise: tp cuts columns, FSDP cuts rows
        "2.bias": expect(0, Replicate()),
        "3.weight": expect(0),  # not touched by tp: on the data-parallel mesh only
        "3.bias": expect(0),
    }
    if bias:  # the colwise bias: tp cuts it, FSDP cuts each piece again, on the mesh (tp, dp...)
        expected["0.bias"] = (Shard(0), *expect(0))
        assert model[0].bias.device_mesh.mesh_dim_names == ("tp", *dp_names)
    assert layouts == expected
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    dp_rank = dp_mesh.get_local_rank(dp_mesh.ndim - 1) + (dp_mesh.get_local_rank(0) * dp_mesh.size(1) if hsdp else 0)
    dp_size = dp_mesh.size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model(x.chunk(dp_size)[dp_rank]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            torch.testing.assert_close(
                p.grad.full_tensor(), r.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
        norm = clip_grad_norm_(model.parameters(), 0.05)  # small: clipping is active
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, atol=1e-6, rtol=1e-5)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), r.detach(), atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_fully_shard_over_tp_2d_mesh_equals_single_device(ranks):
    ranks(4).run(_fsdp_tp_mlp_vs_single, (2, 2), ("dp_shard", "tp"))


def test_hsdp_over_tp_3d_mesh_equals_single_device(ranks):
    ranks(4).run(_fsdp_tp_mlp_vs_single, (2, 1, 2), ("dp_replicate", "dp_shard", "tp"))


@pytest.mark.parametrize("shape,names", [((2, 2), ("dp_shard", "tp")), ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"))])
def test_fully_shard_of_a_colwise_bias_equals_single_device(ranks, shape, names):
    ranks(4).run(_fsdp_tp_mlp_vs_single, shape, names, True)


def _shard_placement_on_a_tp_dim(ckpt_dir):
    """shard_placement_fn may pick the dim tp shards: FSDP then cuts each tp piece again on it; a
    checkpoint of it (DCP, chunk offsets from the spec) reads back as the full weight."""
    import torch.distributed.checkpoint as dcp

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    ref = nn.Linear(4, 7, bias=False)
    model = parallelize_module(copy.deepcopy(ref), world["tp"], ColwiseParallel())
    fully_shard(model, mesh=world["dp_shard"], shard_placement_fn=lambda p: Shard(0))
    assert model.weight.placements == (Shard(0), Shard(0)) and model.weight.device_mesh.mesh_dim_names == (
        "tp",
        "dp_shard",
    )
    torch.testing.assert_close(model.weight.full_tensor(), ref.weight.detach())
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad)  # both dp ranks saw x: mean = ref
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
    full = {"weight": torch.zeros(7, 4)}
    dcp.load(full, checkpoint_id=ckpt_dir)
    torch.testing.assert_close(full["weight"], ref.weight.detach())
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    with pytest.raises(ValueError, match="same root mesh"):
        fully_shard(parallelize_module(nn.Linear(4, 6, bias=False), world["tp"], ColwiseParallel()), mesh=other)


def test_fully_shard_on_a_tp_sharded_dim_and_errors(ranks, tmp_path):
    ranks(4).run(_shard_placement_on_a_tp_dim, str(tmp_path / "ckpt"))


# ---- the trainer: the tiny Llama on dp_shard 2 x tp 2 ---------------------------------------------


def _spec(tmp, steps=4, checkpoint=None, **parallelism):
    return tiny_llama_job(tmp, training={"steps": steps}, checkpoint=checkpoint or {}, parallelism=parallelism)


def _close(run, ref):
    for a, b in zip(run, ref, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=2e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=2e-5)
        assert a["lr"] == b["lr"]


def test_trainer_dp2_tp2_with_and_without_sp_equals_one_process_and_checkpoints_reshard(ranks, tmp_path):
    one = ranks(1).run(_run, _spec(tmp_path / "one", steps=4))[0]
    four = ranks(4).run(_run, _spec(tmp_path / "2x2", steps=4, checkpoint={"interval": 2}, dp_shard=2, tp=2))
    for r in four[1:]:
        assert [x["loss"] for x in r] == [x["loss"] for x in four[0]]
    _close(four[0], one)
    sp = ranks(4).run(_run, _spec(tmp_path / "sp", steps=4, dp_shard=2, tp=2, sequence_parallel=True))
    _close(sp[0], one)
    # The dp 2 x tp 2 checkpoint of step 2 resumes on one process and on tp 2 alone.
    step2 = tmp_path / "2x2" / "ckpt" / "step-00000002"
    assert step2.is_dir()
    resume = {"resume_from": str(step2)}
    again = ranks(1).run(_run, _spec(tmp_path / "again", steps=4, checkpoint=resume))[0]
    _close(again, one[2:])
    tp_only = ranks(2).run(_run, _spec(tmp_path / "tp", steps=4, checkpoint=resume, tp=2, dp_shard=1))[0]
    _close(tp_only, one[2:])


def test_trainer_tp_with_mixed_precision_and_cpu_offload(ranks, tmp_path):
    """dp_replicate 2 x tp 2 with bf16 parameters: the loss follows the fp32 single process; dp_shard 2
    x tp 2 with CPU offload (fp32) equals it."""
    one = ranks(1).run(_run, _spec(tmp_path / "one", steps=4))[0]
    mp = ranks(4).run(_run, _spec(tmp_path / "mp", steps=4, dp_replicate=2, dp_shard=1, tp=2, mixed_precision="bf16"))
    for a, b in zip(mp[0], one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=5e-3)
    offload = ranks(4).run(_run, _spec(tmp_path / "offload", steps=4, dp_shard=2, tp=2, cpu_offload=True))
    _close(offload[0], one)


def _foreach_equals_for_loop():
    """torch.optim's multi-tensor path (what CUDA takes by default, forced here) on DTensor
    parameters of several layouts equals its per-tensor path."""
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for foreach in (False, True):
        model = _mlp()
        parallelize_module(model, world["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=world["dp_shard"])
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=foreach)
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.full_tensor() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_foreach_optimizer_on_fsdp_tp_params_equals_for_loop(ranks):
    ranks(4).run(_foreach_equals_for_loop)
