"""Step time and memory per rank of DPO with each reference choice, next to SFT on the same model.

One Qwen3-shaped model (``--dim``, ``--layers``; random weights written as a Hugging Face directory
with a ChatML tokenizer) and generated preference pairs; ``hpservice.train.Trainer`` on ``--ranks``
gloo ranks with fully_shard, fp32 AdamW, in one run:

- ``sft full`` / ``sft lora``: cross entropy on the chosen conversations (``data.kind: chat``),
  ``2 x --pairs`` sequences a step: the same sequences a DPO step forwards;
- ``dpo lora, adapters off``: the reference is the model with its adapters switched off;
- ``dpo lora, initial adapter``: from an adapter (``model.init_adapter``), the reference holds a
  frozen copy of it;
- ``dpo full, copy``: every weight trains; the reference is a frozen copy sharded the same way.

Per row: the median step time after a warm-up and rank 0's parameters, gradients, optimizer state
and reference (``hpservice/train/_memory.py``, ``reference_gib``) as the step record reports them.
DPO's reference forward costs about one more forward per step (without its backward).
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

_WORDS = ["red", "blue", "green", "cat", "dog", "river", "stone", "light", "yes", "no", "maybe", "often", "seven"]


def _files(folder: Path, dim: int, layers: int, pairs: int, seq_len: int) -> dict:
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from hpservice.models import build_model
    from hpservice.models.hf import save_hf_pretrained

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    tok.train_from_iterator([" ".join(_WORDS)] * 8 + ["user assistant"], trainers.BpeTrainer(
        vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    torch.manual_seed(0)
    overrides = {"dim": dim, "n_layers": layers, "n_heads": dim // 64, "n_kv_heads": dim // 64, "attn_head_dim": 64,
                 "vocab_size": 320, "hidden_dim": 2 * dim, "max_seq_len": seq_len}  # fmt: skip
    base = save_hf_pretrained(build_model("qwen3", "tiny", overrides, device="cpu"), folder / "base")
    tok.save(str(base / "tokenizer.json"))
    template = Path(__file__).resolve().parents[2] / "examples" / "chat" / "chat_template.jinja"
    (base / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template.read_text()}))  # fmt: skip
    rng = random.Random(0)
    words = max(2, (seq_len - 16) // 4)  # answers long enough to fill about half a sequence

    def say(n):
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    with open(folder / "pairs.jsonl", "w") as p, open(folder / "chosen.jsonl", "w") as c:
        for _ in range(pairs * 8):
            prompt, chosen, rejected = say(words), say(words), say(words)
            user = [{"role": "user", "content": prompt}]
            p.write(json.dumps({"prompt": user, "chosen": [{"role": "assistant", "content": chosen}],
                                "rejected": [{"role": "assistant", "content": rejected}]}) + "\n")  # fmt: skip
            c.write(json.dumps({"messages": [*user, {"role": "assistant", "content": chosen}]}) + "\n")
    return {"base": str(base), "pairs": str(folder / "pairs.jsonl"), "chosen": str(folder / "chosen.jsonl")}


def _adapter(base: str, out: Path, r: int) -> str:
    """A starting adapter (what SFT leaves), written in PEFT's files by our own export path."""
    import torch

    from hpservice.models import build_model
    from hpservice.models.hf import config_from_hf
    from hpservice.models.lora import LoraSettings, apply_lora
    from hpservice.models.peft_adapter import adapter_config, peft_tensors, write_adapter

    model = build_model(None, device="cpu", init_from=base)
    settings = LoraSettings(r, 2 * r)
    modules = apply_lora(model, settings)
    torch.manual_seed(1)
    tensors = {}
    for name, p in model.named_parameters():
        if name.endswith((".lora_A", ".lora_B")):
            module, which = name.rsplit(".", 1)
            tensors.update(peft_tensors(module, which, torch.randn_like(p) * 0.02, config_from_hf(base)))
    out.mkdir(parents=True)
    write_adapter(out, tensors, adapter_config(settings, modules, base))
    return str(out)


def _train(row: str, files: dict, folder: str, ranks: int, r: int, seq_len: int, pairs: int, steps: int) -> dict:
    import torch

    from hpservice.spec import parse_job
    from hpservice.train import Trainer

    torch.set_num_threads(1)
    lora = {"r": r, "lora_alpha": 2 * r}
    model: dict = {"init_from": files["base"]}
    if "lora" in row:
        model["lora"] = lora
    if "initial adapter" in row:
        model["init_adapter"] = files["adapter"]
    if row.startswith("sft"):
        data = {"kind": "chat", "path": files["chosen"], "seq_len": seq_len, "global_batch": 2 * pairs}
        objective = {"kind": "sft"}
    else:
        data = {"kind": "preference", "path": files["pairs"], "seq_len": seq_len, "global_batch": pairs, "truncation": "truncate"}
        objective = {"kind": "dpo", "beta": 0.1}
    spec = parse_job({"name": "bench-dpo", "model": model, "data": data, "objective": objective,
                      "training": {"steps": steps + 2, "max_grad_norm": None}, "parallelism": {"dp_shard": ranks},
                      "metrics": {"dir": f"{folder}/runs", "log_every": 10_000}})  # fmt: skip
    trainer = Trainer(spec, log_to_stdout=False)
    times, record = [], None
    for i in range(steps + 2):
        t0 = time.perf_counter()
        record = trainer.train_step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    trainer.close()
    memory = {k: record.get(f"{k}_gib", 0.0) * 2**30 for k in ("params", "grads", "optimizer_state", "reference")}
    return {"step_s": statistics.median(times), **{f"{k}_bytes": v for k, v in memory.items()}, "loss": record["loss"]}


ROWS = ("sft full", "sft lora", "dpo lora, adapters off", "dpo lora, initial adapter", "dpo full, copy")


def run(dim: int = 256, layers: int = 2, ranks: int = 2, r: int = 8, seq_len: int = 128, pairs: int = 4, steps: int = 4) -> dict:
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-dpo-") as tmp:
        files = _files(Path(tmp), dim, layers, pairs, seq_len)
        files["adapter"] = _adapter(files["base"], Path(tmp) / "adapter", r)
        rows = {row: run_ranks(_train, ranks, row, files, tmp, ranks, r, seq_len, pairs, steps, timeout=1800)[0] for row in ROWS}
    anchor = rows["sft full"]["step_s"]
    for row in rows.values():
        row["step_vs_sft_full"] = row["step_s"] / anchor
        row["state_bytes"] = sum(row[f"{k}_bytes"] for k in ("params", "grads", "optimizer_state", "reference"))
    return {"dim": dim, "layers": layers, "ranks": ranks, "r": r, "seq_len": seq_len, "pairs": pairs, "rows": rows}


def _main(args: argparse.Namespace) -> int:
    res = run(args.dim, args.layers, args.ranks, args.r, args.seq_len, args.pairs, args.steps)
    print(f"dpo: qwen3-shaped dim {res['dim']} x {res['layers']} layers, fully_shard over {res['ranks']} ranks, "
          f"{res['pairs']} pairs (2 x {res['pairs']} sequences of {res['seq_len']}) a step, LoRA r {res['r']}; MiB per rank")  # fmt: skip
    print(f"{'':28}{'step ms':>9}{'vs sft':>8}{'params':>9}{'grads':>9}{'optim':>9}{'reference':>10}{'total':>9}")
    for name, row in res["rows"].items():
        mib = [row[f"{k}_bytes"] / 2**20 for k in ("params", "grads", "optimizer_state", "reference")]
        print(f"{name:28}{row['step_s'] * 1000:>9.1f}{row['step_vs_sft_full']:>7.2f}x"
              + "".join(f"{m:>9.2f}" if i != 3 else f"{m:>10.2f}" for i, m in enumerate(mib))
              + f"{row['state_bytes'] / 2**20:>9.2f}")  # fmt: skip
    if args.json:
        print(json.dumps(res))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("dpo", help="DPO's step time and memory per rank, each reference choice, next to SFT")
    p.add_argument("--dim", type=int, default=256, help="model width (a multiple of 64)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--r", type=int, default=8, help="LoRA rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--pairs", type=int, default=4, help="pairs a step (global)")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    p.set_defaults(run=_main)
