"""Vocabularies over 65,536 tokens (every Llama 3, Qwen and Mistral tokenizer), end to end:
prepare-data's uint32 files and their validation split, Llama 3's BOS/EOS conventions, and a
``data.kind: text`` job that tokenizes with such a tokenizer. The tokenizer is built offline
here: a word-level vocabulary of 70,000 words plus Llama 3's special tokens."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from hpservice.cli import main
from hpservice.data import TokenFile, read_metadata, val_path

WORDS = 70_000
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
DOCS = [" ".join(f"w{(i * 7919 + j * 104729) % WORDS}" for j in range(12)) for i in range(8)]


def llama3_style_tokenizer(path) -> Tokenizer:
    vocab = {f"w{i}": i for i in range(WORDS)} | {"<unk>": WORDS, BOS: WORDS + 1, EOS: WORDS + 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, WORDS + 1)])
    tok.save(str(path))
    return tok


def _write_docs(path, docs):
    with path.open("w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")


def test_val_path_keeps_the_dtype_suffix(tmp_path):
    assert val_path(tmp_path / "train.u32.bin").name == "train-val.u32.bin"
    assert val_path(tmp_path / "train.bin").name == "train-val.bin"


def test_prepare_data_writes_uint32_splits_with_llama3_bos_and_eos(tmp_path, capsys):
    tok = llama3_style_tokenizer(tmp_path / "tokenizer.json")
    _write_docs(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "train.u32.bin"
    args = ["prepare-data", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert main([*args, "--out", str(out), "--val-fraction", "0.25"]) == 0, capsys.readouterr().err
    val = tmp_path / "train-val.u32.bin"
    meta, val_meta = read_metadata(out), read_metadata(val)
    assert meta["dtype"] == val_meta["dtype"] == "uint32" and meta["vocab_size"] == WORDS + 3
    assert (meta["documents"], val_meta["documents"]) == (6, 2)  # every 4th document
    assert meta["eos_id"] == WORDS + 2 and meta["added_special_ids"] == [WORDS + 1]
    # read back as uint32 (the name says so), every document BOS ... EOS, ids above 65,535 intact
    tokens = TokenFile(val, vocab_size=meta["vocab_size"]).tokens
    expected = []
    for doc in DOCS[3::4]:
        expected += [WORDS + 1, *(int(w[1:]) for w in doc.split()), WORDS + 2]
    assert np.asarray(tokens).tolist() == expected and max(expected) > 65_535
    assert tok.decode(expected[: 1 + 12 + 1], skip_special_tokens=True) == DOCS[3]

    # a validation split that would get no document is refused, not written empty
    _write_docs(tmp_path / "one.jsonl", DOCS[:1])
    empty = tmp_path / "one.u32.bin"
    assert main([*args[:1], str(tmp_path / "one.jsonl"), *args[2:], "--out", str(empty), "--val-fraction", "0.01"]) == 1
    assert "the validation split would be empty; give at least 100 documents" in capsys.readouterr().err
    assert not empty.exists() and not (tmp_path / "one-val.u32.bin").exists()
    # and a uint32 vocabulary in a file named for uint16 is refused
    assert main([*args, "--out", str(tmp_path / "train.bin")]) == 1
    assert "needs uint32 tokens: name the file *.u32.bin" in capsys.readouterr().err


def _text_job(tmp_path, **sections):
    """2 steps of a tiny llama with the 70,003-token vocabulary on a text file it tokenizes."""
    from tests._jobs import tiny_llama_job

    (tmp_path / "corpus.txt").write_text(" ".join(DOCS * 4))
    data = {"kind": "text", "path": str(tmp_path / "corpus.txt"), "tokenizer": str(tmp_path / "tokenizer.json"), "seq_len": 16}
    return tiny_llama_job(
        tmp_path / "run", data=data, model={"overrides": {"vocab_size": WORDS + 3}}, training={"steps": 2}, **sections
    )


def test_a_text_job_with_a_large_vocabulary_tokenizes_into_uint32_and_trains(ranks, tmp_path):
    from tests._jobs import train

    llama3_style_tokenizer(tmp_path / "tokenizer.json")
    spec = _text_job(tmp_path)
    history = ranks(1).run(train, spec)[0]
    assert len(history) == 2 and all(np.isfinite(r["loss"]) for r in history)
    (cache,) = (tmp_path / "run").glob("t-*/data/corpus.txt.*.bin")
    assert cache.name.endswith(".u32.bin") and read_metadata(cache)["dtype"] == "uint32"


@pytest.mark.parametrize("fraction", ["0.5"])
def test_prepare_data_val_fraction_on_documents_that_split(tmp_path, fraction, capsys):
    llama3_style_tokenizer(tmp_path / "tokenizer.json")
    _write_docs(tmp_path / "docs.jsonl", DOCS[:2])
    out = tmp_path / "d.u32.bin"
    assert main(["prepare-data", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--out", str(out), "--val-fraction", fraction]) == 0, capsys.readouterr().err  # fmt: skip
    assert read_metadata(val_path(out))["documents"] == 1


def _train_and_checkpoint(spec):
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    trainer.train()
    return trainer.checkpoints.manager.latest()["path"]


def test_an_export_carries_the_tokenizer_and_transformers_generates_what_we_generate(ranks, tmp_path):
    """A 70,003-token model trained from scratch on text: its HF export loads with AutoTokenizer,
    says which ids end text, and transformers' greedy generate equals ``hpservice generate``."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from hpservice.cli.local import _load_for_generation
    from hpservice.models.generate import generate
    from hpservice.models.hf import export_checkpoint_hf
    from hpservice.models.hf_text import stop_ids

    tok = llama3_style_tokenizer(tmp_path / "tokenizer.json")
    spec = _text_job(tmp_path, checkpoint={"interval": 2})
    checkpoint = ranks(1).run(_train_and_checkpoint, spec)[0]
    out = tmp_path / "export"
    done = export_checkpoint_hf(checkpoint, out)
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(done["files"])
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (WORDS + 1, WORDS + 2)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == WORDS + 2

    hf_tok = AutoTokenizer.from_pretrained(out)
    prompt = DOCS[0]
    assert hf_tok(prompt)["input_ids"] == tok.encode(prompt).ids  # BOS first, as prepare-data wrote it
    hf = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = torch.tensor([hf_tok(prompt)["input_ids"]])
    theirs = hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    model, text = _load_for_generation(checkpoint)
    ours = generate(model, ids[0].tolist(), 6, stop_ids=stop_ids(text, tok))
    assert ours == theirs


def test_an_imported_models_limits_and_stop_tokens_survive_its_fine_tune(tmp_path):
    """``max_seq_len`` is what a job trains on; the export keeps the source's context length, its
    token ids and the generation config that stops at Llama 3 instruct's <|eot_id|>."""
    from hpservice.models.generate import generate
    from hpservice.models.hf import hf_config, save_hf_pretrained
    from hpservice.models.hf_text import record_from_hf, stop_ids
    from hpservice.models.llama import Llama, LlamaConfig

    source = tmp_path / "base"
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=512)
    model = Llama(cfg)
    save_hf_pretrained(model, source)
    config = json.loads((source / "config.json").read_text()) | {"bos_token_id": 1, "eos_token_id": 2}
    (source / "config.json").write_text(json.dumps(config))
    (source / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 9]}))
    record = record_from_hf(source)
    fine_tuned = LlamaConfig(**{**cfg.__dict__, "max_seq_len": 64})
    exported = hf_config(fine_tuned, record)
    assert exported["max_position_embeddings"] == 512 and exported["eos_token_id"] == 2
    assert stop_ids(record) == {2, 9}
    # generation stops at the first of them it produces
    first = generate(model, [1, 5], 8)
    stop = first[2]
    assert generate(model, [1, 5], 8, stop_ids={stop})[-1] == stop and len(generate(model, [1, 5], 8, stop_ids={stop})) <= 3


def test_an_export_writes_only_tokenizer_files_whatever_a_checkpoint_records(tmp_path):
    """A crafted checkpoint's text record names files: only the tokenizer files' own names are
    written, inside the export; a path never is."""
    from hpservice.models.hf_text import write_text_files

    out = tmp_path / "export"
    out.mkdir()
    absolute = str(tmp_path / "abs.txt")
    record = {"files": {"tokenizer.json": "{}", "../escaped.txt": "x", absolute: "y", "config.json": "z"}}
    assert write_text_files(record, out) == ["tokenizer.json"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["tokenizer.json"]
