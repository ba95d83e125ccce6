"""Tensor parallelism on the built-in Llama: the tiny model (fp32) under ``apply_llama_tp`` on 2
ranks equals the single-device model with the same weights (logits, loss, every gradient), and a
``parallelism.tp: 2`` training job gives the single-process losses."""

import copy

import pytest
import torch
import torch.nn.functional as F

from hpservice.dtensor import DTensor, Shard, init_device_mesh
from hpservice.models.llama import Llama, LlamaConfig
from hpservice.parallel import apply_llama_tp, llama_tp_plan, vocab_parallel_cross_entropy

from .._jobs import tiny_llama_job
from .._jobs import train as _run


def _model_vs_single(tp):
    torch.manual_seed(0)
    ref = Llama(LlamaConfig())
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    apply_llama_tp(model, mesh)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))

    ref_logits = ref(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten())
    ref_loss.backward()

    logits = model(tokens)
    assert isinstance(logits, DTensor)
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), target.flatten())
    loss.backward()
    torch.testing.assert_close(logits.full_tensor(), ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    ref_params = dict(ref.named_parameters())
    sharded = 0
    for name, p in model.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):
            assert grad.placements == p.placements, name
            grad = grad.full_tensor()
            sharded += 1
        torch.testing.assert_close(grad, ref_params[name].grad, atol=1e-5, rtol=0, msg=name)
    assert sharded == 7 * 2 + 2  # the blocks' projections, the head and the vocab-parallel embedding
    assert model.tok_embeddings.weight.placements == (Shard(0),)


def test_llama_tp_matches_single_device(ranks):
    ranks(2).run(_model_vs_single, 2)


def test_llama_tp_heads_must_divide():
    model = Llama(LlamaConfig(n_heads=4, n_kv_heads=1))
    with pytest.raises(ValueError, match=r"n_kv_heads \(1\) must be divisible by tp \(2\)"):
        llama_tp_plan(model, 2)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by tp \(3\)"):
        llama_tp_plan(model, 3)


def _spec(tmp, **parallelism):
    return tiny_llama_job(tmp, parallelism=parallelism)


def test_trainer_tp2_equals_one_process(ranks, tmp_path):
    two = ranks(2).run(_run, _spec(tmp_path / "tp", tp=2, dp_shard=1))
    one = ranks(1).run(_run, _spec(tmp_path / "one"))[0]
    assert two[0] == two[1] or [r["loss"] for r in two[0]] == [r["loss"] for r in two[1]]
    for a, b in zip(two[0], one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-5)
        assert a["lr"] == b["lr"]
