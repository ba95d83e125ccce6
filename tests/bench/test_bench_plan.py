"""bench plan, checked against what hpservice's fully_shard really holds and sends: the tiny Llama
on 4 CPU ranks (dp_shard 4, and dp_replicate 2 x dp_shard 2), one training step. Every byte count
the plan gives for a rank must equal the measured one; its link times are arithmetic on top."""

import json

import pytest
import torch
import torch.nn.functional as F

from hpservice.bench.plan import Layout, Links, plan
from hpservice.models.llama import LLAMA_FLAVORS
from tests.bench._inprocess import bench

LINKS = Links(nvlink_gbs=450, ib_gbs=50, storage_gbs=2)


def _one_step_measured(dp_replicate):
    import torch.distributed as dist

    import hpservice.fsdp._fsdp_param_group as pg
    from hpservice.dtensor import DTensor, init_device_mesh
    from hpservice.models.llama import Llama
    from hpservice.spec import parse_job
    from hpservice.train import apply_fsdp

    cfg = LLAMA_FLAVORS["tiny"]
    torch.manual_seed(0)
    model = Llama(cfg)
    world = dist.get_world_size()
    if dp_replicate > 1:
        mesh = init_device_mesh("cpu", (dp_replicate, world // dp_replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    apply_fsdp(model, mesh, parse_job({"name": "plan"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sent = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    originals = {name: getattr(pg, name) for name in ("all_gather_flat", "reduce_scatter_flat", "all_reduce_flat")}

    def counting(kind, fn, tensor_arg):
        def wrapper(*args, **kwargs):
            t = args[tensor_arg]
            sent[kind] += t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return wrapper

    pg.all_gather_flat = counting("all_gather", originals["all_gather_flat"], 1)  # the gathered output
    pg.reduce_scatter_flat = counting("reduce_scatter", originals["reduce_scatter_flat"], 0)  # the full input
    pg.all_reduce_flat = counting("all_reduce", originals["all_reduce_flat"], 0)
    try:
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
        opt.step()
    finally:
        for name, fn in originals.items():
            setattr(pg, name, fn)
    groups = [m._fsdp_state.group for m in model.modules() if getattr(m, "_fsdp_state", None) is not None]
    nbytes = lambda t: t.untyped_storage().nbytes()  # noqa: E731
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    held = {
        "params": sum(nbytes(g.flat_shard) for g in groups),
        "grads": sum(nbytes(g.grad_flat) for g in groups),
        "optimizer": sum(
            local(v).numel() * local(v).element_size() for s in opt.state.values() for k, v in s.items() if k != "step"
        ),
        "collective_scratch": sum(
            nbytes(g.ag_out) + nbytes(g.rs_in) + nbytes(g.rs_out) + (nbytes(g.ag_in) if g.ag_in is not g.flat_shard else 0)
            for g in groups
        ),
    }
    return held, sent


@pytest.mark.parametrize("dp_replicate", [1, 2])
def test_the_plan_gives_the_bytes_fully_shard_holds_and_sends(ranks, dp_replicate):
    measured = ranks(4).run(_one_step_measured, dp_replicate)
    layout = Layout(gpus=4, gpus_per_node=4, tp=1, dp_shard=4 // dp_replicate)
    result = plan(LLAMA_FLAVORS["tiny"], layout, LINKS, seq_len=16, micro_batch=2, param_bytes=4, device="cpu")
    held, sent = measured[0]  # rank 0 holds the largest shards (the plan's rank)
    for key, value in held.items():
        assert result["memory_bytes"][key] == value, (key, result["memory_bytes"][key], value)
    c = result["collectives"]
    assert c["fsdp_all_gather"]["bytes"] == sent["all_gather"]
    assert c["fsdp_reduce_scatter"]["bytes"] == sent["reduce_scatter"]
    assert c["hsdp_all_reduce"]["bytes"] == sent["all_reduce"]
    assert all(s == sent for _, s in measured)  # every rank sends the same


def test_bench_plan_prints_the_8b_layout_and_json():
    proc = bench("plan", "--model", "8B", "--gpus", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["layout"] == {
        "gpus": 64, "gpus_per_node": 8, "tp": 1, "dp_shard": 8, "cp": 1, "pp": 1, "pp_virtual_stages": 1,
        "dp_replicate": 8, "shard_group": 8,
    }  # fmt: skip
    assert result["pipeline"] is None
    assert 8.0e9 < result["model"]["params"] < 8.1e9 and result["shard_group_inside_node"]
    assert result["collectives"]["fsdp_all_gather"]["link"] == "nvlink"
    assert result["collectives"]["hsdp_all_reduce"]["link"] == "ib"
    # 12 bytes per parameter (fp32 weights and AdamW's two moments), each replica written once
    assert result["checkpoint"]["total_bytes"] == 12 * result["model"]["params"]


def test_context_parallelism_shards_parameters_over_dp_shard_x_cp_and_splits_activations():
    """cp 2 x dp_shard 2 holds the parameters of dp_shard 4 (fully_shard shards over dp_shard x cp)
    and half the activations and logits of one rank holding whole sequences; the keys and values
    of every block go round the cp ring three times a step (forward, backward, their gradients)."""
    config = LLAMA_FLAVORS["8B"]
    whole = plan(config, Layout(gpus=8, gpus_per_node=8, tp=1, dp_shard=4), LINKS, seq_len=131072, micro_batch=1)
    split = plan(config, Layout(gpus=8, gpus_per_node=8, tp=1, dp_shard=2, cp=2), LINKS, seq_len=131072, micro_batch=1)
    for key in ("params", "grads", "optimizer", "unsharded_params"):
        assert split["memory_bytes"][key] == whole["memory_bytes"][key], key
    for key in ("activations", "logits"):
        assert split["memory_bytes"][key] * 2 == whole["memory_bytes"][key], key
    ring = split["collectives"]["cp_kv_exchange"]
    kv = 131072 * 2 * config.n_kv_heads * config.head_dim * 2  # K and V of the whole sequence, bf16
    assert ring["bytes"] == 3 * config.n_layers * kv and ring["sent_bytes"] == ring["bytes"] / 2
    assert ring["link"] == "nvlink" and whole["collectives"]["cp_kv_exchange"]["bytes"] == 0
    with pytest.raises(SystemExit, match="not divisible by 2 x cp"):
        plan(config, Layout(gpus=8, gpus_per_node=8, tp=1, dp_shard=2, cp=4), LINKS, seq_len=100, micro_batch=1)


def test_pipeline_parallelism_plans_the_first_stage_its_bubble_and_its_transfers():
    """pp 4 x 1F1B over 8 micro-batches: rank 0 holds the first quarter of the blocks and the
    embedding, the simulated bubble is the closed form (pp - 1) / (m + pp - 1), rank r holds
    pp - r micro-batches' activations, and rank 0 sends each micro-batch's activations once."""
    config = LLAMA_FLAVORS["8B"]
    whole = plan(config, Layout(gpus=8, gpus_per_node=8, tp=1, dp_shard=8), LINKS, seq_len=8192, micro_batch=1)
    layout = Layout(gpus=32, gpus_per_node=8, tp=1, dp_shard=8, pp=4)
    piped = plan(config, layout, LINKS, seq_len=8192, micro_batch=1, pp_microbatches=8)
    pipe = piped["pipeline"]
    assert pipe["bubble"] == pytest.approx(3 / 11)
    assert pipe["peak_microbatches"] == {0: 4, 1: 3, 2: 2, 3: 1}
    one_micro_batch_of_a_stage = whole["memory_bytes"]["activations"] / 4  # 8 of the 32 blocks
    assert pipe["activation_bytes"] == {r: n * one_micro_batch_of_a_stage for r, n in pipe["peak_microbatches"].items()}
    assert pipe["p2p"]["bytes"] == 8 * 8192 * config.dim * 2 and pipe["p2p"]["link"] == "ib"  # stages 8 ranks apart
    per_block = config.dim * (2 * config.dim + 2 * config.n_kv_heads * config.head_dim + 3 * config.ffn_hidden_dim + 2)
    stage0 = 8 * per_block + config.vocab_size * config.dim  # 8 blocks and the embedding, over dp_shard 8
    assert piped["memory_bytes"]["optimizer"] == 2 * 4 * stage0 / 8
    assert piped["layout"]["dp_replicate"] == 1 and piped["memory_bytes"]["logits"] == 0
    interleaved = plan(
        config, Layout(32, 8, 1, 8, pp=4, pp_virtual_stages=2), LINKS, seq_len=8192, micro_batch=1,
        pp_schedule="interleaved_1f1b", pp_microbatches=8,
    )["pipeline"]  # fmt: skip
    assert interleaved["bubble"] < pipe["bubble"] and interleaved["p2p"]["bytes"] == 3 * pipe["p2p"]["bytes"]
    with pytest.raises(SystemExit, match="micro-batches \\(2\\) must be >= pp \\(4\\)"):
        plan(config, layout, LINKS, seq_len=8192, micro_batch=1, pp_microbatches=2)


def test_plan_of_a_moe_model_with_expert_parallelism(capsys):
    """The MoE plan's numbers are its stated arithmetic on the model's own parameter counts: the
    experts split over ep and sharded over the rest of dp_shard, the rest sharded over dp_shard;
    the all-to-all at NVLink speed while the ep group fits a node, at InfiniBand speed past it."""
    from hpservice.bench.plan_moe import moe_plan
    from hpservice.models import build_model
    from hpservice.models.moe import GroupedExperts

    def run(gpus, ep, dp_shard=None):
        return moe_plan("qwen3_moe", "30B-A3B", gpus=gpus, gpus_per_node=8, tp=1, dp_shard=dp_shard, ep=ep,
                        seq_len=4096, micro_batch=1, param_bytes=2, nvlink_gbs=450.0, ib_gbs=50.0)  # fmt: skip

    model = build_model("qwen3_moe", "30B-A3B", device="meta")
    experts = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    r = run(64, 8)
    assert r["parameters"]["experts"] == experts and round(r["parameters"]["total"] / 1e9, 1) == 30.5
    assert r["memory_gib"]["expert_state"] == pytest.approx(experts / 8 * 16 / 2**30)  # ep 8 = dp_shard 8
    assert r["memory_gib"]["dense_state"] == pytest.approx((r["parameters"]["dense"]) / 8 * 16 / 2**30)
    assert r["all_to_all"]["bytes"] == 2 * 2 * 48 * 4096 * 8 * (7 / 8) * 2048 * 2 and r["all_to_all"]["link"] == "nvlink"
    assert r["expert_fully_shard"]["bytes"] == 0  # each rank alone holds its experts in its node
    assert r["expert_replica_all_reduce"]["bytes"] == pytest.approx(2 * 7 / 8 * experts / 8 * 4)  # over 8 replicas
    wide = run(256, 4, dp_shard=32)  # experts split over 4, sharded over the 8 ranks holding the same ones
    assert wide["all_to_all"]["link"] == "nvlink" and wide["memory_gib"]["expert_state"] == pytest.approx(experts / 32 * 16 / 2**30)
    assert wide["expert_fully_shard"]["bytes"] == pytest.approx(7 / 8 * experts / 4 * (2 * 2 + 4))
    assert run(256, 32, dp_shard=32)["all_to_all"]["link"] == "infiniband"
    with pytest.raises(ValueError, match="ep 3 must divide dp_shard 8"):
        run(64, 3)
    from hpservice.bench.__main__ import main

    assert main(["plan", "--model", "deepseek_v3/671B", "--gpus", "256", "--dp-shard", "64", "--ep", "64"]) == 0
    assert "ep 64 (experts' data-parallel copies: 4)" in capsys.readouterr().out
