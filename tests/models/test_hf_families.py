"""Qwen2, Qwen3 and Mistral checkpoints made by transformers (the reference we did not write),
imported with ``model.init_from``: the family is read from ``config.json``; logits equal
transformers' in one process, under tensor parallelism and under fully_shard; greedy generation
equals ``transformers``' ``generate``; saved or exported back, transformers reads our logits;
what has no exact equivalent is refused naming the key."""

import json

import pytest
import torch
import torch.distributed as dist
import transformers  # a dev dependency: the reference implementation

from hpservice.models import build_model, model_class
from hpservice.models.hf import HFFormatError, config_from_hf, hf_family, load_hf_weights, save_hf_pretrained

TOKENS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))

# (transformers config class, its extra settings): head widths other than hidden / heads where
# the family allows one, and a sliding window shorter than the sequences for Mistral.
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24}),
    "mistral": (transformers.MistralConfig, {"head_dim": 24, "sliding_window": 5}),
    # 6 experts, 2 per token, the first layer dense
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {"head_dim": 24, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
         "mlp_only_layers": [0], "norm_topk_prob": True},
    ),
    # multi-head latent attention with a query bottleneck; 8 experts in 4 groups, 2 per token from
    # the best 2 groups, one shared expert, the first layer dense
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        {"num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 20, "qk_nope_head_dim": 12,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
         "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 40,
         "routed_scaling_factor": 2.5, "norm_topk_prob": True},
    ),
}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 50000.0}


def _hf_checkpoint(path, family, *, tied=False, **more):
    """A small random model of ``family`` saved by transformers (``more``: other config
    settings); its logits on TOKENS."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    settings = dict(
        hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=tied,
    )  # fmt: skip
    cfg = config_cls(**{**settings, **extra, **more})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases (transformers initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") or name.endswith("mlp.gate.weight"):  # distinct routing scores
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # routing biases that change the choice
                b.normal_(0, 0.1)
    model.save_pretrained(path, max_shard_size="40KB")
    with torch.no_grad():
        return model(TOKENS).logits


def _ours(path, device="cpu"):
    model = build_model(None, device=device, init_from=str(path))  # the family from config.json
    if device != "meta":
        load_hf_weights(model, path)
    return model


@pytest.mark.parametrize(
    ("family", "tied", "more"),
    [
        ("qwen2", False, {}),
        ("qwen3", False, {}),
        ("qwen3", True, {}),
        ("qwen3", False, {"rope_parameters": YARN}),  # Qwen3's long-context config
        ("mistral", False, {}),
        ("qwen3_moe", False, {}),
        ("deepseek_v3", False, {}),
        # DeepSeek-V3's: YaRN with mscale / mscale_all_dim (a sharper softmax too)
        ("deepseek_v3", False, {"rope_parameters": {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 16}}),
    ],
    ids=["qwen2", "qwen3", "qwen3-tied", "qwen3-yarn", "mistral", "qwen3_moe", "deepseek_v3", "deepseek_v3-yarn"],
)
def test_one_process_equals_transformers_and_saves_back(tmp_path, family, tied, more):
    from hpservice.models.generate import generate

    expected = _hf_checkpoint(tmp_path / "hf", family, tied=tied, **more)
    assert hf_family(tmp_path / "hf") == family
    model = _ours(tmp_path / "hf")
    assert model_class(family) is type(model) and model.cfg.tie_embeddings == tied
    assert (model.cfg.rope_scaling or {}).get("rope_type") == more.get("rope_parameters", {}).get("rope_type")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=0, atol=1e-5)
    # greedy generation with the key/value cache (past Mistral's window of 5) equals transformers'
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = TOKENS[0, :6].tolist()
    reference = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 6:].tolist()
    assert generate(model, prompt, 10) == reference
    # and back: transformers reads what we save, with our logits
    save_hf_pretrained(model, tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert type(again).__name__ == type(theirs).__name__
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=0, atol=1e-5)


def _sharded_imports(path, expected):
    """On 2 ranks: tensor parallelism (biases sharded with their rows, q/k norms on each rank's
    heads), then fully_shard of a meta-built model; both equal transformers' logits."""
    from hpservice.dtensor import init_device_mesh
    from hpservice.fsdp import fully_shard

    model = _ours(path, device="meta")
    model.to_empty(device="cpu")
    model.init_buffers()
    model.parallelize(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)))
    load_hf_weights(model, path)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).full_tensor(), expected, rtol=0, atol=1e-5)
    model = _ours(path, device="meta")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.init_buffers()
    load_hf_weights(model, path)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=0, atol=1e-5)
    return True


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_moe", "deepseek_v3"])
def test_tensor_parallel_and_fully_shard_imports_equal_transformers(ranks, tmp_path, family):
    expected = _hf_checkpoint(tmp_path, family)
    assert ranks(2).run(_sharded_imports, str(tmp_path), expected) == [True, True]


def _grads_like_one_device(family, sequence_parallel):
    """The tiny flavor under ``model.parallelize`` on 2 ranks: logits and every parameter's gradient
    equal one device's (a q/k norm sees only its rank's heads: its gradient must be all-reduced)."""
    import copy

    import torch.nn.functional as F

    from hpservice.dtensor import DTensor, init_device_mesh
    from hpservice.parallel import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    ref = build_model(family, "tiny")
    with torch.no_grad():  # norms and biases away from their init, so every gradient is distinct
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model = copy.deepcopy(ref)
    model.parallelize(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=sequence_parallel)
    tokens, target = torch.randint(0, 256, (2, 2, 24), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(ref(tokens).flatten(0, 1), target.flatten()).backward()
    vocab_parallel_cross_entropy(model(tokens).flatten(0, 1), target.flatten()).backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, grads[name].grad, atol=1e-5, rtol=0, msg=name)
    return True


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_moe", "deepseek_v3"])
def test_tensor_parallel_gradients_equal_one_device(ranks, family):
    assert ranks(2).run(_grads_like_one_device, family, False) == [True, True]
    assert ranks(2).run(_grads_like_one_device, family, True) == [True, True]


def _train(spec):
    from tests._jobs import train

    return [r["loss"] for r in train(spec)]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_moe", "deepseek_v3"])
def test_tp_with_sequence_parallel_trains_like_one_process(ranks, tmp_path, family):
    """tp 2 with SP: q/k biases and norms get their whole gradients (the norms' per-head parts
    all-reduced); every step's loss equals one process's. Mistral's window (16) is shorter than
    the sequences (32)."""
    from tests._jobs import tiny_llama_job

    def spec(tmp, **parallelism):
        return tiny_llama_job(tmp, model={"name": family, "flavor": "tiny"}, parallelism=parallelism)

    two = ranks(2).run(_train, spec(tmp_path / "tp", tp=2, dp_shard=1, sequence_parallel=True))
    one = ranks(1).run(_train, spec(tmp_path / "one"))[0]
    assert two[0] == pytest.approx(one, abs=1e-5) and two[1] == two[0]


def _fine_tune(spec):
    from tests._jobs import train

    train(spec)
    return True


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_moe", "deepseek_v3"])
def test_init_from_alone_fine_tunes_and_exports_to_transformers(ranks, tmp_path, family):
    """A job with only ``model.init_from`` (no name) trains the checkpoint's family on 2 FSDP ranks
    from its weights; its checkpoint, exported, loads in transformers as that family with our logits."""
    from hpservice.checkpoint import CheckpointManager
    from hpservice.cli import main
    from tests._jobs import tiny_llama_job

    hf_dir = tmp_path / "hf"
    start = _hf_checkpoint(hf_dir, family)
    spec = tiny_llama_job(
        tmp_path / "run", model={"name": None, "flavor": None, "init_from": str(hf_dir)},
        data={"vocab_size": 100}, training={"steps": 2}, checkpoint={"interval": 2},
    )  # fmt: skip
    ranks(2).run(_fine_tune, spec)
    out = tmp_path / "exported"
    assert main(["export", "--format", "hf", str(tmp_path / "run" / "ckpt" / "step-00000002"), str(out)]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    ours = _ours(hf_dir)
    CheckpointManager(tmp_path / "run" / "ckpt").load(ours)
    with torch.no_grad():
        mine, reference = ours(TOKENS), theirs(TOKENS).logits
    torch.testing.assert_close(reference, mine, rtol=0, atol=1e-5)
    assert (start - reference).abs().max() > 1e-4  # it did train


@pytest.mark.parametrize(
    ("family", "extra", "fragment"),
    [
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window = True is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias = True is not supported"),
        ("qwen3", {"architectures": ["GPT2LMHeadModel"]}, "architectures = ['GPT2LMHeadModel']"),
        ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}}, "rope_type 'dynamic'"),
    ],
)
def test_what_we_cannot_compute_exactly_is_refused_naming_the_key(tmp_path, family, extra, fragment):
    _hf_checkpoint(tmp_path, family)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(HFFormatError, match=r"config\.json") as info:
        config_from_hf(tmp_path)
    assert fragment in str(info.value)


def test_a_spec_naming_another_family_is_refused_before_it_starts(tmp_path):
    from hpservice.preflight import preflight
    from hpservice.spec import SpecError
    from tests._jobs import tiny_llama_job

    _hf_checkpoint(tmp_path / "hf", "qwen3")
    spec = tiny_llama_job(tmp_path, model={"name": "llama", "flavor": None, "init_from": str(tmp_path / "hf")})
    with pytest.raises(SpecError, match=r"model.init_from: .*a qwen3 checkpoint \(Qwen3ForCausalLM\), not a llama one"):
        preflight(spec)
    with pytest.raises(SpecError, match=r"imports Hugging Face checkpoints into llama, qwen2, qwen3, mistral, qwen3_moe, deepseek_v3, not 'mlp'"):
        tiny_llama_job(tmp_path, model={"name": "mlp", "flavor": None, "init_from": str(tmp_path / "hf")})
    assert config_from_hf(tmp_path / "hf").qk_norm and config_from_hf(tmp_path / "hf").attn_head_dim == 24


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_job_starts_from_the_imported_weights(ranks, tmp_path, family):
    """``init_from`` under ep 2 x FSDP on 4 ranks (each rank reads its experts' slices): the first
    step's loss is transformers' loss on that step's batch."""
    import torch.nn.functional as F

    from hpservice.data import build_source
    from tests._jobs import tiny_llama_job

    hf_dir = tmp_path / "hf"
    _hf_checkpoint(hf_dir, family)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    sample = build_source("synthetic", vocab_size=100, seed=0).batch(0, 0, 1, 8, 32)
    inputs, targets = sample.inputs, sample.labels
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item()
    spec = tiny_llama_job(
        tmp_path / "run", model={"name": None, "flavor": None, "init_from": str(hf_dir)},
        data={"vocab_size": 100}, training={"steps": 1}, resources={"workers": 4}, parallelism={"ep": 2},
    )  # fmt: skip
    losses = ranks(4).run(_train, spec)
    assert losses[0][0] == pytest.approx(expected, abs=1e-5), (losses, expected)
