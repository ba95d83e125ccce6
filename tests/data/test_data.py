"""hpservice.data: determinism, world-size independence, resume, file formats and errors."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from hpservice.data import (
    Batch,
    ByteTokenizer,
    SyntheticTokens,
    TextFile,
    TokenFile,
    TokenSource,
    build_source,
    write_token_file,
)

TEXT = "Hello, world! Grüße, naïve café — 日本語のテキスト 🙂\n" * 20


@pytest.fixture(params=["synthetic", "tokens16", "tokens32", "text"])
def source(request, tmp_path) -> TokenSource:
    """One source of each kind, seed 7."""
    kind = request.param
    if kind == "synthetic":
        return SyntheticTokens(vocab_size=97, seed=7)
    if kind == "tokens16":
        path = write_token_file(tmp_path / "train.bin", np.random.default_rng(0).integers(0, 50_000, 5000))
        return TokenFile(path, seed=7)
    if kind == "tokens32":
        path = write_token_file(tmp_path / "train.u32.bin", np.arange(100_000, 105_000), dtype=np.uint32)
        return TokenFile(path, seed=7)
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return TextFile(path, seed=7)


def pair(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A source's batch as ``(inputs, labels)``; these sources' labels all count."""
    assert batch.num_valid() == batch.labels.numel() and batch.document_ids is None
    return batch.inputs, batch.labels


def global_batch(src: TokenSource, step: int, dp_size: int, gb: int = 8, seq_len: int = 16):
    parts = [pair(src.batch(step, r, dp_size, gb, seq_len)) for r in range(dp_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


# ---------------------------------------------------------------- properties of every source


def test_shapes_dtypes_and_shift(source):
    x, y = pair(source.batch(step=3, dp_rank=1, dp_size=2, global_batch=8, seq_len=16))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one token
    assert x.min() >= 0 and max(x.max(), y.max()) < source.vocab_size


def test_deterministic(source, tmp_path):
    a = pair(source.batch(5, 0, 1, 8, 16))
    b = pair(source.batch(5, 0, 1, 8, 16))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    # A fresh object over the same data with the same seed gives the same batch...
    fresh = pickle.loads(pickle.dumps(source))
    assert all(torch.equal(u, v) for u, v in zip(a, pair(fresh.batch(5, 0, 1, 8, 16))))
    # ... and other steps give other batches.
    assert not torch.equal(a[0], source.batch(6, 0, 1, 8, 16).inputs)


def test_world_size_independent(source):
    for step in (0, 1, 11):
        ref = global_batch(source, step, dp_size=1)
        for dp_size in (2, 4, 8):
            got = global_batch(source, step, dp_size)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (step, dp_size)


def test_resume_sees_the_same_batches(source):
    straight = [source.batch(s, 1, 2, 8, 16).inputs for s in range(6)]
    resumed = pickle.loads(pickle.dumps(source))  # e.g. a restarted process
    assert torch.equal(resumed.batch(4, 1, 2, 8, 16).inputs, straight[4])
    assert torch.equal(resumed.batch(5, 1, 2, 8, 16).inputs, straight[5])


def test_seed_changes_the_order(tmp_path):
    path = write_token_file(tmp_path / "t.bin", np.arange(5000))
    a, b = TokenFile(path, seed=0), TokenFile(path, seed=1)
    assert not torch.equal(a.batch(0, 0, 1, 8, 16).inputs, b.batch(0, 0, 1, 8, 16).inputs)
    assert not torch.equal(
        SyntheticTokens(50, seed=0).batch(0, 0, 1, 8, 16).inputs, SyntheticTokens(50, seed=1).batch(0, 0, 1, 8, 16).inputs
    )


def test_batch_argument_errors(source):
    with pytest.raises(ValueError, match=r"global_batch=6.*dp_size=4"):
        source.batch(0, 0, 4, 6, 16)
    with pytest.raises(ValueError, match="dp_rank"):
        source.batch(0, 2, 2, 8, 16)
    with pytest.raises(ValueError, match="step"):
        source.batch(-1, 0, 1, 8, 16)
    with pytest.raises(ValueError, match="seq_len"):
        source.batch(0, 0, 1, 8, 0)
    with pytest.raises(TypeError, match="global_batch"):
        source.batch(0, 0, 1, 8.0, 16)


# ---------------------------------------------------------------- synthetic


def test_synthetic_tokens_in_range_and_follow_the_chain():
    src = SyntheticTokens(vocab_size=10, seed=3, branching=3)
    x, y = pair(src.batch(0, 0, 1, 16, 64))
    assert x.min() >= 0 and x.max() < 10 and y.max() < 10
    allowed = {(a, b) for a in range(10) for b in src.successors[a]}
    assert all((int(a), int(b)) in allowed for a, b in zip(x.flatten(), y.flatten()))
    assert src.num_tokens is None and math.isclose(src.loss_floor, math.log(3))


def test_synthetic_argument_errors():
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticTokens(vocab_size=1)
    with pytest.raises(ValueError, match="branching"):
        SyntheticTokens(vocab_size=4, branching=5)
    with pytest.raises(ValueError, match="seed"):
        SyntheticTokens(vocab_size=4, seed=-1)


def test_synthetic_is_learnable():
    """A bigram model (embedding + linear) trained for a few steps on the stream beats chance clearly."""
    torch.manual_seed(0)
    vocab = 64
    src = SyntheticTokens(vocab, seed=0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threading only adds overhead
    try:
        losses = []
        for step in range(100):
            x, y = pair(src.batch(step, 0, 1, 16, 32))
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > math.log(vocab) - 0.5
    assert sum(losses[-10:]) / 10 < src.loss_floor + 0.3  # ln 64 = 4.16 -> about ln 4 = 1.39


# ---------------------------------------------------------------- token files


@pytest.mark.parametrize(("name", "dtype", "base"), [("a.bin", np.uint16, 60_000), ("a.u32.bin", np.uint32, 70_000)])
def test_token_file_round_trip(tmp_path, name, dtype, base):
    tokens = np.arange(base, base + 1000)
    path = write_token_file(tmp_path / name, tokens, dtype=dtype)
    assert path.stat().st_size == 1000 * np.dtype(dtype).itemsize
    src = TokenFile(path)  # dtype inferred from the name
    assert src.dtype == np.dtype(dtype) and src.num_tokens == 1000
    assert src.vocab_size == base + 1000  # max id + 1
    assert np.array_equal(src.tokens, tokens)
    x, y = pair(src.batch(0, 0, 1, 8, 32))
    # Every window is a contiguous run of the file: consecutive ids here.
    assert torch.equal(x - x[:, :1], torch.arange(32).expand(8, 32))
    assert torch.equal(y, x + 1)
    assert x.min() >= base


def test_token_file_explicit_dtype_and_vocab(tmp_path):
    path = write_token_file(tmp_path / "big.bin", np.arange(70_000, 70_100), dtype=np.uint32)
    assert TokenFile(path, dtype="uint32").tokens[0] == 70_000
    assert TokenFile(path, np.uint16).num_tokens == 200  # wrong dtype: not detectable from the size here
    src = TokenFile(path, dtype=np.uint32, vocab_size=70_050)
    with pytest.raises(ValueError, match=r"big\.bin.*vocab_size=70050"):
        for step in range(20):
            src.batch(step, 0, 1, 4, 8)
    with pytest.raises(ValueError, match="uint16 or uint32"):
        TokenFile(path, dtype=np.int32)


def test_token_file_windows_cover_all_starts(tmp_path):
    path = write_token_file(tmp_path / "t.bin", np.arange(10))
    src = TokenFile(path)
    starts = {int(src.batch(s, 0, 1, 4, 8).inputs[r, 0]) for s in range(20) for r in range(4)}
    assert starts == {0, 1}  # 10 tokens, windows of 9: starts 0 and 1 only
    x, y = pair(src.batch(0, 0, 1, 2, 9))  # exactly one valid window
    assert torch.equal(x[0], torch.arange(9)) and torch.equal(y[0], torch.arange(1, 10))


def test_token_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.bin"):
        TokenFile(tmp_path / "missing.bin")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"odd\.bin.*multiple of 2"):
        TokenFile(odd)
    odd32 = tmp_path / "odd.u32.bin"
    odd32.write_bytes(b"\x00" * 6)
    with pytest.raises(ValueError, match=r"odd\.u32\.bin.*multiple of 4"):
        TokenFile(odd32)
    tiny = write_token_file(tmp_path / "tiny.bin", [5])
    with pytest.raises(ValueError, match=r"tiny\.bin.*at least 2"):
        TokenFile(tiny)
    short = TokenFile(write_token_file(tmp_path / "short.bin", np.arange(16)))
    with pytest.raises(ValueError, match=r"short\.bin.*seq_len \+ 1 = 17"):
        short.batch(0, 0, 1, 2, 16)
    with pytest.raises(ValueError, match="not a regular file"):
        TokenFile(tmp_path)


def test_write_token_file_rejects_what_does_not_fit(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_token_file(tmp_path / "a.bin", [1, 70_000])
    with pytest.raises(ValueError, match="must be in"):
        write_token_file(tmp_path / "a.bin", [-1, 2])
    with pytest.raises(ValueError, match="integers"):
        write_token_file(tmp_path / "a.bin", [1.5, 2.0])
    with pytest.raises(ValueError, match="must hold uint32"):
        write_token_file(tmp_path / "a.u32.bin", [1, 2], dtype=np.uint16)
    assert not (tmp_path / "a.bin").exists() and not (tmp_path / "a.u32.bin").exists()
    assert write_token_file(tmp_path / "c.u32.bin", [1, 2]).stat().st_size == 8  # uint32 from the name
    path = write_token_file(tmp_path / "b.bin", torch.tensor([[1, 2], [3, 4]]))
    assert np.array_equal(TokenFile(path).tokens, [1, 2, 3, 4])


def test_pickle_does_not_carry_the_data(tmp_path):
    src = TokenFile(write_token_file(tmp_path / "t.bin", np.zeros(100_000, dtype=np.int64)))
    src.batch(0, 0, 1, 2, 8)  # opens the memmap
    assert len(pickle.dumps(src)) < 2_000


# ---------------------------------------------------------------- text files


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in ["", "plain ascii", TEXT, "\x00\x7f\u00ff\u0100\U0010ffff"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.decode(torch.tensor([0xC3, 0xA9])) == "é"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut character is replaced, not an error
    with pytest.raises(ValueError, match="256"):
        tok.decode([300])


def test_text_file_windows_are_the_file_bytes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    data = TEXT.encode("utf-8")
    src = TextFile(path, seed=1)
    assert src.vocab_size == 256 and src.num_tokens == len(data)
    x, y = pair(src.batch(2, 0, 1, 8, 40))
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in data
    assert src.tokenizer.decode(src.tokenizer.encode(TEXT)) == TEXT


def test_text_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        TextFile(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt.*at least 2"):
        TextFile(empty)


# ---------------------------------------------------------------- build_source


def test_build_source(tmp_path):
    assert isinstance(build_source("synthetic", vocab_size=32, seed=3), SyntheticTokens)
    bin_path = write_token_file(tmp_path / "t.bin", np.arange(100))
    tf = build_source("tokens", path=bin_path, vocab_size=128, seed=2)
    assert isinstance(tf, TokenFile) and tf.vocab_size == 128 and tf.seed == 2
    txt = tmp_path / "t.txt"
    txt.write_text("some text here")
    assert isinstance(build_source("text", path=str(txt)), TextFile)
    assert build_source("text", path=txt, vocab_size=256).vocab_size == 256


def test_build_source_errors(tmp_path):
    with pytest.raises(ValueError, match=r"'parquet'.*synthetic, tokens, text"):
        build_source("parquet", path="x")
    with pytest.raises(ValueError, match="vocab_size"):
        build_source("synthetic")
    with pytest.raises(ValueError, match="no path"):
        build_source("synthetic", vocab_size=8, path="x.bin")
    for kind in ("tokens", "text"):
        with pytest.raises(ValueError, match="needs a path"):
            build_source(kind)
        with pytest.raises(FileNotFoundError, match=r"absent\.bin"):
            build_source(kind, path=tmp_path / "absent.bin")
    txt = tmp_path / "t.txt"
    txt.write_text("some text")
    with pytest.raises(ValueError, match="256"):
        build_source("text", path=txt, vocab_size=1000)
