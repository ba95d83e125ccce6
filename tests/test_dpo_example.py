"""The README's DPO example (shortened, its SFT stage replaced by a peft-made adapter so one Ray run
is left): examples/dpo-cpu.yaml aligns a LoRA adapter on examples/chat/pairs.jsonl with fully_shard
on a local Ray, reports TRL's metrics, and exports an adapter that peft loads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_dpo_example_runs_from_an_sft_adapter(tmp_path):
    import peft
    import transformers

    base_dir = tmp_path / "runs" / "lora-chat-example"
    made = subprocess.run([sys.executable, str(ROOT / "examples/chat/make_base.py"), str(ROOT), str(base_dir)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir / "base-hf")
    torch.manual_seed(0)  # what SFT would have left: an adapter with a non-zero B (examples/dpo-cpu.sh trains one)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "runs" / "dpo-example" / "sft-adapter")
    env = {**os.environ}
    cmd = ["hpservice", "run", str(ROOT / "examples/dpo-cpu.yaml"), "--set", "training.steps=6", "--set",
           "checkpoint.interval=6", "--set", f"data.path={ROOT / 'examples/chat/pairs.jsonl'}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUCCEEDED: finished 6 steps" in out.stdout
    (metrics,) = tmp_path.glob("runs/dpo-cpu-*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = records[0]  # the reference is the starting adapter: no margin at step 1, log 2 of loss
    assert abs(first["rewards/margins"]) < 1e-6 and abs(first["loss"] - 0.6931) < 1e-3
    assert all(k in records[-1] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen"))
    (step,) = tmp_path.glob("runs/dpo-cpu-*/checkpoints/step-00000006")
    exported = subprocess.run(["hpservice", "export", "--format", "peft", str(step), str(tmp_path / "dpo-adapter")],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-2000:]
    fresh = transformers.AutoModelForCausalLM.from_pretrained(base_dir / "base-hf")
    assert peft.PeftModel.from_pretrained(fresh, tmp_path / "dpo-adapter") is not None
