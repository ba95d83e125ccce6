"""The tiny-Llama training job the trainer and Ray tests share (one builder), and running it on a rank."""

from pathlib import Path

from hpservice.spec import parse_job
from hpservice.train import Trainer


def tiny_llama_job(tmp, name="t", **sections):
    """A 4-step tiny Llama job on synthetic tokens writing under ``tmp``; each keyword merges into
    that section of the spec (``training={"steps": 6}``, ``parallelism={"tp": 2}``)."""
    data = {
        "name": name,
        "model": {"name": "llama", "flavor": "tiny"},
        "data": {"kind": "synthetic", "seq_len": 32, "global_batch": 8},
        "training": {"steps": 4, "max_grad_norm": 1.0},
        "optimizer": {"lr": 3.0e-3, "weight_decay": 0.01},
        "lr_scheduler": {"warmup_steps": 2},
        "metrics": {"dir": str(tmp)},
        "checkpoint": {"dir": str(Path(tmp) / "ckpt")},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_job(data)


def ray_job(tmp, name, **sections):
    """``tiny_llama_job`` as the Ray tests run it: 6 steps on 2 CPU workers, metrics under
    ``tmp/metrics``; keywords merge into sections the same way."""
    preset = {
        "training": {"steps": 6},
        "resources": {"workers": 2, "use_gpu": False},
        "metrics": {"dir": str(Path(tmp) / "metrics")},
    }
    for key, value in sections.items():
        preset[key] = {**preset.get(key, {}), **value}
    return tiny_llama_job(tmp, name, **preset)


def train(spec) -> list[dict]:
    """Run the job on the calling rank; the per-step metric records."""
    return Trainer(spec, log_to_stdout=False).train()
