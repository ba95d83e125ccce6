"""The README's LoRA example, end to end and offline (shortened): LoRA on examples/chat's
conversations with fully_shard on a local Ray, the adapter exported in PEFT's format and loaded
by peft, the merged model exported and asked a question."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_lora_example_runs_end_to_end(tmp_path):
    env = {**os.environ, "WORKDIR": str(tmp_path), "STEPS": "20"}
    out = subprocess.run([str(ROOT / "examples" / "lora-chat-cpu.sh")], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUCCEEDED: finished 20 steps" in out.stdout
    (run,) = tmp_path.glob("runs/lora-chat-cpu-*/metrics.jsonl")
    records = [json.loads(line) for line in run.read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    adapter = tmp_path / "runs" / "lora-chat-example" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"]) == ("LORA", 8)
    assert "peft loaded the adapter: 32,768 adapter parameters" in out.stdout  # 7 layers x 2 blocks, r 8
