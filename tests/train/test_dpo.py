"""DPO against references we did not write: pairs tokenize as TRL's DPOTrainer tokenizes them
(standard and conversational forms), and training equals the DPO formula as TRL computes it, run
with transformers (+ peft) and torch.optim.AdamW in one process on the same pairs: per-step losses,
TRL's metrics and the final weights, on one rank and with dp 2 and gradient accumulation 2, for
LoRA with the adapters off as the reference and full fine-tuning with a frozen copy."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hpservice.spec import SpecError, parse_job
from tests.train._dpo_fixtures import make_base, make_pairs, make_tokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 3
BETA = 0.1


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    import peft
    import transformers

    tmp = tmp_path_factory.mktemp("dpo")
    tok, base = make_tokenizer(tmp / "tokenizer"), make_base(tmp / "base")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the base carries its tokenizer, as a hub model does
        (base / f).write_text((tok / f).read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(tmp / "adapter")
    return {"tok": tok, "base": base, "adapter": tmp / "adapter",
            "conv": make_pairs(tmp / "conv.jsonl", 16, True), "standard": make_pairs(tmp / "standard.jsonl", 16, False)}  # fmt: skip


def test_pairs_tokenize_as_trls_dpo_trainer(dirs, tmp_path):
    import datasets
    import transformers
    import trl

    from hpservice.data.chat import load_chat_tokenizer
    from hpservice.data.preference import encode_preferences

    hf_tok = transformers.AutoTokenizer.from_pretrained(dirs["tok"])
    for form in ("conv", "standard"):
        records = [json.loads(line) for line in dirs[form].read_text().splitlines()]
        args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], max_length=None, use_cpu=True, bf16=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(dirs["base"])
        theirs = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                                processing_class=hf_tok).train_dataset  # fmt: skip
        ours = encode_preferences([str(dirs[form])], load_chat_tokenizer(str(dirs["tok"])), seq_len=128)
        for i in range(len(records)):
            got = (ours.prompts[i].tolist(), ours.chosen[i].tolist(), ours.rejected[i].tolist())
            assert got == (list(theirs[i]["prompt_ids"]), list(theirs[i]["chosen_ids"]), list(theirs[i]["rejected_ids"])), (form, i)


def _spec(tmp, dirs, *, lora=True, parallelism=None, accum=1, loss_type="sigmoid", reference="auto", checkpoint=None):
    model = {"init_from": str(dirs["base"])}
    if lora:
        model.update(lora={"r": 4, "lora_alpha": 8.0, "target_modules": TARGETS}, init_adapter=str(dirs["adapter"]))
    return parse_job({
        "name": "dpo", "model": model,
        "data": {"kind": "preference", "path": str(dirs["conv"]), "seq_len": 48, "global_batch": 4},
        "objective": {"kind": "dpo", "beta": BETA, "loss_type": loss_type, "reference": reference},
        "training": {"steps": STEPS, "max_grad_norm": None, "grad_accum": accum},
        "optimizer": {"lr": 2e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "eps": 1e-6},
        "lr_scheduler": {"warmup_steps": 0, "decay": "constant"},
        "parallelism": parallelism or {},
        "metrics": {"dir": str(tmp)},
        "checkpoint": checkpoint or {},
    })  # fmt: skip


def _train(spec):
    from hpservice.dtensor import DTensor
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    batches = [trainer.data(s) for s in range(spec.training.steps)]
    records = trainer.train()
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for part in trainer.model_parts for k, v in part.named_parameters() if v.requires_grad}  # fmt: skip
    return records, [(b.inputs.cpu(), b.labels.cpu()) for b in batches], weights


def _trl_loss(logps, ref, counts, loss_type):
    """TRL 1.16's DPOTrainer._compute_loss, per pair, rows [c0, r0, c1, r1, ...]."""
    chosen, rejected = logps[0::2] - ref[0::2], logps[1::2] - ref[1::2]
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(BETA * (chosen - rejected))
    elif loss_type == "hinge":
        losses = torch.relu(1 - BETA * (chosen - rejected))
    else:  # ipo: TRL normalises each side's log-ratio by its completion length
        losses = (chosen / counts[0::2] - rejected / counts[1::2] - 1 / (2 * BETA)) ** 2
    return losses.mean(), BETA * chosen, BETA * rejected


def _logps(model, inputs, labels):
    logits = model(input_ids=inputs).logits.float()
    valid = labels != -100
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * valid).sum(1), valid.sum(1)


def _reference_run(dirs, batches, *, lora, loss_type, initial_adapter=False):
    """transformers (+ peft) and AdamW in one process: the policy, its reference, TRL's formula."""
    import copy

    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["base"], torch_dtype=torch.float32)
    if lora:
        policy = peft.PeftModel.from_pretrained(model, dirs["adapter"], is_trainable=True)
        # the policy with its adapters off (peft's disable_adapter), or a frozen copy of it as it starts
        reference = copy.deepcopy(policy).requires_grad_(False) if initial_adapter else None
    else:
        policy, reference = model, copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-3, betas=(0.9, 0.95), eps=1e-6,
                            weight_decay=0.0)  # fmt: skip
    out = []
    for inputs, labels in batches:
        with torch.no_grad():
            if reference is None:
                with policy.disable_adapter():
                    ref, _ = _logps(policy, inputs, labels)
            else:
                ref, _ = _logps(reference, inputs, labels)
        logps, counts = _logps(policy, inputs, labels)
        loss, chosen, rejected = _trl_loss(logps, ref, counts, loss_type)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append({"loss": loss.item(), "rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
                    "rewards/accuracies": (chosen > rejected).float().mean().item(),
                    "rewards/margins": (chosen - rejected).mean().item(), "logps/chosen": logps[0::2].mean().item(),
                    "logps/rejected": logps[1::2].mean().item()})  # fmt: skip
    return out, {k: v.detach() for k, v in policy.named_parameters() if v.requires_grad}


def _global_batches(outs, dp):
    """The step's global batch: the data-parallel ranks' rows, pairs kept in order."""
    return [tuple(torch.cat([o[1][s][i] for o in outs[:dp]]) for i in range(2)) for s in range(STEPS)]


CASES = [  # (world, parallelism, accum, lora, loss_type, reference)
    (1, {}, 1, True, "sigmoid", "adapters_off"),
    (1, {}, 1, True, "ipo", "adapters_off"),
    (1, {}, 1, True, "hinge", "adapters_off"),
    (2, {"dp_shard": 2}, 2, True, "sigmoid", "adapters_off"),
    (2, {"dp_shard": 2}, 1, True, "sigmoid", "auto"),  # from init_adapter: a frozen copy of the starting adapter
    (2, {"dp_shard": 2}, 2, False, "sigmoid", "auto"),  # full fine-tuning: a frozen copy of the model
    (2, {"tp": 2}, 1, True, "sigmoid", "adapters_off"),  # log-probabilities from vocabulary-sharded logits
    (2, {"cp": 2}, 1, True, "sigmoid", "auto"),  # each row's sums completed over its two sequence parts
    (2, {"pp": 2, "pp_microbatches": 2}, 1, True, "sigmoid", "adapters_off"),  # the last stage's loss
    (2, {"pp": 2, "pp_microbatches": 2}, 1, False, "sigmoid", "auto"),  # and the copy's own pipeline
]


@pytest.mark.parametrize(("world", "parallelism", "accum", "lora", "loss_type", "reference"), CASES,
                         ids=["lora-sigmoid", "lora-ipo", "lora-hinge", "lora-fsdp2-accum2", "lora-initial-adapter-fsdp2",
                              "full-fsdp2-accum2", "lora-tp2", "lora-initial-adapter-cp2", "lora-pp2", "full-pp2"])  # fmt: skip
def test_dpo_trains_as_trls_formula_in_one_process(ranks, tmp_path, dirs, world, parallelism, accum, lora, loss_type, reference):
    spec = _spec(tmp_path, dirs, lora=lora, parallelism=parallelism, accum=accum, loss_type=loss_type, reference=reference)
    outs = ranks(world).run(_train, spec)
    records = outs[0][0]
    starts_at_reference = reference == "auto"  # the reference is the policy as it starts
    want, want_weights = _reference_run(dirs, _global_batches(outs, parallelism.get("dp_shard", 1)), lora=lora,
                                        loss_type=loss_type, initial_adapter=lora and starts_at_reference)  # fmt: skip
    # from the reference: no margin at the first step, then policy and reference part
    assert abs(want[-1]["rewards/margins"]) > 1e-4
    assert (abs(want[0]["rewards/margins"]) < 1e-6) == starts_at_reference
    for got, exp in zip(records, want, strict=True):
        for k, v in exp.items():
            # log-probabilities are sums over ~30 tokens (~-40 nats): fp32's sums agree to 1e-6 of them
            assert got[k] == pytest.approx(v, abs=1e-5, rel=1e-6 if k.startswith("logps/") else 0), (k, got[k], v)
    weights = {k: v for o in outs for k, v in o[2].items()}
    if lora:
        from hpservice.models.hf import config_from_hf
        from hpservice.models.peft_adapter import peft_tensors

        cfg = config_from_hf(dirs["base"])
        for k, v in weights.items():
            module, which = k.rsplit(".", 1)
            for key, value in peft_tensors(module, which, v, cfg).items():
                exp = want_weights[key.replace(f".{which}.weight", f".{which}.default.weight")]
                assert (value - exp).abs().max().item() < 1e-5, key
    else:
        from hpservice.models.hf import config_from_hf, hf_tensors

        cfg = config_from_hf(dirs["base"])
        for k, v in weights.items():
            for key, value in hf_tensors(k, v, cfg).items():
                assert (value - want_weights[key]).abs().max().item() < 1e-5, key


def test_dpo_refusals_name_the_field(dirs, tmp_path):
    with pytest.raises(SpecError, match=r"objective\.reference"):
        _spec(tmp_path, dirs, lora=False, reference="adapters_off")
    with pytest.raises(SpecError, match=r"eval\.interval"):
        parse_job({"name": "x", "objective": {"kind": "dpo"}, "data": {"kind": "preference", "path": "p"},
                   "eval": {"interval": 2, "data": {"kind": "preference", "path": "p"}}})  # fmt: skip
    with pytest.raises(SpecError, match=r"objective\.beta"):
        parse_job({"name": "x", "objective": {"kind": "dpo", "beta": 0}, "data": {"kind": "preference", "path": "p"}})
    with pytest.raises(SpecError, match=r"objective\.kind"):
        parse_job({"name": "x", "objective": {"kind": "dpo"}})
    from hpservice.data.chat import load_chat_tokenizer
    from hpservice.data.preference import encode_preferences

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": " b"}) + "\n" + json.dumps({"prompt": "a", "chosen": " b", "rejected": " b"}) + "\n")
    tok = load_chat_tokenizer(str(dirs["tok"]))
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: rejected: missing"):
        encode_preferences([str(bad)], tok, seq_len=32)
    with pytest.raises(ValueError, match=r"no usable preference pair"):  # both skipped, counted
        encode_preferences([str(bad)], tok, seq_len=32, on_bad_record="skip")
    # before start (validate, submit): a sample of the file, naming the field, the file and line
    from hpservice.preflight import check_inputs

    spec = parse_job({"name": "x", "model": {"init_from": str(dirs["base"])}, "objective": {"kind": "dpo"},
                      "data": {"kind": "preference", "path": str(bad)}})  # fmt: skip
    assert dict(check_inputs(spec))["data.path"] == f"{bad}:1: rejected: missing (preference pairs)"


@pytest.mark.parametrize(("lora", "live", "parallelism"),
                         [(False, "copy", {"dp_shard": 2}), (True, "initial_adapter", {"dp_shard": 2}),
                          (True, "initial_adapter", {"cp": 2}), (True, "initial_adapter", {"pp": 2, "pp_microbatches": 2})],
                         ids=["full", "lora", "lora-cp2", "lora-pp2"])  # fmt: skip
def test_a_precomputed_reference_trains_as_the_live_one(ranks, tmp_path, dirs, lora, live, parallelism):
    """reference: precomputed (the policy's log-probabilities as it starts, one pass before
    training) and the live reference give the same training, on 2 ranks (accumulation 2)."""
    runs = {}
    for reference in (live, "precomputed"):
        spec = _spec(tmp_path / reference, dirs, lora=lora, parallelism=parallelism, accum=2, reference=reference)
        runs[reference] = ranks(2).run(_train, spec)
    (a, _, wa), (b, _, wb) = runs[live][0], runs["precomputed"][0]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-6)
    assert [r["rewards/margins"] for r in a] == pytest.approx([r["rewards/margins"] for r in b], abs=1e-6)
    pairs = 4 // parallelism.get("dp_shard", 1)  # a rank's pairs a step, 2 rows each, fp32
    holder = b if parallelism.get("pp", 1) == 1 else runs["precomputed"][-1][0]  # the last stage holds them
    assert holder[0]["reference_gib"] * 2**30 == 4 * 2 * pairs * STEPS
    for k in wa:
        assert (wa[k] - wb[k]).abs().max().item() < 1e-6, k


@pytest.mark.parametrize(("lora", "reference"), [(True, "auto"), (False, "precomputed")], ids=["lora-initial-adapter", "full-precomputed"])
def test_dpo_resumes_exactly_with_its_reference(ranks, tmp_path, dirs, lora, reference):
    """Checkpointed at step 1 on 2 ranks, resumed on 1: steps 2-3 equal the uninterrupted run's (the
    reference is rebuilt from the job's inputs before the checkpoint is loaded)."""
    whole = _spec(tmp_path / "a", dirs, lora=lora, parallelism={"dp_shard": 2}, reference=reference,
                  checkpoint={"dir": str(tmp_path / "a" / "ckpt"), "interval": 1})  # fmt: skip
    full = ranks(2).run(_train, whole)[0]
    step1 = tmp_path / "a" / "ckpt" / "step-00000001"
    resumed = ranks(1).run(_train, _spec(tmp_path / "b", dirs, lora=lora, reference=reference,
                                         checkpoint={"resume_from": str(step1)}))[0]  # fmt: skip
    assert [r["loss"] for r in resumed[0]] == pytest.approx([r["loss"] for r in full[0][1:]], abs=1e-6)
    assert [r["rewards/margins"] for r in resumed[0]] == pytest.approx([r["rewards/margins"] for r in full[0][1:]], abs=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_the_first_step_equals_trls_dpo_trainer_loss(ranks, tmp_path, dirs, loss_type):
    """TRL's own DPOTrainer.compute_loss on the same pairs, model and adapter, with the base model as
    its reference, equals our first step's loss and rewards with the adapters off as the reference.
    (Given a peft model and no reference, TRL keeps a copy of the starting adapter as the reference:
    our initial_adapter, whose first step is log 2 on both sides.)"""
    import datasets
    import peft
    import transformers
    import trl

    pairs = make_pairs(tmp_path / "four.jsonl", 4, True, seed=3)  # one step's global batch: every pair
    spec = _spec(tmp_path, {**dirs, "conv": pairs}, loss_type=loss_type, reference="adapters_off")
    ours = ranks(1).run(_train, spec)[0][0][0]
    policy = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(dirs["base"]),
                                            dirs["adapter"], is_trainable=True)  # fmt: skip
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True, bf16=False,
                         beta=BETA, loss_type=[loss_type], per_device_train_batch_size=4)  # fmt: skip
    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs["base"])
    trainer = trl.DPOTrainer(model=policy, ref_model=base, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=transformers.AutoTokenizer.from_pretrained(dirs["tok"]))  # fmt: skip
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, batch).item()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert ours["loss"] == pytest.approx(theirs, abs=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[k] == pytest.approx(metrics[k], abs=1e-5), k


def test_a_hostile_template_is_bounded_in_time(dirs, tmp_path, monkeypatch):
    """A chat template is a tenant's code: a record whose rendering outlasts the bound is a bad
    record (stop naming it, or skip and count), never a stalled job."""
    import shutil

    from hpservice.data import preference
    from hpservice.data.chat import load_chat_tokenizer

    tok = tmp_path / "tok"
    shutil.copytree(dirs["tok"], tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(preference, "TEMPLATE_SECONDS", 0.5)
    pairs = make_pairs(tmp_path / "two.jsonl", 2, True)
    with pytest.raises(ValueError, match=r"two\.jsonl:1: record: rendering and tokenizing it took longer than 0\.5 s"):
        preference.encode_preferences([str(pairs)], load_chat_tokenizer(str(tok)), seq_len=64)
