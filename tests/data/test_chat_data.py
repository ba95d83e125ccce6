"""Chat data as users have it: JSONL, Parquet and datasets directories read as written; the checks
before start naming the file, the line and the field; what encoding counts; each attack on it."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from hpservice.data.chat import ChatOptions, ChatSource, encode_corpus, load_chat_tokenizer, read_records
from hpservice.preflight import check_inputs
from hpservice.spec import parse_job
from tests.data.chat_fixtures import CONVERSATIONS, tokenizer_dir

RECORDS = [{"messages": CONVERSATIONS["one turn"]}, {"messages": CONVERSATIONS["system, three turns"]}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("tok"), "qwen2_5")


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _spec(tmp, tok_dir, path, **data):
    return parse_job({"name": "c", "model": {"name": "llama", "flavor": "tiny"},
                      "data": {"kind": "chat", "path": str(path), "tokenizer": str(tok_dir), "seq_len": 64, **data},
                      "metrics": {"dir": str(tmp)}})  # fmt: skip


def test_jsonl_parquet_and_a_datasets_directory_read_the_same_records(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    # a key only the second record has, nested in tool-call arguments: Arrow's one schema fills it
    # with null in the first; read back, the records are as written
    records = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}]}]},
        {"messages": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"city": "Rome", "unit": "C"}}}]}]},
    ]  # fmt: skip
    jsonl = _jsonl(tmp_path / "a.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    for path in (jsonl, tmp_path / "a.parquet", tmp_path / "ds"):
        assert [r for _, r in read_records(str(path))] == records, path
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"a DatasetDict of splits \['train'\]; name one split's directory"):
        list(read_records(str(tmp_path / "dd")))
    assert [r for _, r in read_records(str(tmp_path / "dd" / "train"))] == records


@pytest.mark.parametrize(
    "lines,data,message",
    [
        ([RECORDS[0], "{not json"], {}, r"data\.path.*bad\.jsonl:2: not a JSON object"),
        ([{"text": "x"}], {}, r"data\.path.*bad\.jsonl:1: messages: missing \(format 'messages'\)"),
        ([{"messages": [{"role": "wizard", "content": "x"}]}], {}, r"bad\.jsonl:1: messages\[0\]\.role: unknown role 'wizard'"),
        ([{"messages": [{"role": "user", "content": {"a": 1}}]}], {}, r"bad\.jsonl:1: messages\[0\]\.content: content must be a string"),
        ([], {}, r"data\.path.*bad\.jsonl: no records"),
        ([RECORDS[0]], {"format": "alpaca"}, r"bad\.jsonl:1: instruction: missing \(format 'alpaca'\)"),
    ],
)
def test_a_file_that_does_not_match_its_format_is_refused_before_start_naming_file_line_and_field(tmp_path, tok_dir, lines, data, message):
    path = _jsonl(tmp_path / "bad.jsonl", lines)
    errors = check_inputs(_spec(tmp_path, tok_dir, path, **data))
    assert errors and any(re.search(message, f"{field}: {msg}") for field, msg in errors), errors


def test_a_parquet_file_with_other_columns_and_a_tokenizer_without_template_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": "b"}]), tmp_path / "x.parquet")
    bare = tokenizer_dir(tmp_path, "qwen2_5", template="")
    errors = dict(check_inputs(_spec(tmp_path, bare, tmp_path / "x.parquet")))
    assert errors.keys() == {"data.path", "data.chat_template"}, errors
    assert "x.parquet:row 1: messages: missing" in errors["data.path"]
    assert "has no chat template" in errors["data.chat_template"]
    errors = dict(check_inputs(_spec(tmp_path, bare, tmp_path / "nothing-*.jsonl")))
    assert "the glob matches no file" in errors["data.path"]


def test_encoding_counts_what_it_drops_truncates_and_skips(tmp_path, tok_dir):
    long = {"messages": [{"role": "user", "content": "word " * 600}, {"role": "assistant", "content": "ok"}]}
    no_assistant = {"messages": [{"role": "user", "content": "hi"}]}
    bad = {"messages": [{"role": "wizard", "content": "x"}]}
    path = _jsonl(tmp_path / "c.jsonl", [*RECORDS, long, no_assistant, bad])
    tok = load_chat_tokenizer(str(tok_dir))
    with pytest.raises(ValueError, match=r"c\.jsonl:5: messages\[0\]\.role: unknown role 'wizard'"):
        encode_corpus([[str(path)]], tok, ChatOptions(seq_len=512))
    corpus = encode_corpus([[str(path)]], tok, ChatOptions(seq_len=512, on_bad_record="skip"))
    s = corpus.stats
    assert (s["records"], s["encoded"], s["dropped_too_long"], s["skipped_no_trained_token"], s["skipped_bad"]) == (5, 2, 1, 1, 1)
    assert s["bad_examples"][0].startswith(f"{path}:5: messages[0].role")
    cut = encode_corpus([[str(path)]], tok, ChatOptions(seq_len=512, on_bad_record="skip", truncation="truncate"))
    assert cut.stats["truncated"] == 1 and cut.stats["encoded"] == 2  # the long one keeps no assistant token once cut
    assert cut.stats["skipped_no_trained_token"] == 2
    assert s["trained_tokens"] == int(sum(np.asarray(corpus.mask[a + 1 : b]).sum() for a, b in zip(corpus.starts[:-1], corpus.starts[1:], strict=True)))


def test_a_template_that_loops_or_renders_megabytes_and_a_huge_conversation_end_as_errors_not_hangs(tmp_path, tok_dir):
    path = _jsonl(tmp_path / "c.jsonl", RECORDS)
    tok = load_chat_tokenizer(str(tok_dir))
    for template, match in (
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "took longer than 2.0 s"),
        ("{% for i in range(99999) %}{{ 'x' * 999 }}{% endfor %}", "rendered past"),
    ):
        t0 = time.monotonic()
        bounded = tok.__class__(tok.tokenizer_json, template, tok.special_tokens, tok.where)
        with pytest.raises(ValueError, match=match):
            encode_corpus([[str(path)]], bounded, ChatOptions(seq_len=64, template_seconds=2.0), workers=0)
        assert time.monotonic() - t0 < 120  # bounded by the alarm and the size limit, not by the loop
    huge = _jsonl(tmp_path / "huge.jsonl", [*RECORDS, {"messages": [{"role": "user", "content": "ab " * 3_400_000},
                                                                     {"role": "assistant", "content": "ok"}]}])  # fmt: skip
    t0 = time.monotonic()
    corpus = encode_corpus([[str(huge)]], tok, ChatOptions(seq_len=512))
    assert corpus.stats["dropped_too_long"] == 1 and corpus.stats["encoded"] == 2  # dropped from its length alone
    assert time.monotonic() - t0 < 120


def test_encoding_in_worker_processes_equals_encoding_in_process(tmp_path, tok_dir):
    path = _jsonl(tmp_path / "c.jsonl", RECORDS * 300)  # several chunks
    tok = load_chat_tokenizer(str(tok_dir))
    here = encode_corpus([[str(path)]], tok, ChatOptions(seq_len=128), workers=0)
    pool = encode_corpus([[str(path)]], tok, ChatOptions(seq_len=128), workers=2)
    for name in ("tokens", "mask", "starts", "source"):
        assert np.array_equal(getattr(here, name), getattr(pool, name)), name


def test_epochs_mixture_weights_and_the_global_batch_do_not_depend_on_the_data_parallel_size(tmp_path, tok_dir):
    a = _jsonl(tmp_path / "a.jsonl", [RECORDS[0]] * 10)
    b = _jsonl(tmp_path / "b.jsonl", [RECORDS[1]] * 10)
    corpus = encode_corpus([[str(a)], [str(b)]], load_chat_tokenizer(str(tok_dir)), ChatOptions(seq_len=512))
    source = ChatSource(corpus, seq_len=512, seed=1, packing="best_fit", weights=[2.0, 0.5])
    epoch = source.epoch_records(0)
    assert (corpus.source[epoch] == 0).sum() == 20 and (corpus.source[epoch] == 1).sum() == 5
    assert not np.array_equal(epoch, source.epoch_records(1))  # reshuffled each epoch
    whole = source.batch(3, 0, 1, 4, 512)
    halves = [source.batch(3, r, 2, 4, 512) for r in range(2)]
    for name in ("inputs", "labels", "document_ids", "positions"):
        assert np.array_equal(np.concatenate([getattr(h, name) for h in halves]), getattr(whole, name)), name
    assert source.step_facts(3, 4)["packing_efficiency"] > ChatSource(corpus, seq_len=512, seed=1).step_facts(3, 4)["packing_efficiency"]


def test_an_input_outside_the_allowed_roots_is_refused_when_opened(tmp_path, tok_dir):
    from hpservice.inputs import InputError, confine

    outside = _jsonl(tmp_path / "outside.jsonl", RECORDS)
    root = tmp_path / "root"
    root.mkdir()
    (root / "chats.jsonl").symlink_to(outside)  # swapped for a link after any check of its name
    confine([root])
    try:
        with pytest.raises(InputError):
            list(read_records(str(root / "chats.jsonl")))
    finally:
        confine(None)
