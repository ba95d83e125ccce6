"""Jobs with ``parallelism.pp`` train like one process: the same model (4 blocks) and global batch,
the loss and gradient norm of every step and the final weights equal to single-process training,
for every schedule, with FSDP and with tp, and a checkpoint of stages resumes at other pp sizes.

Measured against one process, fp32, 20 steps: losses and gradient norms within 1e-6 (the float32
rounding of a loss near 6), weights within 2e-5 (more micro-batches, or FSDP / tp, sum the gradient
in another order, and AdamW carries the rounding: largest on embedding rows that few tokens reach,
whose tiny gradients AdamW divides by a tiny second moment; with one micro-batch the run is bit for
bit one process's). Held to 2e-6 and 3e-5.
"""

import pytest

from hpservice.spec import SpecError, parse_job

STEPS = 20
MODEL = {"overrides": {"n_layers": 4}}


def _train(spec):
    """Losses and grad norms of every step, and this rank's stages' final weights (whole tensors)."""
    from hpservice.dtensor import DTensor
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    records = trainer.train()
    weights = {}
    for part in trainer.model_parts:
        for k, v in part.state_dict().items():
            weights[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return [(r["loss"], r["grad_norm"]) for r in records], weights


def _job(tmp, parallelism=None, training=None, **sections):
    from tests._jobs import tiny_llama_job

    return tiny_llama_job(
        tmp, model=MODEL, training={"steps": STEPS, **(training or {})}, parallelism=parallelism or {}, **sections
    )


_reference: dict = {}


def _one_process(ranks, tmp_path, training=None):
    key = repr(training)
    if key not in _reference:
        _reference[key] = ranks(1).run(_train, _job(tmp_path / "one", training=training))[0]
    return _reference[key]


def _assert_same_run(ours, one) -> None:
    (records, _), (records1, weights1) = ours[0], one
    weights = {k: v for _, w in ours for k, v in w.items()}  # every stage's, from its first rank
    assert len(records) == len(records1) == STEPS
    for (loss, norm), (loss1, norm1) in zip(records, records1, strict=True):
        assert loss == pytest.approx(loss1, abs=2e-6) and norm == pytest.approx(norm1, abs=2e-6), (records, records1)
    assert weights.keys() == weights1.keys()
    for k in weights1:
        assert (weights[k] - weights1[k]).abs().max().item() < 3e-5, k


@pytest.mark.parametrize(
    ("world", "parallelism", "training"),
    [
        (2, {"pp": 2, "pp_schedule": "gpipe"}, {}),
        (2, {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}, {}),
        (2, {"pp": 2, "pp_schedule": "zero_bubble"}, {}),
        (2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, {}),
        (2, {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2}, {}),
        (2, {"pp": 2, "pp_layers_per_stage": [3, 1]}, {"grad_accum": 2, "activation_checkpointing": "full"}),
        (4, {"pp": 4, "pp_microbatches": 4}, {}),
        (4, {"pp": 2, "dp_shard": 2}, {}),
        (4, {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "pp_schedule": "zero_bubble"}, {}),
        (4, {"pp": 2, "tp": 2}, {}),
        (4, {"pp": 2, "tp": 2, "sequence_parallel": True, "pp_schedule": "zero_bubble"}, {}),
    ],
    ids=["gpipe", "1f1b-m4", "zero-bubble", "interleaved-v2", "zero-bubble-v2", "uneven-accum-ac", "pp4", "pp2xfsdp2", "pp2xhsdp2-zb", "pp2xtp2", "pp2xtp2-sp-zb"],
)
def test_training_with_pipeline_parallelism_equals_one_process(ranks, tmp_path, world, parallelism, training):
    one = _one_process(ranks, tmp_path, training={"grad_accum": 2} if training.get("grad_accum") else None)
    ours = ranks(world).run(_train, _job(tmp_path / "pp", parallelism, training))
    if parallelism.get("tp", 1) > 1 or parallelism.get("dp_shard", 1) > 1 or parallelism.get("dp_replicate", 1) > 1:
        ours = [r for rank, r in enumerate(ours) if rank % (world // parallelism["pp"]) == 0]  # a stage's first rank
    _assert_same_run(ours, one)


def _losses(spec):
    return [loss for loss, _ in _train(spec)[0]]


def _whole_model_names() -> set[str]:
    import torch

    from hpservice.models import build_model

    with torch.device("meta"):
        return set(dict(build_model("llama", "tiny", MODEL["overrides"]).named_parameters()))


def test_a_checkpoint_of_pipeline_stages_resumes_at_other_pp_sizes(ranks, tmp_path):
    """Saved by pp 2 (each rank its stage's parameters and optimizer state, under the whole model's
    names), resumed on one process and on pp 4: steps 5-8 continue the uninterrupted run's losses."""
    from tests._jobs import tiny_llama_job

    sections = {"model": MODEL, "training": {"steps": 8}}
    run = tiny_llama_job(tmp_path, **sections, parallelism={"pp": 2}, checkpoint={"interval": 4})
    full = ranks(2).run(_losses, run)[0]
    step4 = tmp_path / "ckpt" / "step-00000004"
    from hpservice.checkpoint import CheckpointReader

    assert set(CheckpointReader(step4).load_model_tensors()) == _whole_model_names()  # what an HF export reads
    for world, parallelism in ((1, {}), (4, {"pp": 4, "pp_microbatches": 4})):
        again = tiny_llama_job(
            tmp_path / f"again-{world}", **sections, parallelism=parallelism, checkpoint={"resume_from": str(step4)}
        )
        resumed = ranks(world).run(_losses, again)[world - 1]  # the last stage's rank
        assert resumed == pytest.approx(full[4:], abs=1e-5), (world, resumed, full[4:])


def test_pipeline_stages_compile_and_train_in_bf16_like_one_process(ranks, tmp_path):
    """training.compile (each block of each stage compiled, fullgraph) and mixed_precision bf16
    (the stages pass bf16 activations and gradients) under pp 2, against one process
    with the same settings (bf16: the bound the cp and tp tests hold)."""
    from tests._jobs import tiny_llama_job

    sections = {"model": MODEL, "training": {"steps": 4, "compile": True}}
    bf16 = {"mixed_precision": "bf16"}
    # the reference on the pipeline's 2 micro-batches: its blocks see the stages' shapes, so the
    # kernels Inductor compiles cold for one serve the other
    one_process = {**sections, "training": {**sections["training"], "grad_accum": 2}}
    one = ranks(1).run(_losses, tiny_llama_job(tmp_path / "one", **one_process, parallelism=bf16))[0]
    pp = ranks(2).run(_losses, tiny_llama_job(tmp_path / "pp", **sections, parallelism={"pp": 2, **bf16}))[0]
    assert pp == pytest.approx(one, abs=1e-3), (pp, one)


def _val_losses(spec):
    from hpservice.train import Trainer

    return [r["val_loss"] for r in Trainer(spec, log_to_stdout=False).train() if "val_loss" in r]


def test_eval_through_the_pipeline_equals_one_process(ranks, tmp_path):
    """Evaluation's forwards through the stages, on a batch (6) that does not split evenly into
    the 4 micro-batches: the rows weigh the micro-batch losses."""
    from tests._jobs import tiny_llama_job

    sections = {"model": MODEL, "training": {"steps": 4}, "eval": {"interval": 2, "steps": 2, "data": {"global_batch": 6}}}
    one = ranks(1).run(_val_losses, tiny_llama_job(tmp_path / "one", **sections))[0]
    pp = ranks(2).run(_val_losses, tiny_llama_job(tmp_path / "pp", **sections, parallelism={"pp": 2, "pp_microbatches": 4}))
    assert pp[0] == pytest.approx(one, abs=1e-5) and pp[1] == pytest.approx(one, abs=1e-5)


def _raises(parallelism, match, **sections):
    with pytest.raises(SpecError, match=match):
        parse_job({"name": "x", "parallelism": parallelism, **sections})


def test_the_spec_refuses_pipeline_layouts_that_cannot_work():
    _raises({"pp": 2, "cp": 2}, r"pp > 1 with cp > 1 is not built yet")
    _raises({"pp_microbatches": 4}, r"parallelism\.pp_microbatches needs pp > 1")
    _raises({"pp": 2, "pp_virtual_stages": 2}, r"several stages per rank need pp_schedule interleaved_1f1b or zero_bubble, not 1f1b")
    _raises({"pp": 2, "pp_layers_per_stage": [1, 1, 1]}, r"pp_layers_per_stage \[1, 1, 1\]: expected 2 counts")


def test_preflight_names_what_a_pipeline_cannot_run():
    from hpservice.preflight import check_layout, check_model

    def errors(parallelism, training=None, model=None, workers=2, **sections):
        spec = parse_job(
            {
                "name": "x",
                "model": model or {"name": "llama", "flavor": "tiny"},
                "parallelism": parallelism,
                "training": training or {},
                "resources": {"workers": workers},
                **sections,
            }
        )
        return dict(check_layout(spec) + check_model(spec))

    assert errors({"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 1}) == {
        "parallelism.pp_schedule": "1f1b: micro-batches (1) must be >= pp (2) to fill the pipeline "
        "(parallelism.pp_microbatches x training.grad_accum = 1)"
    }
    assert errors({"pp": 4}, workers=4)["parallelism.pp"].startswith("parallelism.pp x pp_virtual_stages = 4 stages")
    assert "data.global_batch" in errors({"pp": 2, "pp_microbatches": 3}, data={"global_batch": 8})
    assert "tie_embeddings" in errors({"pp": 2}, model={"name": "llama", "flavor": "tiny", "overrides": {"tie_embeddings": True}})["parallelism.pp"]
    assert errors({"pp": 2}, model={"name": "llama", "flavor": "tiny"}) == {}


def test_a_model_split_into_stages_keeps_the_whole_models_parameter_names():
    import torch

    from hpservice.models import build_model
    from hpservice.parallel.pipelining import split_layers, split_model

    assert [list(r) for r in split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split_layers(4, 2, [3, 1])] == [[0, 1, 2], [3]]
    with torch.device("meta"):
        model = build_model("llama", "tiny", {"n_layers": 4})
    names = set(dict(model.named_parameters()))
    split = [part for rank in range(2) for _, part in split_model(model, rank, 2, virtual_stages=2)]
    assert [list(part.layers) for part in split] == [["0"], ["2"], ["1"], ["3"]]  # stage s on rank s % 2
    assert set().union(*(dict(p.named_parameters()) for p in split)) == names
    assert split[0].tok_embeddings is not None and split[0].output is None
    assert split[3].tok_embeddings is None and split[3].output is not None
