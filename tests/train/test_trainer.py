"""The trainer on gloo ranks: equals a single process, resumes exactly, runs under torchrun."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.train import Trainer, TrainingError

from .._jobs import tiny_llama_job as _spec
from .._jobs import train as _run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sync_every_micro_batch", [False, True], ids=["reduce-once", "reduce-every-micro-batch"])
def test_two_ranks_equal_one_process(ranks, tmp_path, sync_every_micro_batch):
    spec = _spec(tmp_path, training={"steps": 4, "grad_accum": 2}, parallelism={"sync_every_micro_batch": sync_every_micro_batch})
    two = ranks(2).run(_run, spec)[0]
    one = ranks(1).run(
        _run, spec.model_copy(update={"metrics": spec.metrics.model_copy(update={"dir": str(tmp_path / "one")})})
    )[0]
    for a, b in zip(two, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-5)  # the global norm, not a per-rank one
        assert a["lr"] == b["lr"]
    (run,) = tmp_path.glob("t-*/metrics.jsonl")  # this run's own directory: <metrics.dir>/<run_id>
    lines = run.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_hsdp_and_loss_falls(ranks, tmp_path):
    spec = _spec(tmp_path, training={"steps": 40}, parallelism={"dp_replicate": 2})
    history = ranks(4).run(_run, spec)[0]
    assert history[-1]["loss"] < 0.75 * history[0]["loss"], [round(r["loss"], 3) for r in history]
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in history)


def test_resume_mid_run_continues_identically(ranks, tmp_path):
    spec = _spec(tmp_path, training={"steps": 6}, checkpoint={"interval": 3})
    full = ranks(2).run(_run, spec)[0]
    step3 = tmp_path / "ckpt" / "step-00000003"
    assert step3.is_dir()
    resumed_spec = _spec(tmp_path / "again", training={"steps": 6}, checkpoint={"resume_from": str(step3)})
    resumed = ranks(2).run(_run, resumed_spec)[0]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]  # bitwise
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full[3:]]


def test_a_world_of_one_leaves_no_rendezvous_behind_in_the_environment(tmp_path, monkeypatch):
    """Outside torchrun and Ray a Trainer makes a world of one. Its rendezvous variables must not
    outlive it: a second run in the same process would read them and meet on a stale port."""
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    for name in rendezvous:
        monkeypatch.delenv(name, raising=False)
    for steps in (1, 2):  # the second run makes its own world of one again
        records = Trainer(_spec(tmp_path / str(steps), training={"steps": steps}), log_to_stdout=False).train()
        assert [r["step"] for r in records] == list(range(1, steps + 1)) and not dist.is_initialized()
        assert [name for name in rendezvous if name in os.environ] == []


def test_resuming_from_latest_reports_the_checkpoint_it_resumed_from(tmp_path):
    """A checkpoint the lost coordinator's workers wrote after it died never reached a listing:
    the attempt that resumes from it reports it, with its commit time and what storage keeps."""
    spec = _spec(tmp_path, training={"steps": 4}, checkpoint={"interval": 2, "keep": 1})
    Trainer(spec, log_to_stdout=False).train()
    latest = tmp_path / "ckpt" / "step-00000004"
    reported = []
    again = spec.model_copy(
        update={
            "checkpoint": spec.checkpoint.model_copy(update={"resume_from": "latest"}),
            "training": spec.training.model_copy(update={"steps": 5}),
        }
    )
    trainer = Trainer(again, on_checkpoint=reported.append, log_to_stdout=False)
    manifest = json.loads((latest / "manifest.json").read_text())
    assert reported == [
        {"step": 4, "metrics": manifest["metrics"], "time": manifest["time"], "path": str(latest), "kept": [4]}
    ]
    trainer.close()


class NaNAfter(nn.Module):
    """A model whose logits turn NaN at its third forward: exercises the non-finite guard."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.layers = nn.ModuleList([nn.Linear(8, vocab)])
        self.calls = 0

    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        nn.init.normal_(self.layers[0].weight)
        nn.init.zeros_(self.layers[0].bias)

    def forward(self, x):
        self.calls += 1
        out = self.layers[0](self.emb(x))
        return out * float("nan") if self.calls == 3 else out


def nan_model():
    return NaNAfter()


def _run_expecting_error(spec):
    with pytest.raises(TrainingError, match=r"non-finite loss \(nan\) at step 3"):
        Trainer(spec, log_to_stdout=False).train()
    return True


def test_nonfinite_loss_fails_naming_the_step_or_skips(ranks, tmp_path):
    model = {"name": "tests.train.test_trainer:nan_model", "flavor": None}
    spec = _spec(tmp_path, model=model, data={"vocab_size": 16}, training={"steps": 4})
    ranks(2).run(_run_expecting_error, spec)
    skip = _spec(tmp_path / "skip", model=model, data={"vocab_size": 16}, training={"steps": 4, "skip_nonfinite": True})
    history = ranks(2).run(_run, skip)[0]
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert torch.isnan(torch.tensor(history[2]["loss"])) and not torch.isnan(torch.tensor(history[3]["loss"]))


def test_torchrun_runs_the_example_end_to_end(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "hpservice.train", str(ROOT / "examples" / "tiny-cpu.yaml"),
        "--set", "training.steps=4", "--set", "checkpoint.interval=2",
        "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", f"metrics.dir={tmp_path}", "--set", "metrics.log_every=2",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[tiny-cpu] step     4/4" in out.stdout
    (run,) = tmp_path.glob("tiny-cpu-*/metrics.jsonl")  # one run id, agreed by both ranks
    announced = f"[tiny-cpu] run {run.parent.name}: metrics in {run.parent}, checkpoints in {tmp_path / 'ckpt'}"
    assert out.stdout.count(announced) == 1, out.stdout[:2000]  # said once, by rank 0
    assert len(run.read_text().splitlines()) == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002", "step-00000004"]


def _stop_seen_by_rank_0_only(spec):
    """Only rank 0 is asked to stop (its metrics callback, at step 2): every rank must stop after
    the same step and checkpoint it, not one checkpointing while the other starts step 3."""
    trainer = Trainer(spec, log_to_stdout=False)
    trainer.on_metrics = lambda record: trainer.request_stop() if record["step"] == 2 else None
    history = trainer.train()
    return [r["step"] for r in history]


def test_stop_requested_on_one_rank_stops_all_ranks_after_the_same_step(ranks, tmp_path):
    spec = _spec(tmp_path, training={"steps": 50}, checkpoint={"interval": 100})
    steps = ranks(2).run(_stop_seen_by_rank_0_only, spec, timeout=120)
    assert steps[0] == steps[1] == [1, 2, 3]  # agreed in step 3's all-reduce
    assert (tmp_path / "ckpt" / "step-00000003").is_dir()


def test_two_runs_of_one_spec_never_share_outputs(ranks, tmp_path):
    """Run ids in the default paths: a second run of the same job file gets its own metrics file
    (never appended to the first's) and its own checkpoints (never resumed from or pruned)."""
    spec = _spec(tmp_path, checkpoint={"interval": 2})
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"dir": None})})
    for _ in range(2):
        ranks(2).run(_run, spec)
    runs = sorted(tmp_path.glob("t-*/metrics.jsonl"))
    assert len(runs) == 2, runs
    for run in runs:
        assert [json.loads(line)["step"] for line in run.read_text().splitlines()] == [1, 2, 3, 4]
        assert sorted(p.name for p in (run.parent / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]


def _val_losses(spec):
    return [(r["step"], r.get("val_loss")) for r in _run(spec)]


@pytest.mark.parametrize(("world", "parallelism"), [(2, {}), (4, {"tp": 2})], ids=["fsdp2", "fsdp2xtp2"])
def test_validation_loss_equals_one_process(ranks, tmp_path, world, parallelism):
    """eval: {data, interval, steps}: a val_loss every interval steps (and after the last), each
    data-parallel rank on its part of the held-out batches; the same values as one process."""
    held_out = {"kind": "synthetic", "seq_len": 32, "global_batch": 8, "seed": 99}
    sections = {"training": {"steps": 5}, "eval": {"data": held_out, "interval": 2, "steps": 3}}
    spec = _spec(tmp_path, parallelism=parallelism, **sections)
    many = ranks(world).run(_val_losses, spec)[0]
    one = ranks(1).run(_val_losses, _spec(tmp_path / "one", **sections))[0]
    assert [s for s, v in many if v is not None] == [2, 4, 5]
    for (_, a), (_, b) in zip(many, one, strict=True):
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-5))
    records = [json.loads(line) for line in next(tmp_path.glob("t-*/metrics.jsonl")).read_text().splitlines()]
    assert "val_ppl" in records[1] and "val_loss" not in records[0]  # through the metrics pipe


def _frozen_run(spec):
    trainer = Trainer(spec, log_to_stdout=False)
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in trainer.model.named_parameters()
    }
    history = trainer.train()
    changed = {}
    for n, p in trainer.model.named_parameters():
        now = p.full_tensor() if hasattr(p, "full_tensor") else p
        changed[n] = not torch.equal(now, full[n])
    return [r["loss"] for r in history], changed


def test_frozen_parameters_stay_and_the_rest_trains_as_one_process(ranks, tmp_path):
    training = {"steps": 3, "freeze": ["embeddings", "layers.0"]}
    (losses, changed), _ = ranks(2).run(_frozen_run, _spec(tmp_path, training=training))
    one_losses, _ = ranks(1).run(_frozen_run, _spec(tmp_path / "one", training=training))[0]
    assert losses == pytest.approx(one_losses, abs=1e-5)
    frozen = {n for n, c in changed.items() if not c}
    assert frozen == {n for n in changed if n.startswith(("tok_embeddings.", "layers.0."))}, frozen
    with pytest.raises(Exception, match=r"training.freeze: 'layrs.0' matches no parameter"):
        ranks(1).run(_frozen_run, _spec(tmp_path / "bad", training={"freeze": ["layrs.0"]}))


def test_keep_best_by_validation_loss(ranks, tmp_path):
    """checkpoint.keep_best: val_loss keeps the checkpoint with the lowest val_loss besides the
    `keep` newest ones; every other one is pruned."""
    held_out = {"kind": "synthetic", "seq_len": 32, "global_batch": 8, "seed": 7}
    spec = _spec(
        tmp_path, training={"steps": 8}, eval={"data": held_out, "interval": 2, "steps": 2},
        checkpoint={"interval": 2, "keep": 1, "keep_best": "val_loss"},
    )  # fmt: skip
    history = ranks(2).run(_run, spec)[0]
    val = {r["step"]: r["val_loss"] for r in history if "val_loss" in r}
    assert sorted(val) == [2, 4, 6, 8]
    best = min(val, key=val.get)
    kept = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "ckpt").iterdir())
    assert kept == sorted({best, 8}), (kept, val)
    manifest = json.loads((tmp_path / "ckpt" / "step-00000008" / "manifest.json").read_text())
    assert manifest["metrics"]["val_loss"] == pytest.approx(val[8])
    with pytest.raises(Exception, match=r"keep_best: val_loss needs eval\.interval"):
        _spec(tmp_path, checkpoint={"keep_best": "val_loss"})


def test_mlflow_sink_logs_params_and_every_steps_metrics(ranks, tmp_path, monkeypatch):
    import mlflow  # a dev dependency (mlflow-skinny)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store back, as the sink writes it
    held_out = {"kind": "synthetic", "seq_len": 32, "global_batch": 8, "seed": 7}
    spec = _spec(
        tmp_path, training={"steps": 4}, eval={"data": held_out, "interval": 2, "steps": 1},
        metrics={"mlflow": {"experiment": "exp-1"}},
    )  # fmt: skip
    history = ranks(2).run(_run, spec)[0]
    (store,) = tmp_path.glob("t-*/mlruns")  # the default: a file store in the run's directory
    client = mlflow.tracking.MlflowClient(store.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("exp-1").experiment_id])
    assert run.info.run_name == store.parent.name and run.info.status == "FINISHED"
    assert run.data.params["training.steps"] == "4" and run.data.params["model.name"] == "llama"
    losses = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"])) for r in history]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [2, 4]


def test_wandb_sink_offline_writes_the_run_in_the_run_directory(ranks, tmp_path):
    spec = _spec(tmp_path, training={"steps": 3}, metrics={"wandb": {"project": "p1"}})
    history = ranks(2).run(_run, spec)[0]
    (run_file,) = tmp_path.glob("t-*/wandb/offline-run-*/run-t-*.wandb")  # in the run's own directory
    # W&B's record log, each value stored as its JSON text; its writer process may still be
    # flushing after finish() returned on a loaded machine: wait for the last record (bounded).
    last = json.dumps(history[-1]["loss"]).encode()
    deadline = time.monotonic() + 120
    while last not in run_file.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    records = run_file.read_bytes()
    for r in history:
        assert json.dumps(r["loss"]).encode() in records, r["step"]
    assert b"training" in records  # the spec, as the run's config


def _losses_and_grad_norms(spec):
    return [(r["loss"], r["grad_norm"]) for r in _run(spec)]


@pytest.mark.parametrize(
    "ac", [{"activation_checkpointing": "full"}, {"activation_checkpointing": "selective", "selective_every": 2},
           {"activation_checkpointing": "selective"}],
    ids=["full", "every-2nd", "op-level"],
)  # fmt: skip
@pytest.mark.parametrize(("world", "parallelism"), [(2, {}), (4, {"tp": 2})], ids=["fsdp2", "fsdp2xtp2"])
def test_activation_checkpointing_changes_nothing_but_memory(ranks, tmp_path, ac, world, parallelism):
    """Loss and (global) gradient norm of every step equal the run without checkpointing (fp32)."""
    plain = ranks(world).run(_losses_and_grad_norms, _spec(tmp_path / "a", parallelism=parallelism))[0]
    spec = _spec(tmp_path / "b", parallelism=parallelism, training={"steps": 4, **ac})
    checkpointed = ranks(world).run(_losses_and_grad_norms, spec)[0]
    for (la, ga), (lb, gb) in zip(plain, checkpointed, strict=True):
        assert la == pytest.approx(lb, abs=1e-6) and ga == pytest.approx(gb, abs=1e-6)


@pytest.mark.parametrize(
    ("ac", "calls"),
    [({}, [1, 1, 1, 1]), ({"activation_checkpointing": "full"}, [2, 2, 2, 2]),
     ({"activation_checkpointing": "selective", "selective_every": 2}, [2, 1, 2, 1]),
     ({"activation_checkpointing": "selective"}, [2, 2, 2, 2])],
    ids=["none", "full", "every-2nd", "op-level"],
)  # fmt: skip
def test_activation_checkpointing_recomputes_the_chosen_blocks(ac, calls):
    """The blocks it names run their forward again in backward (counted at a child module)."""
    from hpservice.models.llama import Llama, LlamaConfig
    from hpservice.spec import parse_job
    from hpservice.train._activation_checkpointing import apply_activation_checkpointing

    model = Llama(LlamaConfig(n_layers=4))
    apply_activation_checkpointing(model, parse_job({"name": "x", "training": ac}))
    counts = [0] * 4
    for i, block in enumerate(model.layers.values()):
        block.attention_norm.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    assert counts == calls


def _losses(spec):
    return [r["loss"] for r in _run(spec)]


@pytest.mark.parametrize(
    ("world", "parallelism", "training"),
    [
        (2, {}, {}),
        (4, {"dp_replicate": 2}, {"activation_checkpointing": "selective"}),
        (2, {"tp": 2}, {}),
        (2, {"tp": 2, "sequence_parallel": True}, {}),  # no fully_shard: the TP grad hooks alone
        (4, {"tp": 2, "sequence_parallel": True}, {"activation_checkpointing": "full"}),
    ],
    ids=["fsdp2", "hsdp-op-level-ac", "tp2", "tp2-sp", "fsdp2-tp2-sp-ac"],
)
def test_compiled_blocks_train_as_eager(ranks, tmp_path, world, parallelism, training):
    """training.compile: each block and the loss compiled (inductor on CPU); the loss of every step
    equals the eager run's within fp32 tolerance, and the compiled graphs really ran."""
    # 4 sequences per data-parallel rank in every case: the shapes, and so many of the kernels
    # Inductor compiles cold on a fresh machine, are the same from case to case
    data = {"global_batch": 4 * world // parallelism.get("tp", 1)}
    eager = ranks(world).run(_losses, _spec(tmp_path / "a", parallelism=parallelism, data=data))[0]
    spec = _spec(tmp_path / "b", parallelism=parallelism, training={"compile": True, **training}, data=data)
    compiled, graphs = ranks(world).run(_compiled_losses_and_graphs, spec)[0]
    assert compiled == pytest.approx(eager, abs=1e-5)
    assert graphs >= 2  # one block graph (shared by the blocks) and the loss


def _compiled_losses_and_graphs(spec):
    import torch._dynamo.utils

    torch._dynamo.reset()  # a rank process may have compiled before: count this run's graphs only
    torch._dynamo.utils.counters.clear()
    losses = _losses(spec)
    return losses, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compile_rejects_a_machine_without_a_compiler(tmp_path, monkeypatch):
    from hpservice.train._compile import check_compile_available

    assert check_compile_available("cpu") is None  # .ci/run's machine has g++ and Python's headers
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/c++"))
    reason = check_compile_available("cpu")
    assert reason is not None and "needs a C++ compiler" in reason
    with pytest.raises(TrainingError, match="needs a C"):
        Trainer(_spec(tmp_path, training={"compile": True}), log_to_stdout=False)


def test_profile_writes_a_trace_per_rank_with_fsdp_phases(ranks, tmp_path):
    """metrics.profile: each rank writes a Chrome trace of the chosen steps, in which the steps
    and fully_shard's phases are labelled as in torch's FSDP2."""
    spec = _spec(tmp_path, training={"steps": 4}, metrics={"profile": {"start_step": 2, "steps": 2}})
    ranks(2).run(_run, spec)
    traces = sorted(p.name for p in tmp_path.glob("t-*/artifacts/*"))
    assert traces == ["rank0-steps2-3.trace.json", "rank1-steps2-3.trace.json"]
    (trace,) = tmp_path.glob("t-*/artifacts/rank0-*.trace.json")
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"train_step#2", "train_step#3"} <= names and "train_step#1" not in names
    for phase in ("all_gather", "all_gather_copy_out", "post_backward_reduce", "post_backward_rs_wait", "pre_backward"):
        assert any(n.startswith(f"FSDP::{phase}") for n in names), phase
    assert "FSDP::all_gather (layers.1)" in names  # named by module


def test_every_step_reports_flops_mfu_and_memory(tmp_path):
    """MFU against the CPU's measured matmul peak; FLOPs per token with and without attention from
    the model's shape; the resident set size."""
    from hpservice.models import flops_per_token, model_config

    history = _run(_spec(tmp_path, training={"steps": 2}))
    cfg = model_config("llama", "tiny")
    for r in history:
        assert r["flops_per_token"] == flops_per_token(cfg, 32)
        assert r["flops_per_token_no_attention"] == flops_per_token(cfg, 32) - 12 * cfg.n_layers * cfg.dim * 32
        assert r["peak_tflops_per_rank"] > 0 and r["mfu"] > 0  # no bound from timings: the probe and the step may see different loads
        assert r["mfu"] == pytest.approx(r["achieved_tflops_per_rank"] / r["peak_tflops_per_rank"])
        assert r["mfu_no_attention"] < r["mfu"]
        assert 0 < r["rss_gib"] <= r["peak_rss_gib"]


def test_peak_table_names_the_data_centre_gpus():
    from hpservice.train._utilisation import table_peak_flops

    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert table_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak_flops("NVIDIA H200", "fp32") == 67e12
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert table_peak_flops("NVIDIA L4", "fp32") == 30.3e12
    assert table_peak_flops("Tesla T4", "bf16") is None


@pytest.mark.parametrize(
    ("world", "parallelism"),
    [(4, {"dp_replicate": 2}), (2, {"cpu_offload": True}), (4, {"tp": 2, "sequence_parallel": True})],
    ids=["hsdp", "cpu-offload", "fsdp2xtp2-sp"],
)
def test_full_activation_checkpointing_composes_with_hsdp_offload_and_sp(ranks, tmp_path, world, parallelism):
    plain = ranks(world).run(_losses_and_grad_norms, _spec(tmp_path / "a", parallelism=parallelism))[0]
    spec = _spec(tmp_path / "b", parallelism=parallelism, training={"steps": 4, "activation_checkpointing": "full"})
    checkpointed = ranks(world).run(_losses_and_grad_norms, spec)[0]
    for (la, ga), (lb, gb) in zip(plain, checkpointed, strict=True):
        assert la == pytest.approx(lb, abs=1e-6) and ga == pytest.approx(gb, abs=1e-6)


def test_tensor_parallelism_comes_from_the_familys_bundle(tmp_path):
    """The trainer takes the plan the family's ModelSpec declares (the decoders': torchtitan's
    parallelize_llama); a family without one, or a custom model without a parallelize method,
    gets the reason."""
    from hpservice.models import factory_model_spec, model_spec
    from hpservice.models.llama import parallelize_llama
    from hpservice.train import apply_tp

    assert all(model_spec(n).parallelize is parallelize_llama for n in ("llama", "qwen3", "qwen3_moe", "deepseek_v3"))
    spec = _spec(tmp_path, parallelism={"tp": 2})
    with pytest.raises(TrainingError, match=r"needs a tensor-parallel plan, and mlp has none"):
        apply_tp(nn.Linear(2, 2), None, spec, model_spec("mlp"))
    bundle = factory_model_spec("pkg.mod:make", nn.Linear(2, 2))
    with pytest.raises(TrainingError, match=r"pkg.mod:make has none .*parallelize\(tp_mesh, sequence_parallel=\.\.\.\) method"):
        apply_tp(nn.Linear(2, 2), None, spec, bundle)


def _fsdp_profiler_labels(kind: str) -> list[str]:
    """The FSDP:: ranges of one training step of a 2-block model under torch's fully_shard or ours,
    without their module names."""
    import re

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    if kind == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    else:
        from hpservice.dtensor import init_device_mesh
        from hpservice.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))
    for block in (model[0], model[2], model):
        fully_shard(block, mesh=mesh)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # lazy init and the prefetch order happen here
    with torch.profiler.profile() as prof:
        model(x).sum().backward()
    return sorted({re.sub(r" (\(.*\)|for .*)$", "", e.name) for e in prof.events() if e.name.startswith("FSDP::")})


def test_fsdp_profiler_ranges_carry_torch_fsdp2s_names(ranks):
    """Every range torch's FSDP2 records in a step, ours records too (ours adds finer ones)."""
    torch_labels = ranks(2).run(_fsdp_profiler_labels, "torch")[0]
    ours = ranks(2).run(_fsdp_profiler_labels, "ours")[0]
    assert len(torch_labels) >= 8 and set(torch_labels) <= set(ours), sorted(set(torch_labels) - set(ours))


@pytest.mark.parametrize(
    ("use_gpu", "gpus", "local_world", "expected"),
    [("auto", 0, 1, "cpu"), ("auto", 1, 2, "cpu"), ("auto", 2, 2, "cuda"), (False, 2, 2, "cpu"), (True, 1, 2, "cuda")],
)
def test_the_device_follows_the_one_gpu_rule(tmp_path, monkeypatch, use_gpu, gpus, local_world, expected):
    """``use_gpu: auto`` under torchrun: a GPU per rank only when this node has one for every rank
    (``ResourcesSpec.gpus_per_worker``, the rule the coordinator applies under Ray)."""
    from hpservice.train import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_RANK", "1")
    spec = _spec(tmp_path).model_copy(update={"resources": _spec(tmp_path).resources.model_copy(update={"use_gpu": use_gpu})})
    assert pick_device(spec).type == expected


def test_use_gpu_true_without_a_gpu_is_refused(tmp_path, monkeypatch):
    from hpservice.train import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = _spec(tmp_path).model_copy(update={"resources": _spec(tmp_path).resources.model_copy(update={"use_gpu": True})})
    with pytest.raises(TrainingError, match=r"resources\.use_gpu is true but no CUDA device"):
        pick_device(spec)
