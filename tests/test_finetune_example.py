"""The README's fine-tune example, end to end and offline (shortened): tokenizer and token files
from the repository's docs, a Hugging Face-format base model, fine-tuning with validation on a
local Ray, export to Hugging Face format, generation."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_finetune_example_runs_end_to_end(tmp_path):
    env = {**os.environ, "WORKDIR": str(tmp_path), "STEPS": "20"}
    out = subprocess.run([str(ROOT / "examples" / "finetune-cpu.sh")], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUCCEEDED: finished 20 steps" in out.stdout
    (run,) = tmp_path.glob("runs/finetune-cpu-*/metrics.jsonl")
    records = [json.loads(line) for line in run.read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [20]  # eval interval 20: once, at the end
    exported = tmp_path / "runs" / "finetune-example" / "finetuned-hf"
    assert (exported / "config.json").is_file() and list(exported.glob("model-*.safetensors"))
    # the generation: the prompt, then what the model wrote (any text: the tokenizer is trained on
    # the repository's docs, so the words, and the newlines among them, change as the docs do)
    assert "\nThe trainer" in out.stdout, out.stdout[-2000:]
