"""Tokenizer directories carrying the real chat templates of Llama 3.1, Qwen2.5, Qwen3 and Mistral.

The templates are the models' own, as other tools ship them (read from the installed package, never
copied here): TRL's ``trl/chat_templates`` (Llama 3.1, Qwen2.5, Qwen3, and their ``_training``
variants with ``{% generation %}`` blocks) and axolotl's wheel (Mistral-7B-Instruct-v0.3's
``mistral_v2v3``; scripts/test downloads the wheel, without its dependencies). The vocabulary is a
small byte-level BPE trained here with each family's special tokens; Llama's and Mistral's
tokenizers add a BOS of their own (their post-processor), as the real ones do.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import zipfile
from pathlib import Path

AXOLOTL_WHEEL = "axolotl-0.19.0-py3-none-any.whl"
WHEEL_DIR = Path(os.environ.get("HPSERVICE_TEST_WHEELS", Path.home() / ".cache" / "hpservice-test-wheels"))

FAMILIES = {
    "llama3_1": {
        "template": ("trl", "llama3_1"), "training": ("trl", "llama3_training"),
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|eom_id|>", "<|python_tag|>"],
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None, "adds_bos": True,
    },
    "qwen2_5": {
        "template": ("trl", "qwen2_5"), "training": ("trl", "qwen2_5_training"),
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "adds_bos": False,
    },
    "qwen3": {
        "template": ("trl", "qwen3"), "training": ("trl", "qwen3_training"),
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
                    "<tool_response>", "</tool_response>"],
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "adds_bos": False,
    },
    "mistral": {
        "template": ("axolotl", "mistral_v2v3"), "training": None,
        "special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        "bos": "<s>", "eos": "</s>", "pad": None, "adds_bos": True, "unk": "<unk>",
    },
}  # fmt: skip

CORPUS = [
    "You are a helpful assistant. Be brief.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a haiku about the sea. Waves fold into foam, salt wind carries gull voices, the tide keeps its time.",
    "Call the weather tool for Paris. get_weather city Paris temperature 18 celsius sunny",
    "Thinking step by step: 2 + 2 = 4, so the answer is 4. Let me check the numbers once more.",
] * 20


def template_source(family: str, training: bool = False) -> str:
    package, name = FAMILIES[family]["training" if training else "template"]
    if package == "trl":
        return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()
    wheel = WHEEL_DIR / AXOLOTL_WHEEL
    if not wheel.is_file():
        raise FileNotFoundError(f"{wheel}: run scripts/test (it downloads {AXOLOTL_WHEEL} without dependencies)")
    with zipfile.ZipFile(wheel) as z:
        return z.read(f"axolotl/utils/chat_templates/templates/{name}.jinja").decode()


@functools.cache
def _tokenizer_json(family: str) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    f = FAMILIES[family]
    tok = Tokenizer(models.BPE(unk_token=f.get("unk")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in f["special"]])  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if f["adds_bos"]:  # Llama's and Mistral's tokenizers put a BOS before any text they encode
        bos = f["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok.to_str()


def tokenizer_dir(tmp: Path, family: str, *, training: bool = False, template: str | None = None) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) for ``family``."""
    f = FAMILIES[family]
    out = tmp / f"{family}{'-training' if training else ''}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_tokenizer_json(family))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template if template is not None else template_source(family, training),
        "bos_token": f["bos"], "eos_token": f["eos"], "pad_token": f["pad"], "unk_token": f.get("unk"),
        "add_bos_token": f["adds_bos"], "model_max_length": 4096,
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return out


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "What is the capital of France?"},
                 {"role": "assistant", "content": "Paris."}],
    "system, three turns": [
        {"role": "system", "content": "You are a helpful assistant. Be brief."},
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "tool call": [
        {"role": "user", "content": "Call the weather tool for Paris."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call0001x", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 celsius, sunny", "tool_call_id": "call0001x", "name": "get_weather"},
        {"role": "assistant", "content": "It is 18 celsius and sunny in Paris."},
    ],
}  # fmt: skip
