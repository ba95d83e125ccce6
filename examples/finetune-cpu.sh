#!/usr/bin/env bash
# The fine-tune example end to end, offline, on CPU: tokenizer + token files from the repository's
# own docs, a small Hugging Face-format base model, fine-tuning with validation, export to
# Hugging Face format, and a generation. Writes under runs/ of WORKDIR (default: the repository).
# STEPS=N shortens the run (the test uses it).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "${WORKDIR:-$repo}"
out=runs/finetune-example
mkdir -p "$out"
hpservice prepare-data "$repo/README.md" "$repo"/docs/*.md --train-tokenizer --vocab-size 512 \
  --tokenizer "$out/tokenizer.json" --out "$out/train.bin" --val-fraction 0.2
python - "$out" <<'PY'
import json, sys
from pathlib import Path
import torch
from hpservice.models.hf import save_hf_pretrained
from hpservice.models.llama import Llama, LlamaConfig
out = Path(sys.argv[1])
vocab = json.loads((out / "train.bin.json").read_text())["vocab_size"]
torch.manual_seed(0)
save_hf_pretrained(Llama(LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=128)), out / "base-hf")
print(f"base model: {out / 'base-hf'} (vocab {vocab})")
PY
hpservice run "$repo/examples/finetune-cpu.yaml" --set "training.steps=${STEPS:-100}" --set "checkpoint.interval=${STEPS:-50}"
run=$(ls -td runs/finetune-cpu-*/ | head -1)
step=$(ls -d "$run"checkpoints/step-* | tail -1)
hpservice export --format hf "$step" "$out/finetuned-hf"
hpservice generate "$out/finetuned-hf" --tokenizer "$out/tokenizer.json" --prompt "The trainer" --max-new-tokens 24
