"""QLoRA (model.lora.quantize_base: nf4) against the reference we did not write: the frozen
base's adapted weights held in torchao's NF4 equal peft + transformers computing on the same base
with those weights replaced by torchao's dequantised NF4 values (logits, 3 AdamW steps on 1 rank
and with fully_shard over 2), and the refusals name the field."""

from __future__ import annotations

import pytest
import torch

from hpservice.spec import parse_job
from tests.models.test_lora import _ours_as_peft, _peft_reference

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 3


def _hf_model(path):
    """A tiny Qwen3 whose linear weights NF4's blocks divide (64 x 256 elements), halves included."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=8, head_dim=32, vocab_size=128, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _dequantised_base(base, out):
    """The base with each adapted weight replaced by torchao's NF4 round trip of it: what QLoRA computes with."""
    import transformers
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS:
                module.weight.copy_(to_nf4(module.weight.detach(), 64, 256).get_original_weight())
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    import peft
    import transformers

    tmp = tmp_path_factory.mktemp("qlora")
    base = _hf_model(tmp / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(tmp / "adapter")
    return base, tmp / "adapter", _dequantised_base(base, tmp / "dequantised")


def _spec(tmp, base, adapter, parallelism=None, quantize="nf4", **extra):
    return parse_job({
        "name": "qlora",
        "model": {"init_from": str(base), "init_adapter": str(adapter),
                  "lora": {"r": 4, "lora_alpha": 8.0, "target_modules": TARGETS, "quantize_base": quantize}},
        "data": {"kind": "synthetic", "seq_len": 16, "global_batch": 4},
        "training": {"steps": STEPS, "max_grad_norm": None},
        "optimizer": {"lr": 2e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "eps": 1e-6},
        "lr_scheduler": {"warmup_steps": 0, "decay": "constant"},
        "parallelism": parallelism or {},
        "metrics": {"dir": str(tmp)},
        **extra,
    })  # fmt: skip


def _train(spec):
    from hpservice.dtensor import DTensor
    from hpservice.models.lora import is_nf4
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    batches = [trainer.data(s) for s in range(spec.training.steps)]
    nf4 = sum(is_nf4(p) for part in trainer.model_parts for p in part.parameters())
    records = trainer.train()
    adapters = {}
    for part in trainer.model_parts:
        for k, v in part.named_parameters():
            if k.endswith((".lora_A", ".lora_B")):
                adapters[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return [r["loss"] for r in records], [(b.inputs, b.labels) for b in batches], adapters, nf4, records[-1]


@pytest.mark.parametrize(("world", "parallelism"), [(1, {}), (2, {"dp_shard": 2})], ids=["one", "fsdp2"])
def test_qlora_trains_as_peft_on_the_dequantised_base(ranks, tmp_path, dirs, world, parallelism):
    base, adapter, dequantised = dirs
    outs = ranks(world).run(_train, _spec(tmp_path, base, adapter, parallelism))
    losses, _, adapters, nf4, record = outs[0]
    assert nf4 == 2 * 7  # every adapted weight of the 2 blocks is held in NF4
    batches = [tuple(torch.cat([o[1][s][i] for o in outs]) for i in range(2)) for s in range(STEPS)]
    want_losses, want_adapters = _peft_reference(dequantised, adapter, batches, eps=1e-6)
    assert losses == pytest.approx(want_losses, abs=1e-5), (losses, want_losses)
    got = _ours_as_peft(adapters, base)  # under PEFT's keys and layout (the export's mapping)
    assert {k.replace(".default", "") for k in want_adapters} == set(got)
    for k, v in want_adapters.items():
        assert (got[k.replace(".default", "")] - v).abs().max().item() < 1e-5, k
    # the base's adapted weights: 4-bit codes and their scalers (0.5 + 1/64 + 4/16384 bytes a weight),
    # sharded by rows over the fully_shard ranks like every other parameter; the rest fp32
    adapted = 2 * (4 * 256 * 256 + 3 * 256 * 512)
    nf4 = adapted * (0.5 + 1 / 64 + 4 / 16384) / world + 14 * (4 + 16 * 4)  # + each tensor's mean and code book
    rest = (record["total_params"] - adapted) * 4 / world
    assert record["params_gib"] * 2**30 == nf4 + rest


def test_qlora_refusals_name_the_field(tmp_path, dirs):
    from hpservice.preflight import check_composition, check_inputs
    from hpservice.spec import SpecError

    base, adapter, _ = dirs
    with pytest.raises(SpecError, match=r"parallelism\.tp"):
        _spec(tmp_path, base, adapter, {"tp": 2})
    with pytest.raises(SpecError, match=r"model\.lora\.quantize_base"):
        parse_job({"name": "q", "model": {"name": "llama", "lora": {"r": 4, "lora_alpha": 8, "quantize_base": "nf4"}}})
    # the tiny llama's k/v weights (32 x 64) do not divide into NF4's blocks: named before start
    spec = parse_job({"name": "q", "model": {"init_from": str(base), "lora": {"r": 4, "lora_alpha": 8, "quantize_base": "nf4"}}})
    assert check_composition(spec) + check_inputs(spec) == []
    from tests.models.test_lora import _hf_model as small_model

    small = small_model(tmp_path / "small", "llama")
    spec = parse_job({"name": "q", "model": {"init_from": str(small), "lora": {"r": 4, "lora_alpha": 8, "quantize_base": "nf4"}}})
    errors = dict(check_composition(spec) + check_inputs(spec))
    assert "divisible by 64 x 256" in errors["model.lora.quantize_base"]
