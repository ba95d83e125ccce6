"""hpservice.models: shapes, causality, GQA, tying, training signal, meta-device init, registry."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hpservice.models import (
    LLAMA_FLAVORS,
    Llama,
    LlamaConfig,
    MLPModel,
    build_model,
    flops_per_token,
    list_flavors,
    list_models,
    model_config,
    num_params,
)
from hpservice.models.llama import matmul_params, precompute_rope


def make_tiny(**overrides):
    """Custom factory used through the registry as 'tests.models.test_models:make_tiny'."""
    return Llama(LlamaConfig(**overrides))


def not_a_factory():
    return "not a module"


def _tokens(batch=2, seq=16, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _pattern_batches(steps, batch=8, seq=32, period=12, vocab=256, seed=0):
    """Windows of a repeated pattern of distinct tokens: the next token is a function of the current one."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randperm(vocab, generator=g)[:period]
    stream = pattern.repeat(steps * batch * (seq + 1) // period + 2)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=g)
        chunk = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def _train(model, steps=30, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for x, y in _pattern_batches(steps):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------------------------
# Llama
# ----------------------------------------------------------------------------------------------


def test_tiny_llama_forward_shape():
    torch.manual_seed(0)
    model = build_model("llama", "tiny")
    cfg = model.cfg
    logits = model(_tokens(batch=3, seq=20))
    assert logits.shape == (3, 20, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    assert isinstance(model.layers, torch.nn.ModuleDict) and list(model.layers) == [str(i) for i in range(cfg.n_layers)]
    assert model.blocks() == list(model.layers.values())
    # Initial logits are unit scale: the loss starts near ln(vocab).
    loss = F.cross_entropy(logits.flatten(0, 1), _tokens(batch=3, seq=20, seed=1).flatten())
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 1.5


def test_llama_is_causal():
    torch.manual_seed(0)
    model = build_model("llama", "tiny")
    x = _tokens(batch=2, seq=24)
    y = x.clone()
    y[:, 15] = (y[:, 15] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_llama_gqa(n_kv_heads):
    torch.manual_seed(0)
    model = build_model("llama", "tiny", {"n_heads": 4, "n_kv_heads": n_kv_heads})
    head_dim = model.cfg.head_dim
    assert model.layers["0"].attention.wk.weight.shape == (n_kv_heads * head_dim, model.cfg.dim)
    logits = model(_tokens())
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()


def test_llama_gqa_equals_repeated_mha():
    """A GQA model equals the MHA model whose k/v heads are the GQA heads repeated per group."""
    torch.manual_seed(0)
    gqa = build_model("llama", "tiny", {"n_heads": 4, "n_kv_heads": 2})
    mha = build_model("llama", "tiny", {"n_heads": 4, "n_kv_heads": 4})
    state = gqa.state_dict()
    hd = gqa.cfg.head_dim
    for key, value in state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            state[key] = value.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x))


def test_tied_and_untied_embeddings():
    tied = build_model("llama", "tiny", {"tie_embeddings": True})
    assert tied.output.weight is tied.tok_embeddings.weight
    assert num_params(tied) == num_params(build_model("llama", "tiny")) - 256 * 64
    untied = build_model("llama", "tiny", {"tie_embeddings": False})
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert "rope_cache" not in untied.state_dict()  # non-persistent buffer


def test_llama_loss_falls():
    torch.manual_seed(0)
    losses = _train(build_model("llama", "tiny"))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses


def test_llama_rejects_too_long_sequence():
    model = build_model("llama", "tiny", {"max_seq_len": 8})
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(seq=9))


def test_meta_build_then_init_weights_matches_cpu_build():
    cfg = LLAMA_FLAVORS["tiny"]
    with torch.device("meta"):
        meta_model = Llama(cfg)
    assert meta_model.rope_cache.is_meta and meta_model.output.weight.is_meta
    meta_model.to_empty(device="cpu")
    torch.manual_seed(1)
    meta_model.init_weights()

    torch.manual_seed(0)
    cpu_model = Llama(cfg)
    torch.manual_seed(1)
    cpu_model.init_weights()

    assert meta_model.rope_cache.device.type == "cpu"
    torch.testing.assert_close(meta_model.rope_cache, cpu_model.rope_cache, rtol=0, atol=0)
    torch.testing.assert_close(
        meta_model.rope_cache, precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), rtol=0, atol=0
    )
    # init_weights alone decides the parameters: the same seed gives the same model.
    for (name, a), (_, b) in zip(meta_model.named_parameters(), cpu_model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    x = _tokens()
    with torch.no_grad():
        out = meta_model(x)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, cpu_model(x))


class _ParamOps(TorchDispatchMode):
    """Records the aten ops that touch any of the given parameters' storage."""

    def __init__(self, params):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages:
                self.ops.add(func.overloadpacket.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize(("name", "overrides"), [("llama", {}), ("llama", {"tie_embeddings": True}), ("mlp", {})])
def test_init_weights_only_fills_parameters_in_place(name, overrides):
    """Sharded DTensor parameters support in-place random/fill ops but not views, reshapes or
    reductions (e.g. the ``.any()`` inside torch's trunc_normal_): init_weights must use only those."""
    model = build_model(name, "tiny", overrides)
    recorder = _ParamOps(model.parameters())
    with recorder:
        model.init_weights()
    assert recorder.ops and recorder.ops <= {"normal_", "uniform_", "fill_", "zero_"}, recorder.ops


def test_registry_meta_device():
    model = build_model("llama", "tiny", {"tie_embeddings": True}, device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight  # to_empty breaks the tie; init_weights restores it
    assert torch.isfinite(model(_tokens())).all()


@pytest.mark.parametrize(("flavor", "expected", "hidden"), [("1B", 1.24e9, 8192), ("8B", 8.03e9, 14336)])
def test_big_flavors_on_meta(flavor, expected, hidden):
    model = build_model("llama", flavor, device="meta")
    assert model.cfg.ffn_hidden_dim == hidden
    assert model.layers["0"].feed_forward.w1.weight.shape == (hidden, model.cfg.dim)
    n = num_params(model)
    assert abs(n - expected) / expected < 0.05, n
    assert (model.output.weight is model.tok_embeddings.weight) == (flavor == "1B")


def test_matmul_params_and_flops():
    model = build_model("llama", "tiny")
    cfg = model.cfg
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    assert matmul_params(cfg) == num_params(model) - cfg.vocab_size * cfg.dim - norms
    assert num_params(model, exclude_embedding=True) == num_params(model) - cfg.vocab_size * cfg.dim
    f128, f1024 = flops_per_token(cfg, 128), flops_per_token(cfg, 1024)
    assert 0 < f128 < f1024
    assert f1024 - f128 == 12 * cfg.n_layers * cfg.dim * (1024 - 128)
    # 8B at 8192 tokens: about 6 * 7.5e9 + 12 * 32 * 4096 * 8192.
    big = flops_per_token(model_config("llama", "8B"), 8192)
    assert 5.5e10 < big < 6.0e10, big
    assert flops_per_token(model_config("mlp", "tiny"), 128) > 0


def test_config_validation():
    with pytest.raises(ValueError, match="dim"):
        LlamaConfig(dim=65, n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        LlamaConfig(n_layers=0)


# ----------------------------------------------------------------------------------------------
# MLP
# ----------------------------------------------------------------------------------------------


def test_mlp_forward_and_loss_falls():
    torch.manual_seed(0)
    model = build_model("mlp", "tiny")
    assert isinstance(model, MLPModel) and len(model.layers) == model.cfg.n_layers
    assert model(_tokens(batch=3, seq=5)).shape == (3, 5, 256)
    losses = _train(model, lr=3e-3)
    assert losses[-1] < 0.7 * losses[0], losses


def test_mlp_meta_build():
    model = build_model("mlp", "small", device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.isfinite(model(_tokens())).all()


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


def test_registry_listing_and_config():
    assert list_models() == ["deepseek_v3", "llama", "mistral", "mlp", "qwen2", "qwen3", "qwen3_moe"]
    assert list_flavors("llama") == ["tiny", "small", "1B", "8B"]
    assert list_flavors("mlp") == ["tiny", "small"]
    cfg = model_config("llama", "small", {"n_layers": 1})
    assert isinstance(cfg, LlamaConfig) and cfg.n_layers == 1 and cfg.dim == 256
    assert LLAMA_FLAVORS["small"].n_layers == 4  # the table is not modified
    assert model_config("llama") == LLAMA_FLAVORS["tiny"]


def test_registry_errors():
    with pytest.raises(ValueError, match=r"unknown model 'gpt'.*deepseek_v3, llama, mistral, mlp, qwen2, qwen3, qwen3_moe"):
        build_model("gpt")
    with pytest.raises(ValueError, match=r"unknown flavor '70B'.*tiny, small, 1B, 8B"):
        build_model("llama", "70B")
    with pytest.raises(ValueError, match=r"unknown LlamaConfig field 'width'.*allowed fields: dim, n_layers"):
        build_model("llama", "tiny", {"width": 3})
    with pytest.raises(ValueError, match=r"LlamaConfig.norm_eps must be float.*1.0e-5"):
        build_model("llama", "tiny", {"norm_eps": "1e-5"})
    with pytest.raises(ValueError, match=r"LlamaConfig.dim \(64\) must be divisible by n_heads \(3\)"):
        build_model("llama", "tiny", {"n_heads": 3})
    with pytest.raises(ValueError, match="flavor"):
        build_model("tests.models.test_models:make_tiny", "tiny")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("tests.models.test_models:", "package.module:factory"),
        (":make_tiny", "package.module:factory"),
        ("tests.models.test_models:make:tiny", "package.module:factory"),
        ("tests/models:make_tiny", "package.module:factory"),
        ("tests.models.no_such_module:make_tiny", "cannot import module 'tests.models.no_such_module'"),
        ("tests.models.test_models:no_such_factory", "has no attribute 'no_such_factory'"),
        ("tests.models.test_models:math", "not callable"),
    ],
)
def test_registry_bad_factories(spec, match):
    with pytest.raises(ValueError, match=match):
        build_model(spec)


def test_registry_factory_wrong_return_type():
    with pytest.raises(TypeError, match=r"must return a torch\.nn\.Module, got str"):
        build_model("tests.models.test_models:not_a_factory")


def test_registry_custom_factory():
    model = build_model("tests.models.test_models:make_tiny", overrides={"n_layers": 1, "tie_embeddings": True})
    assert isinstance(model, Llama) and len(model.layers) == 1
    assert model.output.weight is model.tok_embeddings.weight
    meta = build_model("tests.models.test_models:make_tiny", device="meta")
    assert all(p.is_meta for p in meta.parameters())
