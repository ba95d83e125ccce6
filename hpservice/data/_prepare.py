"""``hpservice prepare-data``: text and JSONL corpora -> token files, with a Hugging Face tokenizer.

- Inputs: ``*.jsonl`` (one JSON object per line, the document in ``field``, default ``text``),
  ``*.parquet`` (the string column ``field``, read in record batches with pyarrow), or any other
  file as one UTF-8 document. Documents are tokenized with a ``tokenizers``
  ``tokenizer.json`` (its Rust ``encode_batch`` runs on all cores) with the tokenizer's own
  special tokens (Llama 3's ``<|begin_of_text|>`` before each document; none for GPT-2 or Qwen),
  and the end-of-text token after each document (once: a tokenizer that adds it already keeps it).
- Output: a token file in the format ``TokenFile`` reads (uint16 for vocabularies up to 65536,
  else uint32, which needs a ``*.u32.bin`` name), written next to its name and renamed, plus
  ``<out>.json``: tokenizer SHA-256, vocab size, dtype, documents, tokens, EOS id. The trainer
  checks that metadata against the model's vocabulary before any step.
- ``val_fraction``: that share of the documents (every k-th one, so the split does not depend on
  file order within a document) goes to ``val_path(out)`` instead (``train.bin`` ->
  ``train-val.bin``, ``train.u32.bin`` -> ``train-val.u32.bin``); a split that would get no
  document is refused.
- ``train_tokenizer``: a byte-level BPE tokenizer of ``vocab_size`` trained on the inputs, for
  users who have none (saved to the tokenizer path).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hpservice.inputs import (
    MAX_DOCUMENT_BYTES,
    MAX_JSON_BYTES,
    MAX_TOKENIZER_BYTES,
    InputError,
    load_json,
    open_input,
    read_input,
    read_lines,
)

from ._files import write_token_file

__all__ = [
    "EOS_CANDIDATES",
    "DataPrepError",
    "metadata_path",
    "prepare_data",
    "read_metadata",
    "token_file_suffix",
    "tokenizer_vocab_size",
    "train_tokenizer",
    "val_path",
]

FORMAT = 1
# A document's end in the common tokenizers: GPT-2 / Qwen, Llama 3 (base), Llama 2 / Mistral,
# Gemma, Llama 3 (instruct turns), Qwen chat turns. The first one a tokenizer has ends documents.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
U16_VOCAB = 1 << 16  # the largest vocabulary a uint16 token file holds


def token_file_suffix(vocab_size: int) -> str:
    """The token file name ending a vocabulary needs: ``.bin`` (uint16) or ``.u32.bin``."""
    return ".bin" if vocab_size <= U16_VOCAB else ".u32.bin"


def val_path(out: str | Path) -> Path:
    """The validation split written next to ``out``: its stem + ``-val``, same dtype suffix."""
    out = Path(out)
    for suffix in (".u32.bin", ".bin"):
        if out.name.endswith(suffix):
            return out.with_name(out.name[: -len(suffix)] + "-val" + suffix)
    return out.with_name(out.name + "-val")


def tokenizer_vocab_size(tokenizer: str | Path) -> int:
    """The vocabulary of a ``tokenizer.json`` (added tokens included), read confined and bounded
    (``hpservice.models.hf_text.load_tokenizer``)."""
    from hpservice.models.hf_text import load_tokenizer

    return load_tokenizer(tokenizer).get_vocab_size(with_added_tokens=True)


class DataPrepError(ValueError):
    """Bad input for data preparation: names the file (and line) and what is wrong."""


def metadata_path(token_file: str | Path) -> Path:
    return Path(str(token_file) + ".json")


def read_metadata(token_file: str | Path) -> dict | None:
    path = metadata_path(token_file)
    if not path.is_file():
        return None
    try:
        return load_json(read_input(path, MAX_JSON_BYTES), str(path))
    except ValueError as e:
        raise DataPrepError(str(e)) from None


def _documents(inputs: list[Path], field: str) -> Iterator[str]:
    for path in inputs:
        if not path.is_file():
            raise DataPrepError(f"{path}: no such file")
        if path.suffix == ".parquet":
            yield from _parquet_documents(path, field)
            continue
        if path.suffix == ".jsonl":
            with open_input(path, "r") as f:
                for n, line in enumerate(read_lines(f, MAX_DOCUMENT_BYTES, str(path)), start=1):
                    if not line.strip():
                        continue
                    try:
                        doc = json.loads(line)
                    except ValueError as e:
                        raise DataPrepError(f"{path}:{n}: not valid JSON ({e})") from None
                    text = doc.get(field) if isinstance(doc, dict) else None
                    if not isinstance(text, str):
                        raise DataPrepError(f"{path}:{n}: no string field {field!r} (use --field NAME)")
                    yield text
        else:
            try:
                with open_input(path, "r") as f:
                    text = f.read(MAX_DOCUMENT_BYTES + 1)
                if len(text) > MAX_DOCUMENT_BYTES:
                    raise DataPrepError(f"{path}: longer than {MAX_DOCUMENT_BYTES} characters, more than one document may hold (split it)")
                yield text
            except UnicodeDecodeError as e:
                raise DataPrepError(f"{path}: not UTF-8 text ({e})") from None


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    """The string column ``field`` of a Parquet file, read in record batches (pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataPrepError(f"{path}: Parquet input needs pyarrow (pip install pyarrow)") from None
    source = open_input(path)  # confined when opened; pyarrow reads this very file
    try:
        handle = pq.ParquetFile(source)
    except Exception as e:  # pyarrow's own error types for a file that is not Parquet
        source.close()
        raise DataPrepError(f"{path}: not a Parquet file ({e})") from None
    if field not in handle.schema_arrow.names:
        source.close()
        raise DataPrepError(f"{path}: no column {field!r} (columns: {', '.join(handle.schema_arrow.names)}; use --field)")
    row = 0
    with source:
        for batch in handle.iter_batches(columns=[field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                if not isinstance(value, str):
                    raise DataPrepError(f"{path}: row {row}: column {field!r} is not a string ({type(value).__name__})")
                yield value


def train_tokenizer(inputs: list[str | Path], out: str | Path, vocab_size: int, *, field: str = "text") -> Path:
    """Train a byte-level BPE tokenizer of ``vocab_size`` on the inputs; returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_documents([Path(p) for p in inputs], field), trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def prepare_data(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer: str | Path,
    *,
    field: str = "text",
    val_fraction: float = 0.0,
    eos_token: str | None = None,
    batch_size: int = 256,
    progress: bool = False,
) -> dict:
    """Tokenize ``inputs`` into ``out`` (and its validation split); returns the metadata written."""
    from hpservice.models.hf_text import load_tokenizer

    tokenizer = Path(tokenizer)
    try:  # read once, confined and bounded: the hash below is of what was loaded
        tokenizer_bytes = read_input(tokenizer, MAX_TOKENIZER_BYTES)
        tok = load_tokenizer(tokenizer, tokenizer_bytes.decode("utf-8"))
    except InputError:
        raise
    except Exception as e:  # tokenizers raises its own exception type for unreadable files
        raise DataPrepError(f"{tokenizer}: cannot load a tokenizers tokenizer.json ({e})") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = eos_token or next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    if eos is None or tok.token_to_id(eos) is None:
        raise DataPrepError(f"{tokenizer}: no end-of-text token found ({', '.join(EOS_CANDIDATES)}); pass --eos-token")
    eos_id = tok.token_to_id(eos)
    out = Path(out)
    dtype = np.uint16 if vocab <= U16_VOCAB else np.uint32
    if dtype is np.uint32 and not out.name.endswith(".u32.bin"):
        raise DataPrepError(f"{out}: a vocabulary of {vocab} needs uint32 tokens: name the file *.u32.bin")
    if not 0.0 <= val_fraction < 1.0:
        raise DataPrepError(f"val_fraction must be in [0, 1), got {val_fraction}")
    every = round(1 / val_fraction) if val_fraction else 0
    splits = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    docs = _documents([Path(p) for p in inputs], field)
    bar = _progress(progress)
    index = 0
    while True:
        batch = [d for _, d in zip(range(batch_size), docs, strict=False)]
        if not batch:
            break
        for enc in tok.encode_batch(batch, add_special_tokens=True):  # BOS where the tokenizer adds one
            split = "val" if every and index % every == every - 1 else "train"
            ids = enc.ids if enc.ids[-1:] == [eos_id] else [*enc.ids, eos_id]
            splits[split].append(np.asarray(ids, dtype=np.int64))
            counts[split] += 1
            index += 1
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    if not counts["train"]:
        raise DataPrepError(f"no documents in {', '.join(map(str, inputs))}")
    if every and not counts["val"]:
        raise DataPrepError(
            f"--val-fraction {val_fraction:g} takes every {every}th document, and there are {counts['train']}: the "
            f"validation split would be empty; give at least {every} documents (a JSONL file holds one per line; "
            "any other file is one document) or a larger fraction"
        )
    sha = hashlib.sha256(tokenizer_bytes).hexdigest()
    written = {}
    for split, arrays in splits.items():
        if split == "val" and not every:
            continue
        path = out if split == "train" else val_path(out)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_token_file(path, tokens, dtype)
        meta = {
            "format": FORMAT, "tokenizer": str(tokenizer), "tokenizer_sha256": sha, "vocab_size": vocab,
            "dtype": np.dtype(dtype).name, "documents": counts[split], "tokens": int(tokens.size), "eos_id": eos_id,
            "split": split, "added_special_ids": tok.encode("", add_special_tokens=True).ids,
        }  # fmt: skip
        metadata_path(path).write_text(json.dumps(meta, indent=2))
        written[split] = {"path": str(path), **meta}
    return written


def _progress(enabled: bool):
    if not enabled:
        return None
    from rich.progress import Progress

    class _Bar:
        def __init__(self):
            self.p = Progress(transient=True)
            self.p.start()
            self.task = self.p.add_task("tokenizing documents", total=None)

        def update(self, n):
            self.p.update(self.task, advance=n)

        def close(self):
            self.p.stop()

    return _Bar()
