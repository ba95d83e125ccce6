"""Hugging Face Llama checkpoints imported into our Llama, checked against transformers itself:
logits on the same tokens equal, in one process, under fully_shard and under tensor parallelism,
each rank reading only its own slices; and clear errors for what we cannot import exactly."""

import json

import pytest
import torch
import torch.distributed as dist
import transformers  # a dev dependency: the reference implementation

from hpservice.models.hf import HFFormatError, config_from_hf, load_hf_weights
from hpservice.models.llama import Llama

TOKENS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))


def _hf_checkpoint(path, *, heads=6, kv_heads=3, tied=False, **extra):
    """A small random Llama saved by transformers (uneven sizes, several safetensors shards)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=72, intermediate_size=200, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=50000.0, tie_word_embeddings=tied, **extra,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, max_shard_size="40KB")
    with torch.no_grad():
        logits = model(TOKENS).logits
    return logits


def _ours(path, device="cpu"):
    with torch.device(device):
        return Llama(config_from_hf(path))


LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}  # fmt: skip


@pytest.mark.parametrize(
    ("tied", "extra"), [(False, {}), (True, {}), (False, {"rope_scaling": LLAMA3_ROPE})], ids=["untied", "tied", "llama3"]
)
def test_one_process_equals_transformers(tmp_path, tied, extra):
    expected = _hf_checkpoint(tmp_path, tied=tied, **extra)
    cfg = config_from_hf(tmp_path)
    assert cfg.rope_theta == 50000.0 and (cfg.rope_scaling is not None) == bool(extra)  # read, not defaulted
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # the sharded format, with its index
    model = _ours(tmp_path)
    load_hf_weights(model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=0, atol=1e-5)


def _fsdp_import(path, expected):
    from hpservice.fsdp import fully_shard
    from hpservice.models import hf

    mesh = __import__("hpservice.dtensor", fromlist=["init_device_mesh"]).init_device_mesh("cpu", (dist.get_world_size(),))
    model = _ours(path, device="meta")  # the full model never exists on a rank
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.init_weights()  # the rotary table on the device (parameters are overwritten below)
    read = []
    original = hf._SafetensorsDir.slice

    def counting(self, name):
        sl = original(self, name)

        class Counted:
            def get_shape(_):
                return sl.get_shape()

            def __getitem__(_, index):
                value = sl[index]
                read.append(value.numel())
                return value

        return Counted()

    hf._SafetensorsDir.slice = counting
    try:
        load_hf_weights(model, path)
    finally:
        hf._SafetensorsDir.slice = original
    total = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(TOKENS)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    return sum(read) / total


def test_fully_shard_reads_only_each_ranks_slices_and_equals_transformers(ranks, tmp_path):
    expected = _hf_checkpoint(tmp_path)
    fractions = ranks(2).run(_fsdp_import, str(tmp_path), expected)
    assert all(f < 0.6 for f in fractions), fractions  # about half each (query/key rows head-aligned)


def _tp_import(path, expected):
    from hpservice.dtensor import init_device_mesh
    from hpservice.parallel import apply_llama_tp

    model = _ours(path)
    apply_llama_tp(model, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)))
    load_hf_weights(model, path)
    with torch.no_grad():
        logits = model(TOKENS).full_tensor()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    return True


def test_tensor_parallel_import_equals_transformers(ranks, tmp_path):
    expected = _hf_checkpoint(tmp_path, heads=4, kv_heads=2)  # head counts the tp degree divides
    ranks(2).run(_tp_import, str(tmp_path), expected)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'linear'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"attention_bias": True}, "attention_bias = True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ],
)
def test_configs_we_cannot_compute_exactly_are_refused(tmp_path, extra, fragment):
    _hf_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(HFFormatError, match=r"config\.json") as info:
        config_from_hf(tmp_path)
    assert fragment in str(info.value)


def test_shape_mismatches_and_missing_files_name_the_tensor(tmp_path):
    _hf_checkpoint(tmp_path)
    cfg = config_from_hf(tmp_path, hidden_dim=208)
    with pytest.raises(HFFormatError, match=r"mlp.gate_proj.weight has shape \[200, 72\], our .*w1.weight needs \[208, 72\]"):
        load_hf_weights(Llama(cfg), tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(HFFormatError, match=r"no model\.safetensors"):
        load_hf_weights(_ours(tmp_path), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFFormatError, match="not valid JSON"):
        config_from_hf(tmp_path)


def _train_one_step(spec):
    from tests._jobs import train

    return train(spec)[0]["loss"]


@pytest.mark.parametrize(
    ("world", "parallelism"),
    [(2, {}), (4, {"dp_replicate": 2}), (4, {"tp": 2})],
    ids=["fsdp2", "hsdp2x2", "fsdp2xtp2"],
)
def test_a_job_starts_from_the_imported_weights(ranks, tmp_path, world, parallelism):
    """`model.init_from` in a job spec, under FSDP, HSDP and FSDP x TP: the first step's loss is
    transformers' loss on that step's batch (the model starts from the checkpoint, not from
    random weights)."""
    import torch.nn.functional as F

    from hpservice.data import build_source
    from tests._jobs import tiny_llama_job

    hf_dir = tmp_path / "hf"
    _hf_checkpoint(hf_dir, heads=4, kv_heads=2)  # head counts a tp degree of 2 divides
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    sample = build_source("synthetic", vocab_size=100, seed=0).batch(0, 0, 1, 8, 32)
    inputs, targets = sample.inputs, sample.labels
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item()
    spec = tiny_llama_job(
        tmp_path / "run", model={"name": "llama", "init_from": str(hf_dir)}, training={"steps": 1},
        parallelism=parallelism,
    )  # fmt: skip
    losses = ranks(world).run(_train_one_step, spec)
    assert losses[0] == pytest.approx(expected, abs=1e-5), (losses, expected)


@pytest.mark.parametrize("tied", [False, True])
def test_export_after_training_loads_in_transformers_with_our_logits(ranks, tmp_path, tied):
    """Fine-tune 2 steps from a transformers checkpoint on 2 FSDP ranks, export the checkpoint in
    Hugging Face format (several shard files), load it with transformers: same logits as ours."""
    from hpservice.checkpoint import CheckpointManager
    from hpservice.cli import main
    from tests._jobs import tiny_llama_job

    hf_dir = tmp_path / "hf"
    _hf_checkpoint(hf_dir, tied=tied)
    spec = tiny_llama_job(
        tmp_path / "run", model={"name": "llama", "init_from": str(hf_dir)}, training={"steps": 2},
        checkpoint={"interval": 2},
    )  # fmt: skip
    ranks(2).run(_train_one_step, spec)
    step_dir = tmp_path / "run" / "ckpt" / "step-00000002"
    out = tmp_path / "exported"
    assert main(["export", "--format", "hf", "--max-shard-mb", "0", str(step_dir), str(out)]) == 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2 and not (tmp_path / "exported.tmp").exists()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = _ours(hf_dir)
    CheckpointManager(tmp_path / "run" / "ckpt").load(ours)
    with torch.no_grad():
        mine, reference = ours(TOKENS), theirs(TOKENS).logits
    torch.testing.assert_close(reference, mine, rtol=0, atol=1e-5)
    with torch.no_grad():  # and it did train: not the starting weights
        start = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()(TOKENS).logits
    assert (start - reference).abs().max() > 1e-4


def test_export_failures_leave_nothing(tmp_path, capsys):
    from hpservice.cli import main

    out = tmp_path / "exported"
    assert main(["export", "--format", "hf", str(tmp_path / "no-such-step"), str(out)]) == 1
    assert not out.exists() and not (tmp_path / "exported.tmp").exists()
    assert "hpservice export:" in capsys.readouterr().err


def test_export_a_jobs_checkpoint_from_the_api(ranks, tmp_path):
    """POST /v1/jobs/{id}/checkpoints/{step}/export writes the HF directory into the job's own
    directory; other owners get 404, unknown steps 404, a broken checkpoint 422."""
    from fastapi.testclient import TestClient

    from hpservice.api import Settings, create_app
    from hpservice.api.admission import job_dir
    from hpservice.api.settings import Principal
    from tests._jobs import tiny_llama_job

    tokens = {"alice-token-0123456789": Principal("alice"), "bob-token-0123456789": Principal("bob")}
    settings = Settings(data_dir=tmp_path / "data", tokens=tokens)
    alice, bob = ({"Authorization": f"Bearer {t}"} for t in tokens)
    with TestClient(create_app(settings, connect_ray=False, supervise=False)) as c:
        job = c.post("/v1/jobs", json={"name": "t", "training": {"steps": 2}}, headers=alice).json()
        home = job_dir(settings, "alice", job["id"])
        spec = tiny_llama_job(home, training={"steps": 2}, checkpoint={"interval": 2, "dir": str(home / "ckpt")})
        ranks(1).run(_train_one_step, spec)  # what the job's workers would have written
        step_dir = str(home / "ckpt" / "step-00000002")
        c.app.state.store.update_status(job["id"], {"state": "SUCCEEDED", "checkpoints": [{"step": 2, "path": step_dir}]})
        r = c.post(f"/v1/jobs/{job['id']}/checkpoints/2/export", headers=alice)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["path"] == str(home / "exports" / "step-00000002-hf") and out["files"] and out["tensors"] > 0
        assert transformers.AutoModelForCausalLM.from_pretrained(out["path"]) is not None
        assert c.post(f"/v1/jobs/{job['id']}/checkpoints/2/export", headers=bob).status_code == 404
        assert c.post(f"/v1/jobs/{job['id']}/checkpoints/7/export", headers=alice).status_code == 404
        (home / "ckpt" / "step-00000002" / "manifest.json").unlink()
        assert c.post(f"/v1/jobs/{job['id']}/checkpoints/2/export", headers=alice).status_code == 422
