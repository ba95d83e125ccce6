"""A tenant's chat template, rendered as ``transformers.apply_chat_template`` renders it, in a sandbox.

The environment is transformers' own: jinja2's ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}``
tag (which records the character spans of what the assistant generates), ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, and a ``namespace`` and ``dict`` that
reject underscore names; messages are copied to plain JSON values first and keys whose value is
``None`` dropped (transformers' ``_normalize_chat_messages``), and ``reasoning_content`` is
filled from ``thinking`` / ``reasoning`` (``_alias_reasoning_fields``). The same template and
messages give the same text, character for character (``tests/data/test_chat_template.py``
compares them on the real templates of Llama 3.1, Qwen2.5, Qwen3 and Mistral).

A template is untrusted code from a tenant. Beyond the sandbox (no attribute of Python's
internals, no file, no import), what one may cost is bounded here:

- its source: ``MAX_TEMPLATE_CHARS``;
- what it renders for one conversation: ``max_chars`` (rendering streams, and stops past it);
- the values it builds: ``*`` and ``**`` refuse a string, list or number past ``max_chars``
  (``"x" * 10**10`` would allocate before anything is rendered), ``range`` is jinja's (100,000);
- its time: the caller's (``_encode.py`` renders in worker processes under a per-record alarm).

Each breach is a ``TemplateLimitError`` naming the bound.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import re
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["MAX_TEMPLATE_CHARS", "ChatTemplate", "Rendered", "TemplateLimitError"]

MAX_TEMPLATE_CHARS = 256 << 10  # the largest real templates (tool-calling ones) are ~10 KiB
DEFAULT_MAX_CHARS = 64 << 20  # one rendered conversation

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateLimitError(ValueError):
    """A chat template went past one of the bounds of this module."""


@dataclasses.dataclass(frozen=True)
class Rendered:
    text: str
    generation_spans: tuple[tuple[int, int], ...]  # character spans of {% generation %} blocks


_tracking: ContextVar[list | None] = ContextVar("hpservice_generation_tracking", default=None)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and, while tracking, records
    the body's character span in the output (transformers' ``AssistantTracker``)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        tracking = _tracking.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace without underscore names (no reach into CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} starts with '_'")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with ``*`` and ``**`` bounded (``max_chars``)."""

    intercepted_binops = frozenset(("*", "**"))
    max_chars = DEFAULT_MAX_CHARS

    def call_binop(self, context, operator_name, left, right):
        if operator_name == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > self.max_chars:
                    raise TemplateLimitError(f"chat template: a repetition of {len(seq)} x {n} items is past {self.max_chars}")
            return operator.mul(left, right)
        big = isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
        if big and right * abs(left).bit_length() > 4 * self.max_chars:
            raise TemplateLimitError(f"chat template: {left} ** {right} is past the template bounds")
        return operator.pow(left, right)


def _plain(value: Any) -> Any:
    """JSON-like values only (transformers' ``_plain_template_data``): what a template sees is data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _normalised(messages: list[dict]) -> list[dict]:
    """transformers' normalisation: keys whose value is None dropped, reasoning aliased."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    ``special_tokens``: ``tokenizer_config.json``'s ``bos_token``, ``eos_token``, ... as strings
    (transformers passes ``special_tokens_map`` to every render). Raises ``ValueError`` for a
    template that does not compile or is past ``MAX_TEMPLATE_CHARS``.
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *, max_chars: int = DEFAULT_MAX_CHARS):
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template: empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"chat template: {len(source)} characters, past the limit of {MAX_TEMPLATE_CHARS}")
        env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.max_chars = max_chars
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template: line {e.lineno}: {e.message}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.max_chars = max_chars
        self.has_generation_tags = bool(_GENERATION_TAG.search(source))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, tools=None, **kwargs) -> Rendered:
        """The text of ``messages`` (and the ``{% generation %}`` spans); raises ``ValueError``
        for what the template raises (``raise_exception``, a type error inside it) and
        ``TemplateLimitError`` past a bound."""
        variables = {**self.special_tokens, **_plain(kwargs)}
        variables.update(messages=_plain(_normalised(messages)), tools=_plain(tools), documents=None,
                         add_generation_prompt=add_generation_prompt)  # fmt: skip
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        size = 0
        token = _tracking.set((blocks, spans))
        try:
            for block in self._template.generate(**variables):
                size += len(block)
                if size > self.max_chars:
                    raise TemplateLimitError(f"chat template: rendered past {self.max_chars} characters")
                blocks.append(block)
        except TemplateLimitError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ValueError(f"chat template: refused by the sandbox: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
        except RecursionError:
            raise TemplateLimitError("chat template: recursion too deep") from None
        finally:
            _tracking.reset(token)
        return Rendered("".join(blocks), tuple(spans))
