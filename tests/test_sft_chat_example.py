"""The README's chat fine-tuning example, end to end and offline (shortened): a tokenizer carrying a
chat template, a tiny Qwen3 in Hugging Face format, SFT on examples/chat's multi-turn JSONL with
packing and a held-out chat set on a local Ray, export (the tokenizer and template with it), and a
chat generation."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_chat_fine_tuning_example_runs_end_to_end(tmp_path):
    env = {**os.environ, "WORKDIR": str(tmp_path), "STEPS": "20"}
    out = subprocess.run([str(ROOT / "examples" / "sft-chat-cpu.sh")], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUCCEEDED: finished 20 steps" in out.stdout
    (run,) = tmp_path.glob("runs/sft-chat-cpu-*/metrics.jsonl")
    records = [json.loads(line) for line in run.read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [20]
    assert all(r["trained_tokens"] > 0 and 0 < r["packing_efficiency"] <= 1 for r in records)
    assert records[0]["loss"] > records[-1]["loss"]
    exported = tmp_path / "runs" / "sft-chat-example" / "finetuned-hf"
    base = tmp_path / "runs" / "sft-chat-example" / "base-hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the input's, as they were
        assert (exported / name).read_bytes() == (base / name).read_bytes(), name
    # the generation: the assistant's answer alone (the template and the stop token applied)
    answer = out.stdout.rstrip().splitlines()[-1]
    assert answer and "<|im_start|>" not in answer and "<|im_end|>" not in answer, out.stdout[-2000:]
