"""LoRA against peft, the reference we did not write: a tiny Qwen3 and a tiny Llama saved by
transformers, an adapter made by peft (random non-zero B) and imported with model.init_adapter.
Logits equal peft's; 5 AdamW steps from it equal peft + transformers + torch.optim.AdamW in one
process (losses and adapter weights to 1e-5, fp32), on 1 rank and on 2 with fully_shard and with
pp 2; the base weights stay bit for bit; the PEFT export loads back into peft with our logits."""

from __future__ import annotations

import json

import pytest
import torch

from hpservice.spec import SpecError, parse_job

STEPS = 5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_model(path, family):
    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    torch.manual_seed(0)
    cfg = cls(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False, **extra)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _adapter(base, out, r=4, alpha=8.0, targets=TARGETS):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(out)
    return out


_CHECKPOINTS: dict[str, tuple] = {}


def _checkpoint(family: str, tmp_path_factory) -> tuple:
    """A tiny Hugging Face base of ``family`` and a PEFT adapter for it, made once per session."""
    if family not in _CHECKPOINTS:
        tmp = tmp_path_factory.mktemp(f"lora-{family}")
        base = _hf_model(tmp / "base", family)
        _CHECKPOINTS[family] = (base, _adapter(base, tmp / "adapter"))
    return _CHECKPOINTS[family]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory)


def _spec(tmp, base, adapter, parallelism=None, steps=STEPS, training=None, checkpoint=None, **model):
    return parse_job({
        "name": "lora",
        "model": {"init_from": str(base), "lora": {"r": 4, "lora_alpha": 8.0, "target_modules": TARGETS},
                  "init_adapter": str(adapter), **model},
        "data": {"kind": "synthetic", "seq_len": 16, "global_batch": 4},
        "training": {"steps": steps, "max_grad_norm": None, **(training or {})},
        "optimizer": {"lr": 2e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "eps": 1e-8},
        "lr_scheduler": {"warmup_steps": 0, "decay": "constant"},
        "parallelism": parallelism or {},
        "metrics": {"dir": str(tmp)},
        "checkpoint": {"dir": str(tmp / "ckpt"), "interval": steps, **(checkpoint or {})},
    })  # fmt: skip


def _train(spec):
    """Per-step losses and batches, the final weights (whole tensors), and logits of batch 0 before training."""
    from hpservice.dtensor import DTensor
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    batches = [trainer.data(s) for s in range(spec.training.steps)]
    records = trainer.train()
    weights, layouts = {}, {}
    for part in trainer.model_parts:
        for k, v in part.state_dict().items():
            weights[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            if isinstance(v, DTensor):
                layouts[k] = tuple(v.placements)
    return [r["loss"] for r in records], [(b.inputs.cpu(), b.labels.cpu()) for b in batches], weights, layouts


def _peft_reference(base, adapter, batches, eps=1e-8):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3, betas=(0.9, 0.95), eps=eps,
                            weight_decay=0.0)  # fmt: skip
    losses = []
    for inputs, labels in batches:
        logits = model(input_ids=inputs).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items() if "lora_" in k}


def _ours_as_peft(weights, base):
    """Our final adapter weights under PEFT's keys (the export's mapping)."""
    from hpservice.models.hf import config_from_hf
    from hpservice.models.peft_adapter import peft_tensors

    cfg = config_from_hf(base)
    out = {}
    for k, v in weights.items():
        if k.endswith((".lora_A", ".lora_B")):
            module, which = k.rsplit(".", 1)
            out.update(peft_tensors(module, which, v, cfg))
    return out


def test_logits_with_an_imported_peft_adapter_equal_peft(checkpoint):
    import peft
    import transformers

    from hpservice.models import build_model
    from hpservice.models.hf import load_hf_weights
    from hpservice.models.lora import LoraSettings, apply_lora
    from hpservice.models.peft_adapter import load_adapter

    base, adapter = checkpoint
    ours = build_model(None, device="cpu", init_from=str(base))
    apply_lora(ours, LoraSettings(4, 8.0, 0.0, tuple(TARGETS)))
    load_hf_weights(ours, base)
    assert load_adapter(ours, adapter) == 2 * 7 * 2  # A and B of 7 layers in 2 blocks
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(base)(tokens).logits
        want = theirs(tokens).logits
        got = ours(tokens)
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


_LAYOUTS = {"one": (1, {}), "fsdp2": (2, {"dp_shard": 2}), "tp2": (2, {"tp": 2}), "pp2": (2, {"pp": 2}),
            "fsdp2-tp2": (4, {"dp_shard": 2, "tp": 2}), "fsdp2-ac": (2, {"dp_shard": 2, "training": {"activation_checkpointing": "full"}})}  # fmt: skip
# every layout on Qwen3 (the everyday fine-tuning family); Llama's naming and rotary layout on the
# layouts that move its tensors differently (one process, fully_shard, pipeline stages)
_CASES = [("qwen3", name) for name in _LAYOUTS] + [("llama", name) for name in ("one", "fsdp2", "pp2")]


@pytest.mark.parametrize(("family", "layout"), _CASES, ids=[f"{f}-{n}" for f, n in _CASES])
def test_training_an_adapter_equals_peft_and_adamw_in_one_process(ranks, tmp_path, tmp_path_factory, family, layout):
    base, adapter = _checkpoint(family, tmp_path_factory)
    world, parallelism = _LAYOUTS[layout]
    parallelism = dict(parallelism)
    training = parallelism.pop("training", None)
    outs = ranks(world).run(_train, _spec(tmp_path, base, adapter, parallelism, training=training))
    losses = outs[-1][0]  # the last pp stage reports the loss
    if parallelism.get("dp_shard", 1) > 1:  # the global batch: the data-parallel ranks' rows
        dp_ranks = outs[:: parallelism.get("tp", 1)]
        batches = [tuple(torch.cat([o[1][s][i] for o in dp_ranks]) for i in range(2)) for s in range(STEPS)]
    else:
        batches = outs[0][1]
    weights = {k: v for o in outs for k, v in o[2].items()}
    if parallelism.get("tp", 1) > 1:  # adapters placed as their base layer: colwise wq, rowwise wo
        from hpservice.dtensor import Replicate, Shard

        layouts = outs[0][3]
        tp = {k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1]: v[-1] for k, v in layouts.items()}  # the tp dim's
        assert (tp["wq.lora_A"], tp["wq.lora_B"], tp["wo.lora_A"], tp["wo.lora_B"]) == (
            Replicate(), Shard(0), Shard(1), Replicate()
        )
    want_losses, want_adapter = _peft_reference(base, adapter, batches)
    assert losses == pytest.approx(want_losses, abs=1e-5), (losses, want_losses)
    got = _ours_as_peft(weights, base)
    assert {k.replace(".default", "") for k in want_adapter} == set(got)
    for k, v in want_adapter.items():
        assert (got[k.replace(".default", "")] - v).abs().max().item() < 1e-5, (k, (got[k.replace(".default", "")] - v).abs().max().item())
    from safetensors.torch import load_file

    hf_base = load_file(str(next(base.glob("*.safetensors"))))
    from hpservice.models.hf import config_from_hf, hf_tensors

    cfg = config_from_hf(base)
    for k, v in weights.items():  # the base stays bit for bit
        if not k.endswith((".lora_A", ".lora_B")):
            for hk, hv in hf_tensors(k, v, cfg).items():
                assert torch.equal(hv, hf_base[hk]), hk


def test_the_peft_export_loads_into_peft_with_our_logits(ranks, tmp_path, checkpoint):
    import peft
    import transformers

    from hpservice.cli import main

    base, adapter = checkpoint
    spec = _spec(tmp_path, base, adapter, steps=2)
    ranks(1).run(_train, spec)
    step = sorted((tmp_path / "ckpt").glob("step-*"))[-1]
    assert main(["export", "--format", "peft", str(step), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(TARGETS))
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "out").eval()
    assert main(["export", "--format", "hf", str(step), str(tmp_path / "merged")]) == 0  # merged in fp32
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, theirs(tokens).logits, atol=1e-5, rtol=1e-5)


def test_checkpoints_hold_the_adapters_only_and_resume_exactly_on_another_layout(ranks, tmp_path, checkpoint):
    """A LoRA run on a pretrained base checkpoints its adapters and their optimizer state only (the
    base is model.init_from's, identified by its fingerprint): resumed from step 2 of a fully_shard
    run on one rank, steps 3-4 and the final adapters equal the uninterrupted run's."""
    import shutil

    from hpservice.checkpoint import CheckpointReader
    from hpservice.launch import RankFailure

    base, adapter = checkpoint
    full = ranks(2).run(_train, _spec(tmp_path / "a", base, adapter, {"dp_shard": 2}, steps=4, checkpoint={"interval": 2}))
    step2 = tmp_path / "a" / "ckpt" / "step-00000002"
    with CheckpointReader(step2).opened() as (reader, _, _):
        saved = {v[1] for v in reader.read_metadata().planner_data.values() if v[0] == "model"}
    assert saved and all(k.endswith((".lora_A", ".lora_B")) for k in saved), sorted(saved)[:5]
    resumed = ranks(1).run(_train, _spec(tmp_path / "b", base, adapter, steps=4, checkpoint={"resume_from": str(step2)}))[0]
    assert resumed[0] == pytest.approx(full[0][0][2:], abs=1e-6)
    want = {k: v for o in full for k, v in o[2].items()}
    for k, v in resumed[2].items():
        assert (v - want[k]).abs().max().item() < 1e-6, k
    other = tmp_path / "other-base"  # the same tensors under another config: not the adapters' base
    shutil.copytree(base, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "note": "another base"}))
    with pytest.raises(RankFailure, match=r"TrainingError: checkpoint\.resume_from: its adapters were trained on the base"):
        ranks(1).run(_train, _spec(tmp_path / "c", other, adapter, steps=4, checkpoint={"resume_from": str(step2)}))


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"r": 0, "lora_alpha": 8}, "model.lora.r"),
        ({"r": 4, "lora_alpha": 0}, "model.lora.lora_alpha"),
        ({"r": 4, "lora_alpha": 8, "bias": "all"}, "model.lora.bias"),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field(lora, field):
    with pytest.raises(SpecError) as e:
        parse_job({"name": "x", "model": {"name": "llama", "lora": lora}})
    assert any(path == field for path, _ in e.value.errors), e.value.errors


def _moe_spec(tmp, parallelism, targets):
    return parse_job({
        "name": "moe-lora",
        "model": {"name": "qwen3_moe", "flavor": "tiny", "lora": {"r": 4, "lora_alpha": 8, "target_modules": targets}},
        "data": {"kind": "synthetic", "seq_len": 16, "global_batch": 4},
        "training": {"steps": 3, "max_grad_norm": None},
        "parallelism": parallelism,
        "metrics": {"dir": str(tmp)},
    })  # fmt: skip


def _moe_train(spec):
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    records = trainer.train()
    trained = sorted(n for p in trainer.model_parts for n, q in p.named_parameters() if q.requires_grad)
    return [r["loss"] for r in records], trained


def test_adapters_on_the_dense_layers_of_an_expert_parallel_model_train_like_one_process(ranks, tmp_path):
    """ep 2: adapters on attention and the dense MLPs; the routed experts and the router stay frozen.
    PEFT's all-linear would adapt those too, so on a model with routed experts it is refused."""
    from hpservice.preflight import check_composition

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    want, trained = ranks(1).run(_moe_train, _moe_spec(tmp_path / "one", {}, targets))[0]
    got, trained_ep = ranks(2).run(_moe_train, _moe_spec(tmp_path / "ep", {"dp_shard": 2, "ep": 2}, targets))[0]
    assert trained == trained_ep and all(n.endswith((".lora_A", ".lora_B")) for n in trained)
    assert not any("experts." in n or "router" in n for n in trained)
    assert got == pytest.approx(want, abs=1e-5)
    refused = dict(check_composition(_moe_spec(tmp_path, {"dp_shard": 2, "ep": 2}, "all-linear")))
    assert "routed experts" in refused["model.lora.target_modules"]


def test_what_is_knowable_before_start_is_refused_naming_the_field_and_value(tmp_path, checkpoint):
    from hpservice.preflight import check_composition, check_inputs

    base, adapter = checkpoint

    def errors(lora, **model):
        spec = parse_job({"name": "x", "model": {"init_from": str(base), "lora": lora, **model}})
        return dict(check_composition(spec) + check_inputs(spec))

    assert "match no linear layer" in errors({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "qkv"]})["model.lora.target_modules"]
    assert "is above layers.0.attention.wq's width" in errors({"r": 1000, "lora_alpha": 8})["model.lora.r"]
    mismatch = errors({"r": 8, "lora_alpha": 8.0, "target_modules": TARGETS}, init_adapter=str(adapter))
    assert mismatch == {"model.lora.r": f"8, but the adapter at {adapter} has 4"}
    pickled = tmp_path / "pickled"  # an adapter saved as adapter_model.bin (a pickle) is never read
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    bad = errors({"r": 4, "lora_alpha": 8.0, "target_modules": TARGETS}, init_adapter=str(pickled))
    assert "adapter_model.bin, a pickle, is never read" in bad["model.init_adapter"]


def _first_lines(spec):
    from hpservice.train import Trainer

    lines: list[str] = []
    Trainer(spec, log_fn=lines.append, log_to_stdout=False).close()
    return lines


def test_the_job_log_says_how_many_parameters_train(ranks, tmp_path):
    # a fresh adapter on a seeded model (no init_from): PEFT's init, the count in the first lines
    spec = parse_job({"name": "l", "model": {"name": "llama", "flavor": "tiny", "lora": {"r": 4, "lora_alpha": 8}},
                      "metrics": {"dir": str(tmp_path)}})  # fmt: skip
    lines = ranks(1).run(_first_lines, spec)[0]
    assert any("LoRA r=4 on 14 layers:" in line and "trainable parameters of" in line for line in lines), lines


def _memory_record(spec):
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    record = trainer.train()[-1]
    trained = sum(1 for p in trainer.model_parts for q in p.parameters() if q.requires_grad)
    return {k: record[k] for k in ("trainable_params", "total_params", "params_gib", "grads_gib", "optimizer_state_gib")}, trained


@pytest.mark.parametrize("lora", [None, {"r": 4, "lora_alpha": 8}], ids=["full", "lora"])
def test_the_step_record_says_what_the_training_state_holds_per_rank(ranks, tmp_path, lora):
    """fsdp 2, fp32, AdamW: parameters, gradients and optimizer state per rank equal the counts
    (two moments per trainable element and a step scalar per parameter); LoRA trains its adapters only."""
    spec = parse_job({"name": "m", "model": {"name": "llama", "flavor": "tiny", **({"lora": lora} if lora else {})},
                      "data": {"kind": "synthetic", "seq_len": 16, "global_batch": 4}, "training": {"steps": 1},
                      "parallelism": {"dp_shard": 2}, "metrics": {"dir": str(tmp_path)}})  # fmt: skip
    from hpservice.models import build_model

    (got, trained), _ = ranks(2).run(_memory_record, spec)
    whole = build_model("llama", "tiny", {}, device="meta")
    total = sum(p.numel() for p in whole.parameters())
    linear = [m for n, m in whole.named_modules() if n.rsplit(".", 1)[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")]
    trainable = sum(4 * (m.in_features + m.out_features) for m in linear) if lora else total
    assert (got["trainable_params"], got["total_params"]) == (trainable, total + (trainable if lora else 0))
    # fully_shard splits every tensor's dim 0 over 2 ranks (the tiny model's are even): half per rank
    gib = 2**30
    assert got["params_gib"] * gib == pytest.approx(got["total_params"] * 4 / 2)
    assert got["grads_gib"] * gib == pytest.approx(trainable * 4 / 2)
    assert got["optimizer_state_gib"] * gib == pytest.approx(trainable * 8 / 2 + 4 * trained)  # exp_avg, exp_avg_sq, step


def test_the_api_exports_a_lora_jobs_adapter_and_its_merged_model(ranks, tmp_path, checkpoint):
    """POST .../checkpoints/{step}/export?format=peft writes the adapter into the job's exports/,
    ?format=hf the merged model (its base read from the run's model.init_from)."""
    import peft
    import transformers
    from fastapi.testclient import TestClient

    from hpservice.api import Settings, create_app
    from hpservice.api.admission import job_dir
    from hpservice.api.settings import Principal

    base, adapter = checkpoint
    settings = Settings(data_dir=tmp_path / "data", tokens={"alice-token-0123456789": Principal("alice")})
    alice = {"Authorization": "Bearer alice-token-0123456789"}
    with TestClient(create_app(settings, connect_ray=False, supervise=False)) as c:
        job = c.post("/v1/jobs", json={"name": "t", "training": {"steps": 2}}, headers=alice).json()
        home = job_dir(settings, "alice", job["id"])
        ranks(1).run(_train, _spec(home, base, adapter, steps=2))  # what the job's workers would have written
        step = str(home / "ckpt" / "step-00000002")
        c.app.state.store.update_status(job["id"], {"state": "SUCCEEDED", "checkpoints": [{"step": 2, "path": step}]})
        got = {}
        for fmt in ("peft", "hf"):
            r = c.post(f"/v1/jobs/{job['id']}/checkpoints/2/export?format={fmt}", headers=alice)
            assert r.status_code == 200, r.text
            got[fmt] = r.json()["path"]
            assert got[fmt] == str(home / "exports" / f"step-00000002-{fmt}")
        assert c.post(f"/v1/jobs/{job['id']}/checkpoints/2/export?format=bin", headers=alice).status_code == 422
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), got["peft"]).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(got["hf"]).eval()
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, theirs(tokens).logits, atol=1e-5, rtol=1e-5)


def test_generation_runs_with_an_adapter_as_peft_generates(ranks, tmp_path, checkpoint):
    """hpservice generate's model: a Hugging Face base with --adapter, and a LoRA run's own
    (adapter-only) checkpoint on the base it records; greedy tokens equal peft's generate."""
    import peft
    import transformers

    from hpservice.cli.local import _load_for_generation
    from hpservice.models.generate import generate

    base, adapter = checkpoint
    prompt = [5, 17, 42, 9]

    def peft_tokens(adapter_dir):
        model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter_dir).eval()
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        return out[0, len(prompt):].tolist()

    model, _ = _load_for_generation(str(base), str(adapter))
    assert generate(model, prompt, 8) == peft_tokens(adapter)
    ranks(1).run(_train, _spec(tmp_path, base, adapter, steps=2))
    step = tmp_path / "ckpt" / "step-00000002"
    from hpservice.models.hf import export_checkpoint_peft

    export_checkpoint_peft(step, tmp_path / "trained")
    model, _ = _load_for_generation(str(step))
    assert generate(model, prompt, 8) == peft_tokens(tmp_path / "trained")
    with pytest.raises(ValueError, match="a LoRA run's step-N checkpoint has its own"):
        _load_for_generation(str(step), str(adapter))


class _Custom(torch.nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.fc1, self.fc2, self.head = torch.nn.Linear(width, 32), torch.nn.Linear(32, width), torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        return self.head(h + self.fc2(torch.relu(self.fc1(h))))


def custom_model() -> torch.nn.Module:
    return _Custom()


def _trained_and_base(spec):
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    before = {k: v.full_tensor().clone() for k, v in trainer.model.state_dict().items() if ".lora_" not in k}
    trainer.train()
    after = {k: v.full_tensor() for k, v in trainer.model.state_dict().items() if ".lora_" not in k}
    trained = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    return trained, all(torch.equal(before[k], after[k]) for k in before)


def test_a_custom_models_linear_layers_take_adapters_by_their_own_names(ranks, tmp_path):
    """A factory model: all-linear adapts every nn.Linear but the head (fc1, fc2), names are its own;
    only the adapters train and the base stays bit for bit, under fully_shard."""
    spec = parse_job({"name": "custom", "model": {"name": "tests.models.test_lora:custom_model", "flavor": None,
                                                  "lora": {"r": 2, "lora_alpha": 4}},
                      "data": {"kind": "synthetic", "seq_len": 8, "global_batch": 4, "vocab_size": 64},
                      "training": {"steps": 2}, "parallelism": {"dp_shard": 2}, "metrics": {"dir": str(tmp_path)}})  # fmt: skip
    trained, base_unchanged = ranks(2).run(_trained_and_base, spec)[0]
    assert trained == ["fc1.lora_A", "fc1.lora_B", "fc2.lora_A", "fc2.lora_B"] and base_unchanged
    with pytest.raises(ValueError, match=r"\['q_proj'\] match no linear layer of this model; its linear layers: fc1, fc2, head"):
        from hpservice.models.lora import lora_targets

        lora_targets(_Custom(), ["q_proj"])


def test_the_base_fingerprint_never_looks_outside_the_base(tmp_path, checkpoint):
    """An index naming a file outside the base's directory is refused, not measured."""
    import shutil

    from hpservice.models.hf import HFFormatError, base_fingerprint

    base, _ = checkpoint
    hostile = tmp_path / "hostile"
    shutil.copytree(base, hostile)
    (tmp_path / "secret.safetensors").write_bytes(b"x" * 100)
    (hostile / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    assert base_fingerprint(base) == base_fingerprint(base)
    with pytest.raises(HFFormatError, match="outside the checkpoint's directory"):
        base_fingerprint(hostile)
