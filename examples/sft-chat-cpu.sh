#!/usr/bin/env bash
# Chat fine-tuning end to end, offline, on CPU: a tokenizer with a chat template, a tiny Qwen3 base
# model in Hugging Face format, SFT on the multi-turn JSONL in examples/chat (assistant turns only,
# packed), export to Hugging Face format, and a chat generation. Writes under runs/ of WORKDIR
# (default: the repository). STEPS=N shortens the run (the test uses it).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "${WORKDIR:-$repo}"
out=runs/sft-chat-example
mkdir -p "$out"
python "$repo/examples/chat/make_base.py" "$repo" "$out"
hpservice run "$repo/examples/sft-chat-cpu.yaml" --set "training.steps=${STEPS:-60}" --set "checkpoint.interval=${STEPS:-60}" \
  --set "data.path=$repo/examples/chat/conversations.jsonl" --set "eval.data.path=$repo/examples/chat/eval.jsonl"
run=$(ls -td runs/sft-chat-cpu-*/ | head -1)
step=$(ls -d "$run"checkpoints/step-* | tail -1)
hpservice export --format hf "$step" "$out/finetuned-hf"
hpservice generate "$out/finetuned-hf" --messages '[{"role": "user", "content": "What is the capital of Italy?"}]' --max-new-tokens 24
