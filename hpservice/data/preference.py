"""Preference pairs for DPO: ``{prompt, chosen, rejected}`` records, tokenized as TRL's
``DPOTrainer`` does, batched so that a pair's two rows always travel together.

Records (JSONL, Parquet, a ``datasets`` directory: ``chat._records``) come in TRL's two forms:

- standard: each field a string. The prompt is tokenized alone and with each completion, with the
  tokenizer's special tokens (its BOS, where it adds one); each completion ends with the
  tokenizer's EOS text (appended where it does not already end with it);
- conversational: ``prompt`` a list of messages, ``chosen`` / ``rejected`` lists of the
  messages that answer it (an assistant turn). The prompt is rendered by the chat template with
  the generation prompt, the full conversations without; tokenized without adding special tokens
  (the template writes them).

The completion is what follows the common prefix of the prompt's tokens and the full sequence's;
where the prompt's tokens are not all a prefix of both (a template that renders the prompt alone
differently, or a token merging across the boundary) the record is refused, as are a missing
field and identical answers (``on_bad_record``: stop naming the file, line and field, or skip and
count). TRL warns and cuts the prompt there instead.

A pair becomes two rows of ``seq_len`` positions, its prompt and completion tokens as inputs and
the completion's tokens as labels (``IGNORE_INDEX`` elsewhere), padded. A pair whose longer side
exceeds ``seq_len`` tokens is dropped or cut at ``seq_len`` (``truncation``; TRL keeps the start
too), counted. A step's global batch is ``global_batch`` pairs: rows ``[c0, r0, c1, r1, ...]``,
so any split by rows into micro-batches or ranks of an even count keeps each pair whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading

import numpy as np
import torch

from ._base import TokenSource, check_int, local_batch_size, seeded_rng
from ._batch import IGNORE_INDEX, Batch
from .chat._corpus import ChatOptions, _alarm, _Timeout
from .chat._encode import ChatTokenizer
from .chat._formats import RecordError, _messages
from .chat._records import expand_paths, read_records
from .chat._template import ChatTemplate, TemplateLimitError

__all__ = ["PREFERENCE_FIELDS", "PreferencePairs", "PreferenceSource", "check_record", "encode_preferences"]

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")
TAG_PREFERENCE_ORDER = 12
TEMPLATE_SECONDS = ChatOptions(seq_len=1).template_seconds  # chat data's bound on one record


@dataclasses.dataclass
class PreferencePairs:
    """Encoded pairs: per pair the prompt's tokens and each completion's (what follows the prompt)."""

    prompts: list[np.ndarray]
    chosen: list[np.ndarray]
    rejected: list[np.ndarray]
    stats: dict  # records, pairs, skipped (bad records), dropped / truncated (longer than seq_len)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_record(record, fields: dict[str, str]) -> dict:
    """The record's prompt, chosen and rejected, checked for shape without rendering anything (the
    service checks a sample before start; a template is a tenant's code and runs only in the job)."""
    if not isinstance(record, dict):
        raise RecordError("record", f"expected an object, got {type(record).__name__}")
    values = {}
    for name in PREFERENCE_FIELDS:
        key = fields.get(name, name)
        if record.get(key) is None:
            raise RecordError(key, "missing")
        values[name] = record[key]
    strings = {isinstance(v, str) for v in values.values()}
    if len(strings) != 1:
        raise RecordError(fields.get("prompt", "prompt"), "prompt, chosen and rejected must all be strings or all lists of messages")
    if strings == {False}:
        for name in PREFERENCE_FIELDS:
            _messages(values[name], fields.get(name, name), "role", "content")
    if values["chosen"] == values["rejected"]:
        raise RecordError(fields.get("rejected", "rejected"), "identical to chosen: the pair prefers nothing")
    return values


class _Encoder:
    def __init__(self, tok: ChatTokenizer):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tok.tokenizer_json)
        self.template = ChatTemplate(tok.template, tok.special_tokens) if tok.template else None
        self.eos = tok.special_tokens.get("eos_token")
        self.where = tok.where

    def encode(self, record, fields: dict[str, str]) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, prompt + chosen ids, prompt + rejected ids) of one record."""
        values = check_record(record, fields)
        kinds = {name: isinstance(v, str) for name, v in values.items()}
        if kinds["prompt"]:
            enc = lambda text: self.tokenizer.encode(text, add_special_tokens=True).ids  # noqa: E731
            end = lambda text: text if self.eos is None or text.endswith(self.eos) else text + self.eos  # noqa: E731
            prompt = enc(values["prompt"])
            return prompt, enc(values["prompt"] + end(values["chosen"])), enc(values["prompt"] + end(values["rejected"]))
        if self.template is None:
            raise ValueError(
                f"data.chat_template: the tokenizer at {self.where} has no chat template, which conversational pairs need"
            )
        msgs = {name: _messages(values[name], fields.get(name, name), "role", "content") for name in PREFERENCE_FIELDS}
        enc = lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        prompt = enc(self.template.render(msgs["prompt"], add_generation_prompt=True).text)
        return (prompt, enc(self.template.render(msgs["prompt"] + msgs["chosen"]).text),
                enc(self.template.render(msgs["prompt"] + msgs["rejected"]).text))  # fmt: skip


@contextlib.contextmanager
def _time_bound(where: str):
    """``TEMPLATE_SECONDS`` for rendering and tokenizing one record (signals reach the main thread
    only: elsewhere the template's output bound still holds)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
    try:
        yield
    except _Timeout:
        raise RecordError("record", f"rendering and tokenizing it took longer than {TEMPLATE_SECONDS} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def encode_preferences(
    paths: list[str],
    tok: ChatTokenizer,
    *,
    seq_len: int,
    fields: dict[str, str] | None = None,
    truncation: str = "drop",
    on_bad_record: str = "error",
) -> PreferencePairs:
    """Every record of ``paths`` (files, globs, ``datasets`` directories) as a pair of token rows."""
    encoder, fields = _Encoder(tok), dict(fields or {})
    out = PreferencePairs([], [], [], {"records": 0, "pairs": 0, "skipped": 0, "dropped": 0, "truncated": 0})
    for path in paths:
        for file in expand_paths(path):
            for where, record in read_records(file):
                out.stats["records"] += 1
                try:
                    with _time_bound(where):  # a template is a tenant's code: bounded in time, as chat data's
                        prompt, with_chosen, with_rejected = encoder.encode(record, fields)
                    n = min(_common_prefix(prompt, with_chosen), _common_prefix(prompt, with_rejected))
                    if n < len(prompt):
                        raise RecordError(
                            fields.get("prompt", "prompt"),
                            "the prompt's tokens are not a prefix of the prompt with its answers (the chat template "
                            "renders the prompt alone differently, or a token merges across the boundary); the "
                            "model would learn from a context it never sees at inference",
                        )
                    if n == len(with_chosen) or n == len(with_rejected):
                        raise RecordError(fields.get("chosen", "chosen"), "an answer renders to no tokens")
                except (RecordError, TemplateLimitError) as e:
                    if on_bad_record == "skip":
                        out.stats["skipped"] += 1
                        continue
                    raise ValueError(f"{where}: {e}") from None
                if max(len(with_chosen), len(with_rejected)) > seq_len:
                    if truncation == "drop" or n >= seq_len:  # nothing of an answer would be left
                        out.stats["dropped"] += 1
                        continue
                    out.stats["truncated"] += 1
                out.prompts.append(np.asarray(prompt[:n], dtype=np.int64))
                out.chosen.append(np.asarray(with_chosen[n:seq_len], dtype=np.int64))
                out.rejected.append(np.asarray(with_rejected[n:seq_len], dtype=np.int64))
                out.stats["pairs"] += 1
    if not out.prompts:
        raise ValueError(f"data: no usable preference pair in {paths} ({out.stats})")
    return out


class PreferenceSource(TokenSource):
    """Batches of preference pairs (module docstring); an epoch is every pair in a seeded order."""

    every_label_valid = False
    num_tokens = None
    rows_per_sample = 2  # a sample is a pair: its chosen and rejected rows

    def __init__(self, pairs: PreferencePairs, *, seq_len: int, seed: int = 0, vocab_size: int | None = None, pad_id: int = 0):
        self.pairs, self.seq_len, self.seed, self.pad_id = pairs, seq_len, seed, pad_id
        top = max(int(max(a.max(initial=0), b.max(initial=0), c.max(initial=0)))
                  for a, b, c in zip(pairs.prompts, pairs.chosen, pairs.rejected, strict=True))  # fmt: skip
        self.vocab_size = vocab_size if vocab_size is not None else top + 1
        self.max_token = top

    def describe(self) -> str:
        s = self.pairs.stats
        return (f"{s['pairs']:,} preference pairs of {s['records']:,} records ({s['skipped']} skipped as bad, "
                f"{s['dropped']} dropped and {s['truncated']} cut for seq_len {self.seq_len})")  # fmt: skip

    def _pair(self, index: int) -> int:
        n = len(self.pairs.prompts)
        epoch, at = divmod(index, n)
        return int(seeded_rng(TAG_PREFERENCE_ORDER, self.seed, epoch).permutation(n)[at])

    def step_pairs(self, step: int, global_batch: int) -> list[int]:
        return [self._pair(step * global_batch + i) for i in range(global_batch)]

    def batch(self, step: int, dp_rank: int, dp_size: int, global_batch: int, seq_len: int) -> Batch:
        """This rank's pairs of the step's ``global_batch`` pairs: ``2 x pairs`` rows, chosen then
        rejected of each pair."""
        step = check_int("step", step, 0)
        if seq_len != self.seq_len:
            raise ValueError(f"preference pairs were encoded for seq_len {self.seq_len}, asked for {seq_len}")
        local = local_batch_size(dp_rank, dp_size, global_batch)
        first = step * global_batch + dp_rank * local
        inputs = torch.full((2 * local, seq_len), self.pad_id, dtype=torch.int64)
        labels = torch.full((2 * local, seq_len), IGNORE_INDEX, dtype=torch.int64)
        for b in range(local):
            p = self._pair(first + b)
            prompt = self.pairs.prompts[p]
            for side, answer in enumerate((self.pairs.chosen[p], self.pairs.rejected[p])):
                row = torch.from_numpy(np.concatenate([prompt, answer])[:seq_len])
                n, k = len(row), max(len(prompt), 1)  # an empty prompt: the answer's first token has no predictor
                inputs[2 * b + side, :n] = row
                labels[2 * b + side, k - 1 : n - 1] = row[k:]  # position i predicts token i + 1: the answer's
        return Batch(inputs, labels)

    def _rows(self, step, global_batch, first, count, seq_len):  # batch() is overridden whole
        raise NotImplementedError
