"""`hpservice run`: the README's main command, end to end on an embedded local Ray."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hpservice_run_tiny_example(tmp_path):
    """The example with its layout left to ``parallelism: auto`` (its dp_replicate and grad_accum
    kept): chosen before Ray starts, run by every worker alike."""
    cmd = [
        sys.executable, "-m", "hpservice", "run", str(ROOT / "examples" / "tiny-cpu.yaml"),
        "--set", "training.steps=5", "--set", "checkpoint.interval=5", "--set", "parallelism.auto=true",
        "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", f"metrics.dir={tmp_path}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "parallelism: auto chose dp_shard" in out.stdout and "micro_batch 4" in out.stdout
    assert "SUCCEEDED: finished 5 steps" in out.stdout
    assert (tmp_path / "ckpt" / "step-00000005" / "manifest.json").is_file()
    (run,) = tmp_path.glob("tiny-cpu-*/metrics.jsonl")
    assert len(run.read_text().splitlines()) == 5


def test_hpservice_run_rejects_bad_spec(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nresources: {workers: 0}\n")
    out = subprocess.run(
        [sys.executable, "-m", "hpservice", "run", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "resources.workers" in out.stderr


MYMODELS = '''
import torch.nn as nn


class TinyLM(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def build(vocab=64, dim=8):
    return TinyLM(vocab, dim)
'''


def test_hpservice_run_ships_the_users_own_model_to_the_workers(tmp_path):
    """docs/models-and-data.md's own-model example: a package next to the job, not installed;
    ``runtime.py_modules`` ships it to the Ray workers (a plain nn.Module: reset_parameters init)."""
    (tmp_path / "src" / "mymodels").mkdir(parents=True)  # not in the working directory: nothing imports it
    (tmp_path / "src" / "mymodels" / "__init__.py").write_text(MYMODELS)
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: mine\nmodel: {name: 'mymodels:build', overrides: {dim: 16}}\n"
        "data: {vocab_size: 64, seq_len: 16, global_batch: 4}\ntraining: {steps: 2}\n"
        f"resources: {{workers: 1, use_gpu: false}}\nmetrics: {{dir: {tmp_path}}}\n"
    )
    run = [sys.executable, "-m", "hpservice", "run", str(job)]
    # not importable here: refused before Ray starts, naming the fix
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "cannot import module 'mymodels'" in out.stderr, out.stderr
    out = subprocess.run([*run, "--set", "runtime.py_modules=[./src/mymodels]"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "SUCCEEDED: finished 2 steps" in out.stdout
    (metrics,) = tmp_path.glob("mine-*/metrics.jsonl")
    assert len(metrics.read_text().splitlines()) == 2
