#!/usr/bin/env bash
# LoRA end to end, offline, on CPU: the chat examples' tiny Qwen3 base, LoRA fine-tuning on
# examples/chat's conversations, the adapter exported in PEFT's format and loaded by peft onto the
# Hugging Face base, the merged model exported and asked a question. Writes under runs/ of WORKDIR
# (default: the repository). STEPS=N shortens the run.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "${WORKDIR:-$repo}"
out=runs/lora-chat-example
mkdir -p "$out"
python "$repo/examples/chat/make_base.py" "$repo" "$out"
hpservice run "$repo/examples/lora-chat-cpu.yaml" --set "training.steps=${STEPS:-60}" --set "checkpoint.interval=${STEPS:-60}" \
  --set "data.path=$repo/examples/chat/conversations.jsonl"
run=$(ls -td runs/lora-chat-cpu-*/ | head -1)
step=$(ls -d "$run"checkpoints/step-* | tail -1)
hpservice export --format peft "$step" "$out/adapter"
python - "$out" <<'PY'
import sys
from pathlib import Path
import peft, transformers
out = Path(sys.argv[1])
model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(out / "base-hf"), out / "adapter")
print(f"peft loaded the adapter: {sum(p.numel() for n, p in model.named_parameters() if 'lora_' in n):,} adapter parameters")
PY
hpservice export --format hf "$step" "$out/merged-hf"
hpservice generate "$out/merged-hf" --messages '[{"role": "user", "content": "What is 7 plus 5?"}]' --max-new-tokens 24
