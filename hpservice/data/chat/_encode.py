"""A conversation to token ids and the mask of the tokens the loss learns from.

The tokens are ``apply_chat_template``'s: the template's text (``_template.py``) encoded by the
tokenizer with ``add_special_tokens=False``, as transformers does, so a template that writes the
BOS is not given a second one by a tokenizer that would add one (the classic doubled BOS).

Which tokens train (``mask``):

- a template with ``{% generation %}`` blocks: the tokens overlapping the blocks, by
  transformers' rule for ``return_assistant_tokens_mask`` (the blocks are in the order of the
  assistant turns; ``last_assistant`` / ``completion`` keep the ones of those turns);
- any other template: each trained assistant turn's text is what the template appends for it
  after the conversation so far and the generation prompt, i.e. exactly what the model produces
  at inference for that turn: ``render(turns[:i], add_generation_prompt=True)`` is a prefix of
  ``render(turns[:i+1])``, which is a prefix of the whole conversation's text. The turn's tokens
  run to its end-of-turn token (``eos_token``, trained unless ``train_eos`` is off) and not past
  it (the newline a template writes after it is not generated). A template that renders an
  earlier turn differently once later turns follow (Qwen3 drops earlier reasoning and empty
  think blocks) breaks the prefix rule: such a record is refused with that reason, since
  training on it would teach the model turns it never produces;
- ``train_on: all``: every token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ._formats import Conversation, RecordError
from ._template import ChatTemplate

__all__ = ["ChatEncoder", "ChatTokenizer", "Encoded", "load_chat_tokenizer", "template_text"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int64 [n]
    mask: np.ndarray  # bool [n]: the token is one the model learns to produce


@dataclasses.dataclass(frozen=True)
class ChatTokenizer:
    """What encoding a conversation needs from a tokenizer directory: its ``tokenizer.json`` (text),
    the chat template's source and the special tokens' strings."""

    tokenizer_json: str
    template: str | None
    special_tokens: dict[str, str]
    where: str


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_text(value: str | None) -> str | None:
    """``data.chat_template``: the template itself (it holds a Jinja tag) or a file holding it."""
    if value is None or "{{" in value or "{%" in value:
        return value
    from hpservice.inputs import read_input

    from ._template import MAX_TEMPLATE_CHARS

    return read_input(value, 4 * MAX_TEMPLATE_CHARS).decode("utf-8")


def load_chat_tokenizer(path: str, chat_template: str | None = None) -> ChatTokenizer:
    """A tokenizer directory (``tokenizer.json`` and ``tokenizer_config.json``, optionally
    ``chat_template.jinja``) or a ``tokenizer.json`` with its ``tokenizer_config.json`` beside it.
    The template is ``chat_template`` when given, else ``chat_template.jinja``, else the config's
    ``chat_template`` (its ``default`` where it holds several). Every file is an untrusted input:
    opened confined and bounded (``hpservice.inputs``)."""
    from hpservice.inputs import MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, load_json, read_input

    from ._template import MAX_TEMPLATE_CHARS

    p = Path(path)
    folder, tok_file = (p, p / "tokenizer.json") if p.is_dir() else (p.parent, p)
    tokenizer_json = read_input(tok_file, MAX_TOKENIZER_BYTES).decode("utf-8")
    config: dict = {}
    if (folder / "tokenizer_config.json").is_file():
        where = str(folder / "tokenizer_config.json")
        config = load_json(read_input(folder / "tokenizer_config.json", 4 * MAX_JSON_BYTES), where)
        if not isinstance(config, dict):
            raise ValueError(f"{where}: expected a JSON object")
    template = chat_template
    if template is None and (folder / "chat_template.jinja").is_file():
        template = read_input(folder / "chat_template.jinja", 4 * MAX_TEMPLATE_CHARS).decode("utf-8")
    if template is None:
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{folder / 'tokenizer_config.json'}: chat_template is not a string")
    if isinstance(template, str) and not template.strip():
        template = None
    special = {k: s for k in _SPECIAL_KEYS if (s := _token_str(config.get(k))) is not None}
    return ChatTokenizer(tokenizer_json, template, special, str(folder))


class ChatEncoder:
    """Renders and tokenizes conversations (one per call; cheap to build in each worker)."""

    def __init__(self, tok: ChatTokenizer, *, train_eos: bool = True, max_chars: int | None = None):
        from tokenizers import Tokenizer

        if tok.template is None:
            raise ValueError(
                f"data.chat_template: the tokenizer at {tok.where} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); give one inline or as a file"
            )
        kw = {} if max_chars is None else {"max_chars": max_chars}
        self.template = ChatTemplate(tok.template, tok.special_tokens, **kw)
        self.tokenizer = Tokenizer.from_str(tok.tokenizer_json)
        self.eos = tok.special_tokens.get("eos_token")
        self.train_eos = train_eos
        # No token stands for more bytes of text than its own string has in UTF-8 (byte-level
        # BPE's characters, SentencePiece's "▁", byte fallbacks' "<0x41>", added tokens), so a
        # text of more than n * this many bytes has more than n tokens, without tokenizing it.
        self.max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, conv: Conversation, *, max_tokens: int | None = None) -> Encoded | None:
        """The tokens and mask of ``conv``; None when it surely has more than ``max_tokens``
        tokens (found from its text's length alone: a huge record is never tokenized to drop it)."""
        whole = self.template.render(conv.messages, tools=conv.tools)
        if max_tokens is not None and len(whole.text.encode()) > max_tokens * self.max_token_bytes:
            return None
        enc = self.tokenizer.encode(whole.text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        if conv.every_token:
            return Encoded(ids, np.ones(len(ids), dtype=bool))
        if self.template.has_generation_tags:
            spans = list(whole.generation_spans)
            assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
            if tuple(conv.trained) != tuple(assistant):  # a subset of turns: blocks map to assistant turns
                if len(spans) != len(assistant):
                    raise RecordError(
                        "messages",
                        f"the template's generation blocks ({len(spans)}) do not match the assistant turns "
                        f"({len(assistant)}); use train_on: assistant",
                    )
                spans = [s for s, i in zip(spans, assistant, strict=True) if i in conv.trained]
        else:
            spans = [self._turn_span(conv, i, whole.text) for i in conv.trained]
        return Encoded(ids, _overlapping(enc.offsets, spans))

    def _turn_span(self, conv: Conversation, i: int, text: str) -> tuple[int, int]:
        before = self.template.render(conv.messages[:i], tools=conv.tools, add_generation_prompt=True).text
        upto = self.template.render(conv.messages[: i + 1], tools=conv.tools).text
        if not (upto.startswith(before) and text.startswith(upto)):
            raise RecordError(
                f"messages[{i}]",
                "the chat template renders this turn, or the conversation before it, differently once later "
                "turns follow (Qwen3's drops earlier reasoning; Mistral v0.3's writes the system prompt only "
                "into a conversation that ends with a user turn), so its tokens in the whole conversation are "
                "not what the model sees and produces at inference; where only earlier turns change, train on "
                "the last turn (train_on: last_assistant); else use a template with {% generation %} blocks",
            )
        start, end = len(before), len(upto)
        if self.eos:
            at = text.rfind(self.eos, start, end)
            if at >= 0:
                end = at + len(self.eos) if self.train_eos else at
        return start, end


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """transformers' rule: a token is in a span when it overlaps it (spans and tokens in order)."""
    mask = np.zeros(len(offsets), dtype=bool)
    j = 0
    for t, (start, end) in enumerate(offsets):
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        if end > spans[j][0]:
            mask[t] = True
    return mask
