"""The text side of a Hugging Face checkpoint: special token ids, ``generation_config.json`` and
the tokenizer files, carried from where a run starts to where it is exported and generated from.

A run records a ``TextRecord`` (a plain dict, stored in its checkpoints' ``extra/rank-0.pt``):

- from ``model.init_from``: the source ``config.json``'s token ids and ``max_position_embeddings``
  (a job's ``max_seq_len`` override is how much context it trains on, not what the model
  supports), its ``generation_config.json``, and its tokenizer files;
- from ``data.tokenizer`` (a model trained from scratch): the ``tokenizer.json``, the ids of its
  end-of-text tokens (``hpservice.data.EOS_CANDIDATES``) and of the BOS it adds to a document, and
  a ``tokenizer_config.json`` that lets ``AutoTokenizer`` load it.

The files are recorded as text, read by the worker (confined to the job's inputs like every
input) when the run starts. An export writes them from the checkpoint alone and opens nothing a
tenant's checkpoint names. ``transformers``' ``generate`` on an export then stops where
``hpservice generate`` does.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpservice.inputs import MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, load_json, read_input

__all__ = ["MAX_VOCAB", "TOKENIZER_FILES", "load_tokenizer", "record_from_hf", "record_from_tokenizer", "stop_ids", "write_text_files"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
MAX_VOCAB = 1 << 21  # tokens in one tokenizer (Gemma 3 has 262,144): more is not a vocabulary


def _read_text(path: Path) -> str | None:
    """A text file of the record, bounded as its kind is (``hpservice.inputs``); None if absent."""
    if not path.is_file():
        return None
    limit = MAX_TOKENIZER_BYTES if path.name == "tokenizer.json" else MAX_JSON_BYTES
    text = read_input(path, limit).decode("utf-8")
    if path.suffix == ".json" and limit == MAX_JSON_BYTES:  # bounded in structure too, before it is stored or parsed again
        load_json(text, str(path))
    return text


def record_from_hf(directory: str | Path) -> dict:
    """The text record of a Hugging Face checkpoint directory (what it has of it): of its
    ``config.json`` and ``generation_config.json`` only the keys generation uses, validated."""
    from .hf import _read_config
    from .hf_config import generation_config, validated_config

    directory = Path(directory)
    config = validated_config(_read_config(directory), directory / "config.json")
    generation = _read_text(directory / "generation_config.json")
    files = {name: text for name in TOKENIZER_FILES if (text := _read_text(directory / name)) is not None}
    where = directory / "generation_config.json"
    return {
        "config": {k: config[k] for k in CONFIG_KEYS if k in config},
        "generation_config": generation_config(load_json(generation, str(where)), where) if generation else None,
        "files": files,
    }


def load_tokenizer(path: str | Path, text: str | None = None):
    """A ``tokenizers`` Tokenizer from the ``tokenizer.json`` at ``path`` (or its ``text``),
    bounded in bytes (``MAX_TOKENIZER_BYTES``) and vocabulary (``MAX_VOCAB``); its JSON is parsed
    by ``tokenizers`` itself, whose parser bounds nesting (128 levels)."""
    from tokenizers import Tokenizer

    if text is None:
        text = read_input(path, MAX_TOKENIZER_BYTES).decode("utf-8")
    tok = Tokenizer.from_str(text)
    if tok.get_vocab_size(with_added_tokens=True) > MAX_VOCAB:
        raise ValueError(f"{path}: a vocabulary of {tok.get_vocab_size(with_added_tokens=True)} tokens, more than {MAX_VOCAB}")
    return tok


def record_from_tokenizer(path: str | Path) -> dict:
    """The text record of a model trained from scratch on ``path`` (a ``tokenizer.json``)."""
    from hpservice.data import EOS_CANDIDATES

    text = _read_text(Path(path))
    if text is None:
        raise ValueError(f"{path}: no such file")
    tok = load_tokenizer(path, text)
    eos = [(t, tok.token_to_id(t)) for t in EOS_CANDIDATES if tok.token_to_id(t) is not None]
    added = tok.encode("", add_special_tokens=True).ids
    bos_id = added[0] if len(added) == 1 else None
    bos = tok.id_to_token(bos_id) if bos_id is not None else None
    ids = {"bos_token_id": bos_id, "eos_token_id": eos[0][1] if eos else None}
    config = {k: v for k, v in ids.items() if v is not None}
    generation = dict(config)
    if len(eos) > 1:
        generation["eos_token_id"] = [i for _, i in eos]  # stop at any of them (Llama 3 instruct's <|eot_id|> too)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if bos is not None:
        tokenizer_config["bos_token"] = bos
    if eos:
        tokenizer_config["eos_token"] = eos[0][0]
    return {
        "config": config,
        "generation_config": generation or None,
        "files": {"tokenizer.json": text, "tokenizer_config.json": json.dumps(tokenizer_config, indent=2)},
    }


def write_text_files(record: dict | None, out: Path) -> list[str]:
    """``generation_config.json`` and the tokenizer files of ``record`` into ``out``; their names."""
    if not record:
        return []
    written = []
    from .hf_config import generation_config

    # only the keys generation uses, validated: a record written before they were filtered may hold anything
    generation = generation_config(record.get("generation_config"), Path("generation_config"))
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
        written.append("generation_config.json")
    for name, text in (record.get("files") or {}).items():
        if name in TOKENIZER_FILES:  # only these names: a record is data, never a path
            (out / name).write_text(text)
            written.append(name)
    return written


def stop_ids(record: dict | None, tokenizer=None) -> set[int]:
    """The token ids generation stops at: the record's ``generation_config`` (else its
    ``config``) ``eos_token_id``, and every end-of-text token of ``tokenizer`` (a ``tokenizers``
    Tokenizer) when one is given."""
    from hpservice.data import EOS_CANDIDATES

    found: set[int] = set()
    for source in ((record or {}).get("generation_config"), (record or {}).get("config")):
        value = (source or {}).get("eos_token_id")
        if value is not None:
            found.update(value if isinstance(value, list) else [value])
            break
    if tokenizer is not None:
        found.update(i for t in EOS_CANDIDATES if (i := tokenizer.token_to_id(t)) is not None)
    return found
