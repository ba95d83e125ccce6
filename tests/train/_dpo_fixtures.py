"""A tiny Qwen3 with a ChatML tokenizer and preference pairs, for the DPO tests: the tokenizer is
a byte-level BPE trained here, the model random (transformers' from_config), the pairs generated."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat" / "chat_template.jinja"
WORDS = ["red", "blue", "green", "cat", "dog", "river", "stone", "light", "yes", "no", "maybe", "often"]


def make_tokenizer(out: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    texts = [" ".join(WORDS)] * 4 + ["user assistant system", "Which is better?"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE.read_text(),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))  # fmt: skip
    return out


def make_base(out: Path, vocab: int = 320) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_pairs(out: Path, n: int = 16, conversational: bool = True, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(out, "w") as f:
        for _ in range(n):
            prompt, chosen, rejected = _sentence(rng, rng.randint(2, 6)), _sentence(rng, rng.randint(1, 5)), _sentence(rng, rng.randint(1, 5))
            while rejected == chosen:
                rejected = _sentence(rng, rng.randint(1, 5))
            if conversational:
                record = {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
                          "rejected": [{"role": "assistant", "content": rejected}]}  # fmt: skip
            else:
                record = {"prompt": prompt + " ?", "chosen": " " + chosen, "rejected": " " + rejected}
            f.write(json.dumps(record) + "\n")
    return out
