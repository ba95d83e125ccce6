"""From a record as the user wrote it to a conversation: messages, tools, and which turns train.

The formats in use, each with its field names configurable (``data.fields``):

- ``messages`` (OpenAI's): ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}``;
  roles system, developer, user, assistant, tool (and Llama's ipython); other message keys
  (``tool_calls``, ``name``, ``tool_call_id``, ``reasoning_content``) go to the template as they are;
- ``sharegpt``: ``{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": ...}]}``;
- ``alpaca``: ``{"instruction", "input" (optional), "output", "system" (optional)}``: the user turn
  is the instruction, then a blank line and the input when there is one;
- ``prompt_completion``: ``{"prompt", "completion"}``, each a string (one user turn, one assistant
  turn) or a list of messages (TRL's conversational form).

Content is a string, or a list of parts of which only text parts are allowed: they are joined
with a newline. Real templates would print a list's Python repr, or drop it, silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["FORMATS", "TRAIN_ON", "Conversation", "RecordError", "default_fields", "to_conversation"]

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion")
TRAIN_ON = ("assistant", "last_assistant", "completion", "all")

_DEFAULT_FIELDS = {
    "messages": {"messages": "messages", "role": "role", "content": "content", "tools": "tools"},
    "sharegpt": {"conversations": "conversations", "from": "from", "value": "value", "tools": "tools"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
    "prompt_completion": {"prompt": "prompt", "completion": "completion", "tools": "tools"},
}
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
_SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "tool": "tool", "function_response": "tool", "observation": "tool", "function_call": "assistant",
}  # fmt: skip


class RecordError(ValueError):
    """A record that does not match its declared format; ``field`` names where."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    trained: tuple[int, ...]  # indices of the messages the loss learns from (train_on: all -> every token)
    tools: list | None = None
    every_token: bool = False


def default_fields(fmt: str) -> dict[str, str]:
    return dict(_DEFAULT_FIELDS[fmt])


def _content(value: Any, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RecordError(f"{field}[{i}]", f"only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RecordError(field, f"content must be a string or a list of text parts, got {type(value).__name__}")


def _message(m: Any, field: str, role_key: str, content_key: str, roles: dict | None = None) -> dict:
    if not isinstance(m, dict):
        raise RecordError(field, f"a message must be an object, got {type(m).__name__}")
    if role_key not in m:
        raise RecordError(field, f"no {role_key!r}")
    role = m[role_key]
    if roles is not None:
        if role not in roles:
            raise RecordError(f"{field}.{role_key}", f"unknown role {role!r}; expected one of {', '.join(roles)}")
        role = roles[role]
    elif role not in ROLES:
        raise RecordError(f"{field}.{role_key}", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    out = {k: v for k, v in m.items() if k not in (role_key, content_key)}
    content = _content(m.get(content_key), f"{field}.{content_key}")
    if content is None and not (role == "assistant" and out.get("tool_calls")):
        raise RecordError(f"{field}.{content_key}", "missing (only an assistant message with tool_calls may omit it)")
    return {"role": role, "content": content, **out}


def _messages(value: Any, field: str, role_key: str, content_key: str, roles: dict | None = None) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RecordError(field, f"expected a non-empty list of messages, got {type(value).__name__ if value != [] else 'an empty list'}")
    return [_message(m, f"{field}[{i}]", role_key, content_key, roles) for i, m in enumerate(value)]


def _text(record: dict, key: str, required: bool = True) -> str | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise RecordError(key, "missing" if value is None else f"expected a string, got {type(value).__name__}")
    return value


def _trained(messages: list[dict], train_on: str, first_completion: int = 0) -> tuple[int, ...]:
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        return tuple(assistant[-1:])
    if train_on == "completion":
        return tuple(i for i in assistant if i >= first_completion)
    return tuple(assistant)


def to_conversation(record: Any, fmt: str, fields: dict[str, str], train_on: str) -> Conversation:
    """The conversation of one record; raises ``RecordError`` naming the field that does not match."""
    if not isinstance(record, dict):
        raise RecordError("record", f"expected an object, got {type(record).__name__}")
    f = {**_DEFAULT_FIELDS[fmt], **fields}
    tools = record.get(f["tools"]) if "tools" in f else None
    if tools is not None and not isinstance(tools, list):
        raise RecordError(f["tools"], f"expected a list of tool schemas, got {type(tools).__name__}")
    first_completion = 0
    if fmt == "messages":
        if f["messages"] not in record:
            raise RecordError(f["messages"], "missing")
        messages = _messages(record[f["messages"]], f["messages"], f["role"], f["content"])
    elif fmt == "sharegpt":
        if f["conversations"] not in record:
            raise RecordError(f["conversations"], "missing")
        messages = _messages(record[f["conversations"]], f["conversations"], f["from"], f["value"], _SHAREGPT_ROLES)
    elif fmt == "alpaca":
        instruction, extra = _text(record, f["instruction"]), _text(record, f["input"], required=False)
        system = _text(record, f["system"], required=False)
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user},
            {"role": "assistant", "content": _text(record, f["output"])},
        ]
    else:
        prompt, completion = record.get(f["prompt"]), record.get(f["completion"])
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            first_completion = 1
        elif isinstance(prompt, list) and isinstance(completion, list):
            head = _messages(prompt, f["prompt"], "role", "content")
            messages = head + _messages(completion, f["completion"], "role", "content")
            first_completion = len(head)
        else:
            raise RecordError(
                f"{f['prompt']}/{f['completion']}",
                f"expected two strings or two lists of messages, got {type(prompt).__name__} and {type(completion).__name__}",
            )
        if train_on == "assistant":  # prompt/completion data trains its completion unless told otherwise
            train_on = "completion"
    every = train_on == "all"
    return Conversation(messages, () if every else _trained(messages, train_on, first_completion), tools, every)
