"""DCP across engines and layouts: a checkpoint torch's fully_shard + tensor parallel writes is
read by ours in another layout and back, with optimizer state, and ``dcp.async_save`` keeps the
values of the moment it was called while training goes on, in ours as in torch's."""

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import hpservice.dtensor as ours
import hpservice.fsdp as ours_fsdp
import hpservice.parallel as ours_parallel


def _base():
    torch.manual_seed(0)
    # hidden 12 over tp 2 and then dp 2: every layout cuts it differently
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8), nn.LayerNorm(8))


def _engines():
    import torch.distributed.fsdp as t_fsdp
    import torch.distributed.tensor.parallel as t_parallel
    from torch.distributed.device_mesh import init_device_mesh

    return {
        "ours": (ours.init_device_mesh, ours_fsdp.fully_shard, ours_parallel),
        "torch": (init_device_mesh, t_fsdp.fully_shard, t_parallel),
    }


def _build(engine: str, layout: str):
    """The base MLP on 4 ranks: ``fsdp`` (fully_shard over 4) or ``fsdp+tp`` (2 x 2)."""
    init_mesh, fully_shard, parallel = _engines()[engine]
    model = copy.deepcopy(_base())
    if layout == "fsdp":
        fully_shard(model, mesh=init_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    else:
        mesh = init_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"0": parallel.ColwiseParallel(), "2": parallel.RowwiseParallel()}
        parallel.parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train(model, opt, steps: int, layout: str) -> None:
    """Steps on one global batch of 8 rows a step, whatever the layout: 2 rows per rank under
    fsdp, 4 per data-parallel pair under fsdp+tp (tp peers see the same rows)."""
    rank = dist.get_rank()
    rows = slice(2 * rank, 2 * rank + 2) if layout == "fsdp" else slice(4 * (rank // 2), 4 * (rank // 2) + 4)
    for step in range(steps):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + step))[rows]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


_FULL = StateDictOptions(full_state_dict=True)
# Two engines or layouts sum gradients in other orders, and AdamW divides by sqrt(v): where a
# gradient is near 0 that rounding moves a weight by up to ~1e-5 after a step of lr 0.05.
_ROUNDING = {"rtol": 1e-5, "atol": 2e-5}


def _full(model, opt) -> dict:
    """Every parameter and optimizer state entry as a full tensor (torch's helpers)."""
    model_sd, opt_sd = get_state_dict(model, opt, options=_FULL)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in opt_sd["state"].items():
        for name, value in state.items():
            flat[f"optim.{fqn}.{name}"] = value
    return {k: v.detach().clone() for k, v in flat.items()}  # AdamW's step is the live tensor


def _save(model, opt, path, *, future=False):
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    if future:
        return dcp.async_save(state, checkpoint_id=path)
    dcp.save(state, checkpoint_id=path)
    return None


def _load(model, opt, path) -> None:
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"{what}: {key}")


def _check_interop(root):
    cases = [("torch", "fsdp+tp", "ours", "fsdp"), ("ours", "fsdp+tp", "torch", "fsdp"),
             ("ours", "fsdp", "torch", "fsdp+tp"), ("torch", "fsdp", "ours", "fsdp+tp")]  # fmt: skip
    for i, (writer, writer_layout, reader, reader_layout) in enumerate(cases):
        path = f"{root}/case{i}"
        model, opt = _build(writer, writer_layout)
        _train(model, opt, 2, writer_layout)
        _save(model, opt, path)
        written = _full(model, opt)
        other, other_opt = _build(reader, reader_layout)
        _train(other, other_opt, 1, reader_layout)  # state of its own first, which the load replaces
        _load(other, other_opt, path)
        _assert_same(_full(other, other_opt), written, f"{writer} {writer_layout} -> {reader} {reader_layout}")
        # and the loaded state trains on: one more step equals the writer's (same global batch)
        _train(model, opt, 1, writer_layout)
        _train(other, other_opt, 1, reader_layout)
        after, other_after = _full(model, opt), _full(other, other_opt)
        for key in after:
            torch.testing.assert_close(other_after[key], after[key], **_ROUNDING, msg=f"case {i}: {key}")
    return True


def test_dcp_checkpoints_move_between_torchs_and_ours_across_layouts(ranks, tmp_path):
    ranks(4).run(_check_interop, str(tmp_path))


def _check_async_save(root):
    saved = {}
    for engine in ("torch", "ours"):
        model, opt = _build(engine, "fsdp+tp")
        _train(model, opt, 1, "fsdp+tp")
        expected = _full(model, opt)
        future = _save(model, opt, f"{root}/{engine}", future=True)
        _train(model, opt, 2, "fsdp+tp")  # training goes on while the checkpoint is written
        future.result()
        moved = _full(model, opt)
        assert any(not torch.equal(moved[k], expected[k]) for k in expected)
        fresh, fresh_opt = _build(engine, "fsdp")
        _train(fresh, fresh_opt, 1, "fsdp")
        _load(fresh, fresh_opt, f"{root}/{engine}")
        saved[engine] = _full(fresh, fresh_opt)
        _assert_same(saved[engine], expected, f"{engine} async_save")
    for key in saved["torch"]:  # one step of each engine: the same values up to summation order
        torch.testing.assert_close(saved["ours"][key], saved["torch"][key], **_ROUNDING, msg=key)
    return True


def test_async_save_keeps_the_values_of_its_call_as_torchs_does(ranks, tmp_path):
    ranks(4).run(_check_async_save, str(tmp_path))
