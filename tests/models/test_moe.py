"""Mixture-of-experts building blocks (``hpservice.models.moe``) checked directly: routing
invariants, the layer against a per-token loop written here, the auxiliary loss against its
formula and its gradient against autograd of the summed loss, the aux-loss-free bias update;
and Qwen3-MoE training on 2 data-parallel ranks equal to one process, biases and aux loss
included, resuming from a checkpoint exactly."""

import pytest
import torch
import torch.nn.functional as F

from hpservice.models.moe import MoE, TokenChoiceTopKRouter, expert_loads, update_expert_biases

X = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_every_token_reaches_top_k_distinct_experts_and_weights_sum_as_defined(score_func):
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(16, 8, 3, score_func=score_func, route_norm=True, route_scale=2.5)
    weights, experts, scores = router(X)
    assert experts.shape == (40, 3) and all(len(set(row.tolist())) == 3 for row in experts)
    torch.testing.assert_close(weights.sum(-1), torch.full((40,), 2.5))  # normalised, then scaled
    top = scores.topk(3, dim=-1)
    assert torch.equal(experts, top.indices)  # no bias, no groups: the best scores
    plain = TokenChoiceTopKRouter(16, 8, 3, score_func=score_func)
    plain.load_state_dict(router.state_dict())
    torch.testing.assert_close(plain(X)[0], top.values)  # without route_norm: the raw scores


def test_a_bias_changes_the_choice_not_the_weights_and_groups_limit_it():
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(16, 8, 2, score_func="sigmoid")
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 chosen by every token, weighted by its own score
    weights, experts, scores = router(X, bias)
    assert (experts == 5).any(-1).all()
    torch.testing.assert_close(weights, scores.gather(-1, experts))
    grouped = TokenChoiceTopKRouter(16, 8, 2, score_func="sigmoid", num_expert_groups=4, num_limited_groups=1)
    grouped.load_state_dict(router.state_dict())
    _, experts, scores = grouped(X)
    assert torch.equal(experts // 2, experts[:, :1].expand(-1, 2) // 2)  # both from one group of 2
    best_group = scores.view(40, 4, 2).sum(-1).argmax(-1)  # with 2 per group, its two best are both
    assert torch.equal(experts[:, 0] // 2, best_group)


def test_the_layer_equals_a_per_token_loop_and_counts_its_tokens():
    torch.manual_seed(0)
    moe = MoE(16, 24, 6, 2, route_norm=True, shared_hidden_dim=20)
    x = X.view(4, 10, 16)
    out = moe(x)
    weights, experts, _ = moe.router(X)
    e = moe.experts
    expected = torch.stack([
        sum(w * F.linear(F.silu(F.linear(t, e.w1[i])) * F.linear(t, e.w3[i]), e.w2[i]) for w, i in zip(ws, ids, strict=True))
        for t, ws, ids in zip(X, weights, experts.tolist(), strict=True)
    ]) + moe.shared_experts(X)  # fmt: skip
    torch.testing.assert_close(out.view(40, 16), expected, rtol=0, atol=1e-6)
    loads = expert_loads({"0": moe})
    assert loads["0"] == torch.bincount(experts.flatten(), minlength=6).float().tolist() and sum(loads["0"]) == 80
    assert moe.tokens_per_expert.sum() == 0  # read and zeroed


@pytest.mark.parametrize(("score_func", "kind"), [("softmax", "batch"), ("sigmoid", "sequence")])
def test_the_aux_loss_is_its_formula_and_its_gradient_joins_the_backward(score_func, kind):
    torch.manual_seed(0)
    coef, scale = 0.1, 0.5
    moe = MoE(16, 24, 6, 2, score_func=score_func, aux_loss_coef=coef, aux_loss=kind)
    moe.aux_loss_scale = scale
    x = X.view(4, 10, 16)
    moe(x).square().sum().backward()
    ours = moe.router.gate.weight.grad.clone()
    # the formula, written out: per group (the batch, or each sequence) E * sum_e f_e * P_e
    moe.zero_grad()
    moe.aux_loss_coef = 0.0
    out = moe(x)
    _, experts, scores = moe.router(X)
    if score_func == "sigmoid":
        scores = scores / scores.sum(-1, keepdim=True)
    groups = 4 if kind == "sequence" else 1
    chosen = F.one_hot(experts, 6).sum(1).float().view(groups, -1, 6)
    f, p = chosen.mean(1) / 2, scores.view(groups, -1, 6).mean(1)
    aux = coef * 6 * (f * p).sum(-1).mean()
    (out.square().sum() + scale * aux).backward()
    torch.testing.assert_close(ours, moe.router.gate.weight.grad, rtol=1e-5, atol=1e-7)
    assert aux > 0


def test_a_capacity_factor_drops_the_latest_pairs_past_capacity_and_counts_them():
    torch.manual_seed(0)
    moe = MoE(16, 24, 4, 2, capacity_factor=0.5)  # each expert takes ceil(0.5 * 40 * 2 / 4) = 10 pairs
    out = moe(X.view(4, 10, 16)).view(40, 16)
    weights, experts, _ = moe.router(X)
    e = moe.experts
    taken = dict.fromkeys(range(4), 0)
    expected = torch.zeros(40, 16)
    for t in range(40):  # pairs in token order: an expert past its 10 takes no more
        for j, i in enumerate(experts[t].tolist()):
            if taken[i] < 10:
                taken[i] += 1
                h = F.linear(F.silu(F.linear(X[t], e.w1[i])) * F.linear(X[t], e.w3[i]), e.w2[i])
                expected[t] += weights[t, j] * h
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    demand = torch.bincount(experts.flatten(), minlength=4)
    assert float(moe.dropped) == float((demand - demand.clamp(max=10)).sum()) > 0
    assert expert_loads({"0": moe})["0"] == demand.float().tolist()  # the load is the routing's demand
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        MoE(16, 24, 4, 2, capacity_factor=0.0)


def test_the_bias_update_moves_toward_balance():
    moe = MoE(16, 24, 4, 1, score_func="sigmoid")
    loads = {"0": [70.0, 10.0, 10.0, 10.0]}
    update_expert_biases({"0": moe}, loads, 0.01)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    for _ in range(300):  # routed with the bias, the load evens out
        moe(X.view(4, 10, 16))
        update_expert_biases({"0": moe}, expert_loads({"0": moe}), 0.01)
    moe(X.view(4, 10, 16))
    assert max(expert_loads({"0": moe})["0"]) <= 15  # of 40: from a skewed start to near 10 each


def _train(spec):
    from tests._jobs import train

    return train(spec)


def _moe_job(tmp, aux_loss_coef=0.01, model="qwen3_moe", capacity_factor=None, **sections):
    from tests._jobs import tiny_llama_job

    overrides = {"aux_loss_coef": aux_loss_coef, "bias_update_rate": 0.001, "capacity_factor": capacity_factor}
    return tiny_llama_job(
        tmp, model={"name": model, "flavor": "tiny", "overrides": overrides},
        training={"steps": 6, "max_grad_norm": 1.0, **sections.pop("training", {})}, **sections,
    )  # fmt: skip


def test_data_parallel_moe_training_equals_one_process_and_resumes_exactly(ranks, tmp_path):
    """2 FSDP ranks (each on its half of the batch) and one process on the same halves as
    micro-batches: every step's loss, aux loss and expert loads agree, the routing biases
    included; a run stopped at step 3 and resumed gives the same last steps."""
    two = ranks(2).run(_train, _moe_job(tmp_path / "dp", checkpoint={"interval": 3}))[0]
    one = ranks(1).run(_train, _moe_job(tmp_path / "one", training={"grad_accum": 2}))[0]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=1e-5)
    assert [r["expert_load"] for r in two] == [r["expert_load"] for r in one]
    assert list(two[0]["expert_load"]) == ["1"] and sum(two[0]["expert_load"]["1"]) == 8 * 32 * 2  # tokens x top-2
    assert all(r["moe_aux_loss"] > 0 and r["expert_imbalance"] >= 1 for r in two)
    assert two[-1]["loss"] < two[0]["loss"]
    step3 = str(tmp_path / "dp" / "ckpt" / "step-00000003")
    resumed = ranks(2).run(_train, _moe_job(tmp_path / "again", checkpoint={"interval": 3, "resume_from": step3}))[0]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in two[3:]], abs=1e-6)
    assert [r["expert_load"] for r in resumed] == [r["expert_load"] for r in two[3:]]


@pytest.mark.parametrize(
    ("model", "world", "parallelism"),
    [
        ("qwen3_moe", 2, {"ep": 2}),
        ("qwen3_moe", 4, {"ep": 2}),
        ("qwen3_moe", 4, {"ep": 4}),
        ("qwen3_moe", 4, {"ep": 2, "tp": 2}),
        ("qwen3_moe", 4, {"ep": 2, "dp_replicate": 2}),
        ("deepseek_v3", 2, {"ep": 2}),
        ("deepseek_v3", 4, {"ep": 2, "tp": 2, "sequence_parallel": True}),
        ("capacity", 2, {"ep": 2}),
    ],
    ids=["ep2", "ep2xedp2", "ep4", "ep2xtp2", "hsdp2xep2", "deepseek-ep2", "deepseek-ep2xtp2-sp", "ep2-capacity"],
)
def test_expert_parallel_training_equals_one_process(ranks, tmp_path, model, world, parallelism):
    """Experts split over ep ranks, tokens exchanged with all-to-all, composed with FSDP (the
    experts' data-parallel copies averaging their gradients), tp and HSDP: every step's loss and
    expert loads equal one process's on the same micro-batches, biases and aux loss included."""
    dp = world // parallelism.get("tp", 1)
    capacity = 1.0 if model == "capacity" else None  # tokens dropped past capacity, the same ones
    model = "qwen3_moe" if model == "capacity" else model
    ep = ranks(world).run(_train, _moe_job(tmp_path / "ep", model=model, capacity_factor=capacity, parallelism=parallelism))[0]
    one = ranks(1).run(_train, _moe_job(tmp_path / "one", model=model, capacity_factor=capacity, training={"grad_accum": dp}))[0]
    if capacity:
        assert all(r["moe_dropped"] > 0 for r in ep) and [r["moe_dropped"] for r in ep] == [r["moe_dropped"] for r in one]
    assert [r["loss"] for r in ep] == pytest.approx([r["loss"] for r in one], abs=1e-5)
    assert [r["grad_norm"] for r in ep] == pytest.approx([r["grad_norm"] for r in one], abs=1e-5)
    assert [r["expert_load"] for r in ep] == [r["expert_load"] for r in one]


def _expert_parallel_layer(ep):
    import copy

    import torch.distributed as dist

    from hpservice.dtensor import init_device_mesh
    from hpservice.parallel.expert_parallel import ExpertParallel

    torch.manual_seed(0)
    ref = MoE(16, 24, 8, 2, route_norm=True)
    layer = copy.deepcopy(ref)
    ExpertParallel()._apply(layer.experts, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)))
    rank = dist.get_rank()
    assert layer.experts.w1.to_local().shape == (8 // ep, 24, 16)  # only this rank's experts
    mine = X.view(ep, -1, 16)[rank : rank + 1]  # each rank routes its own tokens, unevenly
    out = layer(mine)
    torch.testing.assert_close(out, ref(mine), rtol=0, atol=1e-6)
    out.square().sum().backward()
    ref.zero_grad()
    ref(X.view(ep, -1, 16)).square().sum().backward()  # every rank's tokens: the experts' whole gradient
    rows = slice(rank * 8 // ep, (rank + 1) * 8 // ep)
    torch.testing.assert_close(layer.experts.w2.grad.to_local(), ref.experts.w2.grad[rows], rtol=1e-5, atol=1e-6)
    return torch.bincount(ref.router(mine.reshape(-1, 16))[1].flatten(), minlength=8).tolist()


def test_an_expert_parallel_layer_computes_what_one_device_does(ranks):
    """Each rank holds 8 / ep experts; its tokens' outputs equal the unsplit layer's, and its
    experts' gradients hold every rank's tokens' contributions (before the data-parallel mean)."""
    loads = ranks(2).run(_expert_parallel_layer, 2)
    assert loads[0] != loads[1]  # the ranks sent uneven numbers of tokens to each expert


def _expert_shard(spec):
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    w1 = trainer.model.layers["1"].feed_forward.experts.w1
    shape = (tuple(w1.shape), tuple(w1.to_local().shape), sum(p.to_local().numel() for p in trainer.model.parameters()))
    trainer.close()
    return shape


def test_experts_are_split_over_ep_and_sharded_over_the_other_data_ranks(ranks, tmp_path):
    """On 4 ranks with ep 2 each rank holds 4 of the 8 experts, fully_shard splits them again over
    the 2 ranks holding the same experts (torchtitan's dp_shard_mod_ep): an eighth of the experts'
    weights per rank, as of everything else."""
    shards = ranks(4).run(_expert_shard, _moe_job(tmp_path, parallelism={"ep": 2}))
    assert all(s[0] == (8, 32, 64) and s[1] == (4, 16, 64) for s in shards), shards
    full = ranks(1).run(_expert_shard, _moe_job(tmp_path / "one"))[0]
    assert sum(s[2] for s in shards) == full[2]  # every parameter held once over the 4 ranks


def test_expert_parallel_checkpoints_reshard_between_ep_sizes(ranks, tmp_path):
    """A checkpoint of ep 2 resumes on ep 4 and on one process, and one of ep 4 on ep 2: the
    continued steps equal the uninterrupted run's (routing biases included; no aux loss, whose
    value depends on how the batch is split into micro-batches)."""

    def run(name, world, resume=None, **parallelism):
        checkpoint = {"interval": 2} if resume is None else {"interval": 2, "resume_from": str(tmp_path / resume)}
        spec = _moe_job(tmp_path / name, aux_loss_coef=0.0, parallelism=parallelism, checkpoint=checkpoint)
        return ranks(world).run(_train, spec)[0]

    full = run("ep2", 2, ep=2)
    on_ep4 = run("ep4", 4, "ep2/ckpt/step-00000002", ep=4)
    assert [r["step"] for r in on_ep4] == [3, 4, 5, 6]
    assert [r["loss"] for r in on_ep4] == pytest.approx([r["loss"] for r in full[2:]], abs=1e-5)
    on_one = run("one", 1, "ep2/ckpt/step-00000002")
    assert [r["loss"] for r in on_one] == pytest.approx([r["loss"] for r in full[2:]], abs=1e-5)
    back = run("back", 2, "ep4/ckpt/step-00000004", ep=2)
    assert [r["loss"] for r in back] == pytest.approx([r["loss"] for r in full[4:]], abs=1e-5)


def test_layouts_expert_parallelism_cannot_run_are_refused_before_anything_starts(tmp_path):
    from hpservice.preflight import check_layout
    from hpservice.spec import SpecError
    from tests._jobs import tiny_llama_job

    def errors(model, **parallelism):
        spec = tiny_llama_job(tmp_path, model=model, resources={"workers": 4}, parallelism=parallelism)
        return check_layout(spec)

    moe = {"name": "qwen3_moe", "flavor": "tiny"}
    assert errors(moe, ep=2) == [] and errors(moe, ep=4) == []
    assert errors(moe, ep=3) == [("parallelism", "ep 3 must divide dp_shard 4 (each layer's experts are split over ep "
                                                 "of the dp_shard ranks) (resources.workers is 4)")]  # fmt: skip
    assert errors({**moe, "overrides": {"num_experts": 6}}, ep=4) == [
        ("parallelism.ep", "4 does not divide the model's 6 experts per layer")
    ]
    assert errors({"name": "llama", "flavor": "tiny"}, ep=2)[0][1].startswith("2: the model has no mixture-of-experts")
    with pytest.raises(SpecError, match="ep > 1 with pp > 1 or cp > 1 is not built yet"):
        tiny_llama_job(tmp_path, model=moe, parallelism={"ep": 2, "pp": 2})


def test_activation_checkpointing_and_compile_train_moe_like_eager(ranks, tmp_path):
    """The recomputed forward of activation checkpointing routes the same way and is not counted
    twice in the loads; compiled blocks run the MoE layers eagerly between compiled parts."""
    eager = ranks(1).run(_train, _moe_job(tmp_path / "eager", training={"steps": 3}))[0]
    ac = ranks(1).run(_train, _moe_job(tmp_path / "ac", training={"steps": 3, "activation_checkpointing": "full"}))[0]
    compiled = ranks(1).run(_train, _moe_job(tmp_path / "compiled", training={"steps": 3, "compile": True}))[0]
    assert [r["loss"] for r in ac] == [r["loss"] for r in eager]
    assert [r["expert_load"] for r in ac] == [r["expert_load"] for r in eager]
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], abs=1e-5)


def test_pipeline_parallel_moe_training_equals_one_process(ranks, tmp_path):
    """pp 2 (the dense first block and the MoE block on different ranks, 2 micro-batches): every
    step's loss equals one process's on the same micro-batches, aux loss and bias updates included."""
    pp = ranks(2).run(_train, _moe_job(tmp_path / "pp", parallelism={"pp": 2}))
    one = ranks(1).run(_train, _moe_job(tmp_path / "one", training={"grad_accum": 2}))[0]
    assert [r["loss"] for r in pp[1]] == pytest.approx([r["loss"] for r in one], abs=1e-5)
    # the MoE block lives on the second stage; every rank's record (rank 0's is the one reported) has its loads
    assert [r["expert_load"] for r in pp[0]] == [r["expert_load"] for r in pp[1]] == [r["expert_load"] for r in one]
    assert [r["moe_aux_loss"] for r in pp[0]] == pytest.approx([r["moe_aux_loss"] for r in one], abs=1e-6)
