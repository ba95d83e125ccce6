"""Chat rendering, tokens and masks against transformers' apply_chat_template, on the real templates
of Llama 3.1, Qwen2.5, Qwen3 and Mistral (tests/data/chat_fixtures.py), and the template sandbox's bounds."""

from __future__ import annotations

import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from hpservice.data.chat import (
    ChatEncoder,
    ChatTemplate,
    RecordError,
    TemplateLimitError,
    load_chat_tokenizer,
    to_conversation,
)
from tests.data.chat_fixtures import CONVERSATIONS, FAMILIES, TOOLS, tokenizer_dir

CASES = [(f, c) for f in FAMILIES for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for family, f in FAMILIES.items():
        out[family, False] = tokenizer_dir(tmp, family)
        if f["training"] is not None:
            out[family, True] = tokenizer_dir(tmp, family, training=True)
    return out


def _conv(name, train_on="assistant"):
    record = {"messages": CONVERSATIONS[name], "tools": TOOLS if name == "tool call" else None}
    return to_conversation(record, "messages", {}, train_on)


def _theirs(folder, name, mask=False):
    hf = AutoTokenizer.from_pretrained(folder)
    tools = TOOLS if name == "tool call" else None
    return hf, hf.apply_chat_template(CONVERSATIONS[name], tools=tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=mask)  # fmt: skip


@pytest.mark.parametrize("family,name", CASES)
def test_token_ids_equal_apply_chat_template(dirs, family, name):
    hf, want = _theirs(dirs[family, False], name)
    got = ChatEncoder(load_chat_tokenizer(str(dirs[family, False]))).template.render(
        _conv(name).messages, tools=_conv(name).tools
    )
    ids = ChatEncoder(load_chat_tokenizer(str(dirs[family, False]))).tokenizer.encode(got.text, add_special_tokens=False).ids
    assert ids == want["input_ids"]
    if FAMILIES[family]["adds_bos"]:  # the template writes the BOS; the tokenizer would add a second
        bos = hf.convert_tokens_to_ids(FAMILIES[family]["bos"])
        assert ids[0] == bos and ids[1] != bos
        assert hf(got.text)["input_ids"][:2] == [bos, bos]  # the classic doubled BOS, had we re-tokenized


@pytest.mark.parametrize("family,name", [(f, c) for f, c in CASES if FAMILIES[f]["training"]])
def test_masks_with_generation_blocks_equal_return_assistant_tokens_mask(dirs, family, name):
    _, want = _theirs(dirs[family, True], name, mask=True)
    got = ChatEncoder(load_chat_tokenizer(str(dirs[family, True]))).encode(_conv(name))
    assert got.ids.tolist() == want["input_ids"]
    assert got.mask.astype(int).tolist() == want["assistant_masks"]


def _segments(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("family", ["llama3_1", "qwen2_5", "mistral", "qwen3"])
def test_masks_without_generation_blocks_are_each_assistant_turn_and_its_end_of_turn(dirs, family):
    hf = AutoTokenizer.from_pretrained(dirs[family, False])
    eos = FAMILIES[family]["eos"]
    name = "system, three turns" if family in ("llama3_1", "qwen2_5") else "one turn"
    got = ChatEncoder(load_chat_tokenizer(str(dirs[family, False]))).encode(_conv(name))
    turns = [m["content"] for m in CONVERSATIONS[name] if m["role"] == "assistant"]
    think = "<think>\n\n</think>\n\n" if family == "qwen3" else ""  # what Qwen3 generates before its answer
    lead = " " if family == "mistral" else ""  # Mistral's template writes "[/INST] " + content
    texts = [hf.decode(s) for s in _segments(got.ids, got.mask)]
    assert texts == [f"{think}{lead}{t}{eos}" if family != "mistral" else f"{t}{eos}" for t in turns] or texts == [
        f"{lead}{t}{eos}" for t in turns
    ]
    without_eos = ChatEncoder(load_chat_tokenizer(str(dirs[family, False])), train_eos=False).encode(_conv(name))
    assert [hf.decode(s) for s in _segments(without_eos.ids, without_eos.mask)] == [t.removesuffix(eos) for t in texts]


@pytest.mark.parametrize("family,name", [("qwen3", "system, three turns"), ("qwen3", "tool call"), ("mistral", "system, three turns")])
def test_a_turn_rendered_otherwise_once_later_turns_follow_is_refused_and_the_last_turn_trains(dirs, family, name):
    # Qwen3 drops the empty think block of earlier turns: the last turn is still what inference
    # sees. Mistral v0.3 writes the system prompt only into a conversation ending with a user turn:
    # no turn of a finished conversation is, so even the last is refused.
    encoder = ChatEncoder(load_chat_tokenizer(str(dirs[family, False])))
    with pytest.raises(RecordError, match="differently once later turns follow"):
        encoder.encode(_conv(name))
    if family == "mistral":
        with pytest.raises(RecordError, match=r"Mistral v0\.3.s writes the system prompt only"):
            encoder.encode(_conv(name, "last_assistant"))
        return
    last = encoder.encode(_conv(name, "last_assistant"))
    hf = AutoTokenizer.from_pretrained(dirs[family, False])
    final = CONVERSATIONS[name][-1]["content"]
    assert [hf.decode(s) for s in _segments(last.ids, last.mask)][-1].endswith(final + FAMILIES[family]["eos"])
    assert len(_segments(last.ids, last.mask)) == 1


def test_content_parts_are_joined_and_non_text_parts_refused():
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "c"}]}  # fmt: skip
    assert to_conversation(parts, "messages", {}, "assistant").messages[0]["content"] == "a\nb"
    image = {"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, {"role": "assistant", "content": "c"}]}
    with pytest.raises(RecordError, match=r"messages\[0\]\.content\[0\]: only text parts are supported, got 'image'"):
        to_conversation(image, "messages", {}, "assistant")


@pytest.mark.parametrize(
    "record,fmt,field",
    [
        ({"text": "x"}, "messages", "messages: missing"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "messages[0].role: unknown role 'wizard'"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages", "messages[0].content: content must be a string"),
        ({"messages": []}, "messages", "messages: expected a non-empty list"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "sharegpt", "conversations[0].from: unknown role 'alien'"),
        ({"instruction": "x"}, "alpaca", "output: missing"),
        ({"prompt": "x", "completion": 3}, "prompt_completion", "prompt/completion: expected two strings"),
    ],
)
def test_records_that_do_not_match_their_format_name_the_field(record, fmt, field):
    with pytest.raises(RecordError) as e:
        to_conversation(record, fmt, {}, "assistant")
    assert field in str(e.value)


def test_the_formats_users_have_become_the_same_conversation():
    want = [{"role": "user", "content": "Say hi\n\nto Bob"}, {"role": "assistant", "content": "Hi Bob"}]
    sharegpt = {"conversations": [{"from": "human", "value": "Say hi\n\nto Bob"}, {"from": "gpt", "value": "Hi Bob"}]}
    alpaca = {"instruction": "Say hi", "input": "to Bob", "output": "Hi Bob"}
    pc = {"prompt": "Say hi\n\nto Bob", "completion": "Hi Bob"}
    renamed = {"chat": [{"speaker": "user", "text": "Say hi\n\nto Bob"}, {"speaker": "assistant", "text": "Hi Bob"}]}
    assert to_conversation(sharegpt, "sharegpt", {}, "assistant").messages == want
    assert to_conversation(alpaca, "alpaca", {}, "assistant").messages == want
    assert to_conversation(pc, "prompt_completion", {}, "assistant").messages == want
    fields = {"messages": "chat", "role": "speaker", "content": "text"}
    assert to_conversation(renamed, "messages", fields, "assistant").messages == want
    assert to_conversation(pc, "prompt_completion", {}, "assistant").trained == (1,)


@pytest.mark.parametrize(
    "source,match",
    [
        ("{{ 'x' * 100000000 }}", "repetition"),
        ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "rendered past"),
        ("{{ 7 ** 100000000 }}", "past the template bounds"),
    ],
)
def test_a_template_that_builds_or_renders_too_much_is_stopped(source, match):
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=match):
        ChatTemplate(source, max_chars=1 << 20).render([{"role": "user", "content": "x"}])
    assert time.monotonic() - t0 < 60  # stopped, not run to the end (a bound, not a timing assertion)


@pytest.mark.parametrize(
    "source",
    ["{{ ''.__class__.__mro__ }}", "{{ messages.__class__ }}", "{% set ns = namespace(_x=1) %}", "{{ cycler.__init__.__globals__ }}"],
)
def test_the_sandbox_refuses_pythons_internals(source):
    with pytest.raises(ValueError):
        out = ChatTemplate(source).render([{"role": "user", "content": "x"}])
        if not out.text.strip():  # jinja's sandbox renders unsafe attributes as undefined (empty)
            raise ValueError("undefined")


def test_a_tokenizer_without_a_template_is_refused_naming_the_field(tmp_path):
    folder = tokenizer_dir(tmp_path, "qwen2_5", template="")
    tok = load_chat_tokenizer(str(folder))
    with pytest.raises(ValueError, match=r"data\.chat_template"):
        ChatEncoder(tok.__class__(tok.tokenizer_json, None, tok.special_tokens, tok.where))
