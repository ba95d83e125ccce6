"""Chat fine-tuning's data path: encoding speed, packing efficiency, and step time against the same
model on pre-tokenised tokens.

What is measured, on a generated multi-turn chat corpus (``--conversations``, ChatML turns of
random lengths) with a BPE tokenizer trained on it and the example's template
(``examples/chat/chat_template.jinja``):

- ``encode``: records and tokens per second encoding the corpus (render, tokenize, mask), in this
  process and in ``--workers`` worker processes;
- ``train``: one Llama (``--flavor``) trained by ``hpservice.train.Trainer`` in one process, on
  the chat data (``packing: none`` and ``best_fit``) and on the same token count of pre-tokenised
  tokens (``kind: tokens``, the anchor): steady step time (median of the timed steps),
  tokens/s of all positions and of conversation tokens, the packing efficiency, and the share of
  the step the data path takes (building the step's batch).

The anchor and the chat rows run in the same process one after another, on the same model and
batch shape; the chat row's step time over the anchor's is the data path's cost (target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from hpservice.launch import run_ranks

_WORDS = ["the", "a", "river", "mountain", "garden", "window", "lantern", "harbor", "city", "sea", "wind", "light", "stone", "road", "tree", "bird", "cloud"]


def _corpus(folder: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = folder / "chats.jsonl"
    with open(path, "w") as f:
        for _ in range(n):
            msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(1, 4)):
                for role in ("user", "assistant"):
                    words = rng.randint(4, 60)
                    msgs.append({"role": role, "content": " ".join(rng.choice(_WORDS) for _ in range(words)) + "."})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def _tokenizer(folder: Path, corpus: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [m["content"] for line in corpus.read_text().splitlines() for m in json.loads(line)["messages"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    out = folder / "tokenizer"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    template = Path(__file__).resolve().parents[2] / "examples" / "chat" / "chat_template.jinja"
    (out / "chat_template.jinja").write_text(template.read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return out


def _encode_rates(corpus: Path, tokenizer: Path, seq_len: int, workers: int) -> dict:
    from hpservice.data.chat import ChatOptions, encode_corpus, load_chat_tokenizer

    tok = load_chat_tokenizer(str(tokenizer))
    out = {}
    for name, w in (("in process", 0), (f"{workers} workers", workers)):
        t0 = time.perf_counter()
        c = encode_corpus([[str(corpus)]], tok, ChatOptions(seq_len=seq_len), workers=w)
        dt = time.perf_counter() - t0
        out[name] = {"records_per_s": c.stats["records"] / dt, "tokens_per_s": c.stats["tokens"] / dt, "seconds": dt}
    return out


def _train(kind: str, folder: str, flavor: str, seq_len: int, batch: int, steps: int, packing: str) -> dict:
    import torch

    from hpservice.spec import parse_job
    from hpservice.train import Trainer

    torch.set_num_threads(1)
    data = {"seq_len": seq_len, "global_batch": batch}
    if kind == "chat":
        data.update(kind="chat", path=f"{folder}/chats.jsonl", tokenizer=f"{folder}/tokenizer", packing=packing)
    else:
        data.update(kind="tokens", path=f"{folder}/tokens.bin")
    spec = parse_job({"name": f"bench-sft-{kind}", "model": {"name": "llama", "flavor": flavor, "overrides": {"vocab_size": 512, "max_seq_len": seq_len}},
                      "data": data, "training": {"steps": steps + 3},
                      "metrics": {"dir": f"{folder}/runs", "log_every": 10_000}})  # fmt: skip
    trainer = Trainer(spec, log_to_stdout=False)
    source, data_s, step_s, facts = trainer.data, [], [], []

    def timed_batches(step):
        t0 = time.perf_counter()
        b = source(step)
        data_s.append(time.perf_counter() - t0)
        return b

    trainer.data = type("Timed", (), {"__call__": lambda self, s: timed_batches(s), "__getattr__": lambda self, a: getattr(source, a)})()
    for i in range(steps + 2):
        t0 = time.perf_counter()
        record = trainer.train_step()
        if i >= 2:  # warm-up first
            step_s.append(time.perf_counter() - t0)
            facts.append(record.get("packing_efficiency", 1.0))
    trainer.close()
    median = statistics.median(step_s)
    return {"step_s": median, "tokens_per_s": batch * seq_len / median, "efficiency": statistics.mean(facts),
            "data_share": statistics.median(data_s[2:]) / median}  # fmt: skip


def run(conversations: int = 2000, flavor: str = "small", seq_len: int = 512, batch: int = 8, steps: int = 8, workers: int = 2) -> dict:
    import numpy as np

    from hpservice.data import write_token_file
    from hpservice.data.chat import ChatOptions, encode_corpus, load_chat_tokenizer

    with tempfile.TemporaryDirectory(prefix="hpservice-bench-sft-") as tmp:
        folder = Path(tmp)
        corpus = _corpus(folder, conversations)
        tokenizer = _tokenizer(folder, corpus)
        encode = _encode_rates(corpus, tokenizer, seq_len, workers)
        ids = encode_corpus([[str(corpus)]], load_chat_tokenizer(str(tokenizer)), ChatOptions(seq_len=seq_len)).tokens
        write_token_file(folder / "tokens.bin", np.asarray(ids))  # the anchor: the same tokens, pre-tokenised
        rows = {}
        for name, kind, packing in (("tokens (anchor)", "tokens", "none"), ("chat, padded", "chat", "none"),
                                    ("chat, best_fit", "chat", "best_fit")):  # fmt: skip
            rows[name] = run_ranks(_train, 1, kind, tmp, flavor, seq_len, batch, steps, packing, timeout=1800)[0]
    anchor = rows["tokens (anchor)"]["step_s"]
    for row in rows.values():
        row["step_vs_anchor"] = row["step_s"] / anchor
        row["trained_positions_per_s"] = row["tokens_per_s"] * row["efficiency"]
    return {"conversations": conversations, "flavor": flavor, "seq_len": seq_len, "batch": batch, "encode": encode, "rows": rows}


def _main(args: argparse.Namespace) -> int:
    r = run(args.conversations, args.flavor, args.seq_len, args.batch, args.steps, args.workers)
    print(f"sft: {r['conversations']} conversations, llama {r['flavor']}, batch {r['batch']} x {r['seq_len']}, one process")
    for name, e in r["encode"].items():
        print(f"  encode {name:12} {e['records_per_s']:>9,.0f} records/s {e['tokens_per_s']:>11,.0f} tokens/s")
    print(f"{'':18}{'step ms':>9}{'vs anchor':>10}{'tokens/s':>10}{'conv tok/s':>11}{'packing':>9}{'data share':>11}")
    for name, row in r["rows"].items():
        print(f"{name:18}{row['step_s'] * 1000:>9.1f}{row['step_vs_anchor']:>9.2f}x{row['tokens_per_s']:>10,.0f}"
              f"{row['trained_positions_per_s']:>11,.0f}{row['efficiency']:>9.0%}{row['data_share']:>11.1%}")  # fmt: skip
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("sft", help="chat data: encoding speed, packing efficiency, step time vs pre-tokenised tokens")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--flavor", default="small", help="llama flavor (default small)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--workers", type=int, default=2, help="encoding worker processes")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)
