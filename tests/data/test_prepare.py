"""`hpservice prepare-data`: corpora the tests write -> token files a job trains on; the tokens
decode back to the documents, documents are separated by EOS, and bad input names its place."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from hpservice.cli import main
from hpservice.data import TokenFile, read_metadata

DOCS = [f"Document number {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(40)]


def _corpus(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    with (tmp_path / "b.jsonl").open("w") as f:
        for doc in DOCS[1:]:
            f.write(json.dumps({"id": 1, "text": doc}) + "\n")
    return [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]


def test_train_a_tokenizer_prepare_and_read_back(tmp_path, capsys):
    inputs = _corpus(tmp_path)
    tok_path, out = tmp_path / "tok" / "tokenizer.json", tmp_path / "data" / "train.bin"
    args = ["prepare-data", *inputs, "--tokenizer", str(tok_path), "--out", str(out), "--val-fraction", "0.1"]
    assert main([*args, "--train-tokenizer", "--vocab-size", "300"]) == 0, capsys.readouterr().err
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    meta = read_metadata(out)
    assert meta["vocab_size"] == tok.get_vocab_size() <= 300 and meta["dtype"] == "uint16" and meta["eos_id"] == eos
    val = out.with_name("train-val.bin")
    assert meta["documents"] == 36 and read_metadata(val)["documents"] == 4  # every 10th document
    tokens = np.fromfile(out, dtype=np.uint16)
    docs = [tok.decode(list(map(int, part))) for part in np.split(tokens, np.where(tokens == eos)[0] + 1) if part.size]
    train_docs = [d for i, d in enumerate(DOCS) if i % 10 != 9]
    assert [d.removesuffix("<|endoftext|>") for d in docs] == train_docs  # exact round trip, EOS between
    assert TokenFile(out, vocab_size=meta["vocab_size"]).num_tokens == meta["tokens"] == tokens.size


def test_bad_input_names_the_file_and_line(tmp_path, capsys):
    inputs = _corpus(tmp_path)
    tok_path = tmp_path / "tokenizer.json"
    assert main(["prepare-data", *inputs, "--tokenizer", str(tok_path), "--out", str(tmp_path / "t.bin"),
                 "--train-tokenizer", "--vocab-size", "280"]) == 0  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    assert main(["prepare-data", str(bad), "--tokenizer", str(tok_path), "--out", str(tmp_path / "x.bin")]) == 1
    assert f"{bad}:2: no string field 'text'" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists()
    assert main(["prepare-data", str(bad), "--tokenizer", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.bin")]) == 1
    assert "cannot load a tokenizers tokenizer.json" in capsys.readouterr().err


def test_the_trainer_refuses_a_token_file_the_model_cannot_embed(ranks, tmp_path):
    from hpservice.launch import RankFailure
    from tests._jobs import tiny_llama_job, train

    inputs = _corpus(tmp_path)
    out = tmp_path / "train.bin"
    assert main(["prepare-data", *inputs, "--tokenizer", str(tmp_path / "tok.json"), "--out", str(out),
                 "--train-tokenizer", "--vocab-size", "300"]) == 0  # fmt: skip
    vocab = read_metadata(out)["vocab_size"]
    assert vocab > 256
    spec = tiny_llama_job(tmp_path / "run", data={"kind": "tokens", "path": str(out), "seq_len": 16})  # vocab 256
    with pytest.raises(RankFailure, match=f"TrainingError: .*vocabulary of {vocab} .* larger than the model's 256"):
        ranks(1).run(train, spec)
    big = tiny_llama_job(
        tmp_path / "run2", data={"kind": "tokens", "path": str(out), "seq_len": 16}, model={"overrides": {"vocab_size": 320}}
    )
    assert len(ranks(1).run(train, big)[0]) == 4  # a model whose vocabulary covers it trains


def test_parquet_input_reads_the_named_column(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    inputs = _corpus(tmp_path)
    pq.write_table(pa.table({"id": list(range(5)), "body": DOCS[:5]}), tmp_path / "c.parquet")
    tok = tmp_path / "tok.json"
    assert main(["prepare-data", *inputs, "--tokenizer", str(tok), "--out", str(tmp_path / "a.bin"),
                 "--train-tokenizer", "--vocab-size", "300"]) == 0  # fmt: skip
    out = tmp_path / "p.bin"
    assert main(["prepare-data", str(tmp_path / "c.parquet"), "--field", "body", "--tokenizer", str(tok), "--out", str(out)]) == 0
    tokenizer = Tokenizer.from_file(str(tok))
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokens = np.fromfile(out, dtype=np.uint16)
    parts = [tokenizer.decode(list(map(int, p))) for p in np.split(tokens, np.where(tokens == eos)[0] + 1) if p.size]
    assert [p.removesuffix("<|endoftext|>") for p in parts] == DOCS[:5]
    assert main(["prepare-data", str(tmp_path / "c.parquet"), "--tokenizer", str(tok), "--out", str(out)]) == 1
    assert "no column 'text' (columns: id, body; use --field)" in capsys.readouterr().err


def test_a_job_tokenizes_its_text_with_data_tokenizer(ranks, tmp_path):
    """data: {kind: text, tokenizer: tokenizer.json}: rank 0 tokenizes the text once into the run's
    directory, every rank trains on it; the same tokens as prepare-data gives."""
    from tests._jobs import tiny_llama_job, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(DOCS * 3))
    tok = tmp_path / "tok.json"
    assert main(["prepare-data", str(corpus), "--tokenizer", str(tok), "--out", str(tmp_path / "ref.bin"),
                 "--train-tokenizer", "--vocab-size", "300"]) == 0  # fmt: skip
    data = {"kind": "text", "path": str(corpus), "tokenizer": str(tok), "seq_len": 16}
    spec = tiny_llama_job(tmp_path / "run", data=data, model={"overrides": {"vocab_size": 320}})
    assert len(ranks(2).run(train, spec)[0]) == 4
    (cache,) = (tmp_path / "run").glob("t-*/data/corpus.txt.*.bin")
    assert np.array_equal(np.fromfile(cache, dtype=np.uint16), np.fromfile(tmp_path / "ref.bin", dtype=np.uint16))
    missing = tiny_llama_job(tmp_path / "run2", data={**data, "tokenizer": str(tmp_path / "missing.json")})
    with pytest.raises(Exception, match=r"(?s)rank 0 raised.*data\.tokenizer: .*no such file.*rank 1 raised"):
        ranks(2).run(train, missing)
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    broken = tiny_llama_job(tmp_path / "run3", data={**data, "tokenizer": str(tmp_path / "bad.json")})
    with pytest.raises(Exception, match=r"(?s)rank 0 raised.*cannot load a tokenizers tokenizer\.json.*rank 1 raised"):
        ranks(2).run(train, broken)  # both ranks stop with rank 0's reason (none waits for it)


def _eos_of_trainer(spec):
    from hpservice.train import Trainer

    return Trainer(spec, log_to_stdout=False).data.eos_id


def test_document_mask_takes_the_end_of_text_token_prepare_data_recorded(ranks, tmp_path):
    """data.document_mask on a prepare-data file: its recorded EOS id ends documents; a bare .bin
    file records none, and the job says to set data.eos_id."""
    from tests._jobs import tiny_llama_job

    inputs = _corpus(tmp_path)
    tok, out = tmp_path / "tokenizer.json", tmp_path / "train.bin"
    assert main(["prepare-data", *inputs, "--tokenizer", str(tok), "--out", str(out),
                 "--train-tokenizer", "--vocab-size", "300"]) == 0  # fmt: skip
    data = {"kind": "tokens", "path": str(out), "seq_len": 16, "document_mask": True}
    model = {"overrides": {"vocab_size": 320}}
    spec = tiny_llama_job(tmp_path / "run", data=data, model=model)
    assert ranks(1).run(_eos_of_trainer, spec)[0] == read_metadata(out)["eos_id"]
    bare = tmp_path / "bare.bin"
    bare.write_bytes(out.read_bytes())
    spec = tiny_llama_job(tmp_path / "run2", data={**data, "path": str(bare)}, model=model)
    with pytest.raises(Exception, match=r"data\.document_mask: .*bare\.bin records no end-of-text token.*set data\.eos_id"):
        ranks(1).run(_eos_of_trainer, spec)
    spec = tiny_llama_job(tmp_path / "run3", data={**data, "path": str(bare), "eos_id": 7}, model=model)
    assert ranks(1).run(_eos_of_trainer, spec)[0] == 7
