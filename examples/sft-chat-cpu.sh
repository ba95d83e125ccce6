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
python - "$repo" "$out" <<'PY'
import json, shutil, sys
from pathlib import Path
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from hpservice.models.hf import save_hf_pretrained
from hpservice.models.llama import LlamaConfig
from hpservice.models.qwen3 import Qwen3
repo, out = Path(sys.argv[1]), Path(sys.argv[2])
texts = [m["content"] for line in open(repo / "examples/chat/conversations.jsonl") for m in json.loads(line)["messages"]]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
special = [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
tok.train_from_iterator(texts * 4, trainers.BpeTrainer(vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
base = out / "base-hf"
torch.manual_seed(0)
cfg = LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, attn_head_dim=32, hidden_dim=256, qk_norm=True,
                  vocab_size=tok.get_vocab_size(), max_seq_len=256, rope_theta=1000000.0, norm_eps=1e-6)
save_hf_pretrained(Qwen3(cfg), base)
tok.save(str(base / "tokenizer.json"))
shutil.copy(repo / "examples/chat/chat_template.jinja", base / "chat_template.jinja")
(base / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1))
print(f"base model and tokenizer: {base} (vocab {tok.get_vocab_size()})")
PY
hpservice run "$repo/examples/sft-chat-cpu.yaml" --set "training.steps=${STEPS:-60}" --set "checkpoint.interval=${STEPS:-60}" \
  --set "data.path=$repo/examples/chat/conversations.jsonl" --set "eval.data.path=$repo/examples/chat/eval.jsonl"
run=$(ls -td runs/sft-chat-cpu-*/ | head -1)
step=$(ls -d "$run"checkpoints/step-* | tail -1)
hpservice export --format hf "$step" "$out/finetuned-hf"
hpservice generate "$out/finetuned-hf" --messages '[{"role": "user", "content": "What is the capital of Italy?"}]' --max-new-tokens 24
