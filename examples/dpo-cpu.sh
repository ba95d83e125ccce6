#!/usr/bin/env bash
# SFT then DPO with LoRA, offline, on CPU: the chat examples' tiny Qwen3 base, a LoRA SFT run on
# examples/chat's conversations (examples/lora-chat-cpu.yaml), its adapter exported in PEFT's format,
# then DPO from that adapter on examples/chat/pairs.jsonl (examples/dpo-cpu.yaml), exported again.
# Writes under runs/ of WORKDIR (default: the repository). SFT_STEPS=N / DPO_STEPS=N shorten it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "${WORKDIR:-$repo}"
base=runs/lora-chat-example
out=runs/dpo-example
mkdir -p "$base" "$out"
python "$repo/examples/chat/make_base.py" "$repo" "$base"
sft=${SFT_STEPS:-60}
hpservice run "$repo/examples/lora-chat-cpu.yaml" --set "training.steps=$sft" --set "checkpoint.interval=$sft" \
  --set "data.path=$repo/examples/chat/conversations.jsonl"
run=$(ls -td runs/lora-chat-cpu-*/ | head -1)
hpservice export --format peft "$(ls -d "$run"checkpoints/step-* | tail -1)" "$out/sft-adapter"
dpo=${DPO_STEPS:-40}
hpservice run "$repo/examples/dpo-cpu.yaml" --set "training.steps=$dpo" --set "checkpoint.interval=$dpo" \
  --set "data.path=$repo/examples/chat/pairs.jsonl"
run=$(ls -td runs/dpo-cpu-*/ | head -1)
hpservice export --format peft "$(ls -d "$run"checkpoints/step-* | tail -1)" "$out/dpo-adapter"
