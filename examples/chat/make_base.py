"""A tiny Qwen3 base model in Hugging Face format and a tokenizer carrying the example's chat
template, trained on examples/chat/conversations.jsonl: what the chat examples start from.

Usage: python examples/chat/make_base.py REPO OUT  (writes OUT/base-hf)
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hpservice.models.hf import save_hf_pretrained
from hpservice.models.llama import LlamaConfig
from hpservice.models.qwen3 import Qwen3

repo, out = Path(sys.argv[1]), Path(sys.argv[2])
lines = (repo / "examples/chat/conversations.jsonl").read_text().splitlines()
texts = [m["content"] for line in lines for m in json.loads(line)["messages"]]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
special = [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts * 4, trainer)
base = out / "base-hf"
torch.manual_seed(0)
cfg = LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, attn_head_dim=32, hidden_dim=256, qk_norm=True,
                  vocab_size=tok.get_vocab_size(), max_seq_len=256, rope_theta=1000000.0, norm_eps=1e-6)  # fmt: skip
save_hf_pretrained(Qwen3(cfg), base)
tok.save(str(base / "tokenizer.json"))
shutil.copy(repo / "examples/chat/chat_template.jinja", base / "chat_template.jinja")
config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
(base / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
print(f"base model and tokenizer: {base} (vocab {tok.get_vocab_size()})")
