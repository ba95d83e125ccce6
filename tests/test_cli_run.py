"""`hpservice run`: the README's main command, end to end on an embedded local Ray."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hpservice_run_tiny_example(tmp_path):
    cmd = [
        sys.executable, "-m", "hpservice", "run", str(ROOT / "examples" / "tiny-cpu.yaml"),
        "--set", "training.steps=5", "--set", "checkpoint.interval=5",
        "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", f"metrics.dir={tmp_path}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
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
