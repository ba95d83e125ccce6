"""torch's fully_shard recipes run through torch and through hpservice on the same gloo ranks.

Each recipe is one a torch / torchtitan user writes: build on meta -> fully_shard -> to_empty
-> init_weights; load_state_dict(assign=True); model.double(); freezing a parameter after
fully_shard; a parameter shared between two groups. Ours must train exactly the model torch
trains (and the single process computes), or raise where torch raises.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.dtensor import DTensor, Shard, distribute_tensor, init_device_mesh
from hpservice.dtensor import random as dt_random
from hpservice.fsdp import fully_shard
from tests.fsdp._models import MLP, batch, local_slice, reference_run, sharded_run

STEPS = 3


def _torch_api():
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.fsdp import fully_shard as t_fully_shard
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as t_distribute

    return t_mesh, t_fully_shard, TShard, t_distribute


def _shard_blocks(model, shard_fn, mesh):
    for block in model.blocks:
        shard_fn(block, mesh=mesh)
    shard_fn(model, mesh=mesh)
    return model


def _full(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def _init_weights(model):
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


# ---- build on meta -> fully_shard -> to_empty -> init_weights (torchtitan) ---------------------------


def _check_meta_to_empty_init():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        meta = MLP()
    _shard_blocks(meta, fully_shard, mesh)
    meta.to_empty(device="cpu")
    dt_random.manual_seed(7)
    _init_weights(meta)
    assert all(isinstance(p, DTensor) and not p._local_tensor.is_meta for p in meta.parameters())

    torch.manual_seed(0)
    on_cpu = _shard_blocks(MLP(), fully_shard, mesh)
    dt_random.manual_seed(7)
    _init_weights(on_cpu)
    initial = _full(meta)
    for k, v in _full(on_cpu).items():
        torch.testing.assert_close(initial[k], v, rtol=0, atol=1e-6)
    assert any(v.abs().sum() > 0 for k, v in initial.items() if k.endswith("weight"))

    # The single process from the same initial weights is what both must train.
    ref = MLP()
    ref.load_state_dict(initial)
    ref, ref_losses = reference_run(ref, STEPS, dist.get_world_size())
    losses = sharded_run(meta, STEPS)
    assert sharded_run(on_cpu, STEPS) == pytest.approx(losses, abs=1e-6)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    after = _full(meta)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=1e-5)
    return True


def test_meta_to_empty_init_weights_equals_the_model_built_on_cpu(ranks):
    ranks(2).run(_check_meta_to_empty_init)


# ---- load_state_dict(assign=True) and full-tensor load, ours vs torch -------------------------------


def _check_load_state_dict(assign: bool):
    t_mesh, t_fully_shard, TShard, t_distribute = _torch_api()
    world = dist.get_world_size()
    torch.manual_seed(1)
    source = MLP()
    full = {k: v.detach().clone() for k, v in source.state_dict().items()}
    torch.manual_seed(2)
    base = MLP()  # different weights: the load must replace them

    results = []
    for mesh, shard_fn, dist_fn, placement in (
        (init_device_mesh("cpu", (world,)), fully_shard, distribute_tensor, Shard(0)),
        (t_mesh("cpu", (world,)), t_fully_shard, t_distribute, TShard(0)),
    ):
        model = _shard_blocks(copy.deepcopy(base), shard_fn, mesh)
        sharded_run(model, 1)  # after a first step too (torch resets its shards in a load post-hook)
        sd = {k: dist_fn(v, mesh, [placement]) for k, v in full.items()}
        model.load_state_dict(sd, assign=assign)
        loaded = _full(model)
        for k, v in full.items():
            torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
        results.append(sharded_run(model, STEPS))
    ref = MLP()
    ref.load_state_dict(full)
    _, ref_losses = reference_run(ref, STEPS, world)
    ours, theirs = results
    assert ours == pytest.approx(theirs, abs=1e-6)
    assert ours == pytest.approx(ref_losses, abs=1e-5)
    return True


@pytest.mark.parametrize("assign", [True, False], ids=["assign", "copy"])
def test_load_state_dict_trains_the_loaded_weights_as_torch(ranks, assign):
    ranks(2).run(_check_load_state_dict, assign)


# ---- model.double() / .to(dtype) after fully_shard ------------------------------------------------


def _check_double():
    t_mesh, t_fully_shard, _, _ = _torch_api()
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = MLP()
    ours = _shard_blocks(copy.deepcopy(base), fully_shard, init_device_mesh("cpu", (world,)))
    theirs = _shard_blocks(copy.deepcopy(base), t_fully_shard, t_mesh("cpu", (world,)))
    ours.double()
    theirs.to(torch.float64)
    assert all(p.dtype == torch.float64 and p._local_tensor.dtype == torch.float64 for p in ours.parameters())
    ours_losses = sharded_run(ours, STEPS, dtype=torch.float64)
    theirs_losses = sharded_run(theirs, STEPS, dtype=torch.float64)
    _, ref_losses = reference_run(copy.deepcopy(base).double(), STEPS, world, dtype=torch.float64)
    assert ours_losses == pytest.approx(theirs_losses, abs=1e-9)
    assert ours_losses == pytest.approx(ref_losses, abs=1e-9)
    return True


def test_double_after_fully_shard_trains_in_float64_as_torch(ranks):
    ranks(2).run(_check_double)


# ---- requires_grad_(False) after fully_shard --------------------------------------------------------


def _check_freeze_after_fully_shard():
    t_mesh, t_fully_shard, _, _ = _torch_api()
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = MLP()
    out = []
    for model in (
        _shard_blocks(copy.deepcopy(base), fully_shard, init_device_mesh("cpu", (world,))),
        _shard_blocks(copy.deepcopy(base), t_fully_shard, t_mesh("cpu", (world,))),
    ):
        sharded_run(model, 1)
        model.blocks[1].up.weight.requires_grad_(False)
        model.head.bias.requires_grad_(False)
        frozen_before = _full(model)
        opt_grads = []
        x, y = batch(5, world)
        rank = dist.get_rank()
        nn.functional.mse_loss(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        for name, p in model.named_parameters():
            opt_grads.append((name, p.grad is None))
        model.zero_grad(set_to_none=True)
        losses = sharded_run(model, STEPS)
        after = _full(model)
        for key in ("blocks.1.up.weight", "head.bias"):
            torch.testing.assert_close(after[key], frozen_before[key], rtol=0, atol=0)
        out.append((opt_grads, losses))
    (our_grads, our_losses), (their_grads, their_losses) = out
    assert our_grads == their_grads
    assert dict(our_grads)["blocks.1.up.weight"] and dict(our_grads)["head.bias"]
    assert our_losses == pytest.approx(their_losses, abs=1e-6)
    return True


def test_requires_grad_false_after_fully_shard_freezes_the_parameter_as_torch(ranks):
    ranks(2).run(_check_freeze_after_fully_shard)


# ---- a parameter shared between two FSDP groups --------------------------------------------------


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def _check_shared_across_groups():
    t_mesh, t_fully_shard, _, _ = _torch_api()
    world = dist.get_world_size()
    messages = []
    for shard_fn, mesh in ((fully_shard, init_device_mesh("cpu", (world,))), (t_fully_shard, t_mesh("cpu", (world,)))):
        model = _Tied()
        with pytest.raises(ValueError, match=r"fully_shard\(\[module_a, module_b\]\)") as info:
            shard_fn(model.a, mesh=mesh)
            shard_fn(model.b, mesh=mesh)
            shard_fn(model, mesh=mesh)
            model(torch.randn(2, 4))  # torch raises at lazy init
        messages.append(str(info.value))
    # Both groups in one call keep the weight tied and equal to one process.
    torch.manual_seed(0)
    base = _Tied()
    model = copy.deepcopy(base)
    fully_shard([model.a, model.b], mesh=init_device_mesh("cpu", (world,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(3))
    rank = dist.get_rank()
    model(local_slice(x, rank, world)).pow(2).mean().backward()
    base(x).pow(2).mean().backward()
    assert model.a.weight is model.b.weight
    torch.testing.assert_close(model.a.weight.grad.full_tensor(), base.a.weight.grad, atol=1e-6, rtol=0)
    return messages


def test_parameter_shared_between_groups_raises_as_torch(ranks):
    ours, _ = ranks(2).run(_check_shared_across_groups)[0]
    assert "blocks" not in ours and "weight" in ours


# ---- 0-size and 0-d parameters ---------------------------------------------------------------------


class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) + self.empty.sum()


def _check_zero_size():
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = _WithEmpty()
    model = fully_shard(copy.deepcopy(base), mesh=init_device_mesh("cpu", (world,)))
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(3))
    model(local_slice(x, dist.get_rank(), world)).pow(2).mean().backward()
    base(x).pow(2).mean().backward()
    assert model.empty.grad.shape == (0, 4)
    torch.testing.assert_close(model.lin.weight.grad.full_tensor(), base.lin.weight.grad, atol=1e-6, rtol=0)
    scalar = nn.Module()
    scalar.s = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="scalar parameters"):
        fully_shard(scalar, mesh=init_device_mesh("cpu", (world,)))
    return True


def test_zero_size_parameter_trains_and_scalar_parameter_raises_value_error(ranks):
    ranks(2).run(_check_zero_size)


# ---- integer reshard_after_forward and DeviceMesh._flatten ---------------------------------------


def _check_int_reshard_after_forward():
    t_mesh, t_fully_shard, _, _ = _torch_api()
    world = dist.get_world_size()
    for value in (0, 3, 2.5):
        for shard_fn, mesh in ((fully_shard, init_device_mesh("cpu", (world,))), (t_fully_shard, t_mesh("cpu", (world,)))):
            with pytest.raises(ValueError, match="reshard_after_forward"):
                shard_fn(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)
    mesh = init_device_mesh("cpu", (world,))
    with pytest.warns(UserWarning, match="world size 1"):
        one = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
    assert one._fsdp_state._reshard_after_forward is False
    full = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=world)
    assert full._fsdp_state._reshard_after_forward is True
    grid = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    assert grid._flatten() is grid.flatten()
    return True


def test_integer_reshard_after_forward_follows_torch_rules(ranks):
    ranks(2).run(_check_int_reshard_after_forward)


def _check_flatten_and_slices_as_torch():
    """Data sharded by the flattened rank must split the same way as under torch's mesh."""
    from torch.distributed.device_mesh import init_device_mesh as t_mesh

    ours = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    theirs = t_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for o, t in ((ours._flatten("dp"), theirs._flatten("dp")), (ours["dp_shard"], theirs["dp_shard"])):
        assert o.mesh.tolist() == t.mesh.tolist()
        assert o.get_local_rank() == t.get_local_rank()
        assert dist.get_process_group_ranks(o.get_group()) == dist.get_process_group_ranks(t.get_group())
    for mesh in (ours, theirs):  # a transposed sub-mesh: both refuse
        with pytest.raises(KeyError, match="ascending order"):
            mesh["dp_shard", "dp_replicate"]
    return True


def test_flatten_and_sub_meshes_give_torchs_ranks_and_refuse_transposed_dims(ranks):
    ranks(4).run(_check_flatten_and_slices_as_torch)


def _check_flattened_dim_sliced_with_others_as_torch():
    """HSDP with context parallelism: ``world["dp_replicate", "dp_shard_cp"]`` after flattening
    ``dp_shard x cp`` has torch's ranks, local ranks and groups."""
    from torch.distributed.device_mesh import init_device_mesh as t_mesh

    names = ("dp_replicate", "dp_shard", "cp")
    meshes = []
    for make in (init_device_mesh, t_mesh):
        world = make("cpu", (2, 2, 2), mesh_dim_names=names)
        world["dp_shard", "cp"]._flatten("dp_shard_cp")
        meshes.append(world["dp_replicate", "dp_shard_cp"])
    ours, theirs = meshes
    assert ours.mesh.tolist() == theirs.mesh.tolist() and ours.mesh_dim_names == theirs.mesh_dim_names
    for dim in ("dp_replicate", "dp_shard_cp"):
        assert ours.get_local_rank(dim) == theirs.get_local_rank(dim), dim
        assert dist.get_process_group_ranks(ours.get_group(dim)) == dist.get_process_group_ranks(theirs.get_group(dim))
    assert ours["dp_shard_cp"].mesh.tolist() == theirs["dp_shard_cp"].mesh.tolist()
    return True


def test_a_flattened_dim_sliced_with_another_gives_torchs_mesh(ranks):
    ranks(8).run(_check_flattened_dim_sliced_with_others_as_torch)


def _check_int_reshard_not_built():
    with pytest.raises(NotImplementedError, match="not built yet"):
        fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (4,)), reshard_after_forward=2)
    return True


def test_integer_reshard_to_a_smaller_group_raises_not_built(ranks):
    ranks(4).run(_check_int_reshard_not_built)


# ---- MixedPrecisionPolicy(output_dtype=...) on an inner module ------------------------------------


def _check_output_dtype_of_inner_modules():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TPolicy

    from hpservice.fsdp import MixedPrecisionPolicy

    t_mesh, t_fully_shard, _, _ = _torch_api()
    world = dist.get_world_size()
    dtypes = []
    for shard_fn, mesh, policy in (
        (fully_shard, init_device_mesh("cpu", (world,)), MixedPrecisionPolicy),
        (t_fully_shard, t_mesh("cpu", (world,)), TPolicy),
    ):
        torch.manual_seed(0)
        model = MLP()
        for block in model.blocks:
            shard_fn(block, mesh=mesh, mp_policy=policy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
        shard_fn(model, mesh=mesh)  # the root (the head) in float32: it takes the blocks' float32 outputs
        x = local_slice(batch(0, world)[0], dist.get_rank(), world)
        root_out = model(x)
        blocks_out = [block(x).dtype for block in model.blocks]  # each block alone, through its hooks
        dtypes.append((blocks_out, root_out.dtype))
    assert dtypes[0] == dtypes[1], dtypes
    assert dtypes[0][0] == [torch.float32] * 3 and dtypes[0][1] == torch.float32
    return True


def test_output_dtype_applies_to_every_fully_shard_module_as_torch(ranks):
    ranks(2).run(_check_output_dtype_of_inner_modules)


# ---- a late UnshardHandle.wait() ------------------------------------------------------------------


def _check_late_unshard_wait():
    """``h = model.unshard(async_op=True)``; forward and backward; ``h.wait()`` only then; the
    optimizer step; the next forward must see the stepped weights (torch: a late wait is a no-op).
    Trained a few steps that way, both engines end where one process does."""
    t_mesh, t_fully_shard, _, _ = _torch_api()
    world, rank = dist.get_world_size(), dist.get_rank()
    finals = []
    for shard_fn, mesh in ((None, None), (fully_shard, init_device_mesh("cpu", (world,))), (t_fully_shard, t_mesh("cpu", (world,)))):
        torch.manual_seed(0)
        model = MLP()
        if shard_fn is not None:
            _shard_blocks(model, shard_fn, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x, y = batch(step, world, per_rank=4)  # the global batch: one process takes it whole
            if shard_fn is not None:
                x, y = local_slice(x, rank, world), local_slice(y, rank, world)
            handle = model.unshard(async_op=True) if shard_fn is not None else None
            nn.functional.mse_loss(model(x), y).backward()
            if handle is not None:
                handle.wait()  # late: after the forward and backward that used the gather
            opt.step()
            opt.zero_grad()
        finals.append(_full(model))
    for name in finals[0]:
        torch.testing.assert_close(finals[1][name], finals[0][name], msg=f"ours vs one process: {name}")
        torch.testing.assert_close(finals[2][name], finals[0][name], msg=f"torch vs one process: {name}")
    return True


def test_a_late_unshard_wait_is_a_no_op_and_training_equals_one_process(ranks):
    ranks(2).run(_check_late_unshard_wait)


# ---- micro-batching with set_is_last_backward -------------------------------------------------------


def _check_is_last_backward_microbatches():
    """torch's micro-batching recipe: ``set_is_last_backward(False)`` before every micro-batch's
    backward but the last; gradients after the last equal torch's and one process's."""
    t_mesh, t_fully_shard, _, _ = _torch_api()
    world, rank = dist.get_world_size(), dist.get_rank()
    grads = []
    for shard_fn, mesh in ((None, None), (fully_shard, init_device_mesh("cpu", (world,))), (t_fully_shard, t_mesh("cpu", (world,)))):
        torch.manual_seed(0)
        model = MLP()
        if shard_fn is not None:
            _shard_blocks(model, shard_fn, mesh)
        micro = 3
        for k in range(micro):
            x, y = batch(k, world, per_rank=2)
            if shard_fn is not None:
                x, y = local_slice(x, rank, world), local_slice(y, rank, world)
                model.set_is_last_backward(k == micro - 1)
            (nn.functional.mse_loss(model(x), y) / micro).backward()
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=f"ours vs one process: {name}")
        torch.testing.assert_close(grads[2][name], grads[0][name], msg=f"torch vs one process: {name}")
    with pytest.raises(TypeError):
        model_ours = _shard_blocks(MLP(), fully_shard, init_device_mesh("cpu", (world,)))
        model_ours.set_is_last_backward("yes")
    return True


def test_set_is_last_backward_microbatches_accumulate_as_torch(ranks):
    ranks(2).run(_check_is_last_backward_microbatches)


# ---- clip_grad_norm_ over tensor parallel + fully_shard on a 2x2 mesh -------------------------------


def _tp_fsdp_mlp(api, norm: bool):
    """A Colwise/Rowwise MLP with biases (and a LayerNorm that tp leaves alone), tp on one mesh
    dim, fully_shard on the other: gradients on the 2-D mesh(es) and, for the norm, the dp mesh."""
    if api == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    else:
        from hpservice.dtensor import init_device_mesh
        from hpservice.fsdp import fully_shard as shard
        from hpservice.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    layers = [nn.Linear(16, 36), nn.GELU(), nn.Linear(36, 16)] + ([nn.LayerNorm(16)] if norm else [])
    ref = nn.Sequential(*layers)
    model = copy.deepcopy(ref)
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, world["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    shard(model, mesh=world["dp"])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    model(x.chunk(2)[world["dp"].get_local_rank()]).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    return model, ref


def _clip(model, clip, norm_type, **kw):
    try:
        total = clip(model.parameters(), 0.05, norm_type=norm_type, **kw)
    except Exception as e:  # the refusal is compared with torch's
        return type(e).__name__
    total = total.full_tensor() if hasattr(total, "full_tensor") else total  # ours or torch's DTensor
    return total, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _check_clip_grad_norm_tp_fsdp():
    from hpservice.train import clip_grad_norm_ as our_clip

    for norm_type in (2.0, float("inf"), 3.0):
        for foreach in (None, False):
            kw = {"foreach": foreach, "error_if_nonfinite": True}
            theirs = _clip(_tp_fsdp_mlp("torch", False)[0], torch.nn.utils.clip_grad_norm_, norm_type, **kw)
            model, ref = _tp_fsdp_mlp("ours", False)
            mine = _clip(model, torch.nn.utils.clip_grad_norm_, norm_type, **kw)
            single = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type, foreach=foreach)
            key = (norm_type, foreach)
            assert not isinstance(theirs, str) and not isinstance(mine, str), (key, theirs, mine)
            torch.testing.assert_close(mine[0], theirs[0], rtol=1e-6, atol=1e-7, msg=str(key))
            torch.testing.assert_close(mine[0], single, rtol=1e-6, atol=1e-7, msg=str(key))
            for name, p in ref.named_parameters():
                torch.testing.assert_close(mine[1][name], p.grad, rtol=1e-5, atol=1e-8, msg=f"{key} {name}")
                torch.testing.assert_close(mine[1][name], theirs[1][name], rtol=1e-5, atol=1e-8, msg=f"{key} {name}")
        # With a LayerNorm on the dp mesh alone, torch refuses the cross-mesh stack, and so do we
        # (the norm's value on the other dp group is not ours to assume); our trainer's clip,
        # grouping gradients by mesh, computes it.
        assert _clip(_tp_fsdp_mlp("torch", True)[0], torch.nn.utils.clip_grad_norm_, norm_type) == "RuntimeError"
        model, ref = _tp_fsdp_mlp("ours", True)
        assert _clip(model, torch.nn.utils.clip_grad_norm_, norm_type) == "NotImplementedError"
        total = our_clip(model.parameters(), 0.05, norm_type=norm_type)
        single = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
        torch.testing.assert_close(total, single, rtol=1e-6, atol=1e-7)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                dict(model.named_parameters())[name].grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-7
            )
    # error_if_nonfinite: torch's RuntimeError, from ours as from torch's
    for api in ("torch", "ours"):
        model, _ = _tp_fsdp_mlp(api, False)
        with torch.no_grad():
            next(iter(model.parameters())).grad.fill_(float("nan"))
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    return True


def test_clip_grad_norm_over_tensor_parallel_and_fully_shard_equals_one_process_and_torch(ranks):
    ranks(4).run(_check_clip_grad_norm_tp_fsdp, timeout=300)
