"""Memory per rank and step time of full fine-tuning, LoRA and QLoRA on the same model and layout.

One Qwen3-shaped model (``--dim``, ``--layers``; random weights written as a Hugging Face
directory, the base every row starts from) is trained by ``hpservice.train.Trainer`` on
``--ranks`` gloo ranks with fully_shard, fp32, AdamW, on the same synthetic batches, three ways in
one run:

- ``full``: every weight trains;
- ``lora``: adapters of rank ``--r`` on every linear layer but the head (``all-linear``);
- ``qlora``: the same adapters over the adapted weights held in NF4 (torchao), each rank holding
  its rows of them.

Per row, rank 0's training state between steps as the step record reports it (parameters,
gradients, optimizer state: ``hpservice/train/_memory.py``) next to the analytic count of the same
(bytes per element times elements, fully_shard's share), the process's peak resident memory,
the median step time after a warm-up, and each row's losses; QLoRA's loss is compared with LoRA's
on the same steps (the cost of the 4-bit base). CPU timings say what the dequantisation costs
relative to the same run's other rows, not what a GPU does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from hpservice.launch import run_ranks

# NF4 (torchao, the QLoRA paper's): 4 bits a weight, an int8 scaler per 64 weights, and per 256
# scalers an fp32 factor; a tensor's mean scaler (fp32) and its 16-entry code book are ignored.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)


def _base(folder: Path, dim: int, layers: int) -> Path:
    import torch

    from hpservice.models import build_model
    from hpservice.models.hf import save_hf_pretrained

    torch.manual_seed(0)
    overrides = {"dim": dim, "n_layers": layers, "n_heads": dim // 64, "n_kv_heads": dim // 64, "attn_head_dim": 64, "vocab_size": 1024,
                 "hidden_dim": 2 * dim, "max_seq_len": 512}  # fmt: skip
    model = build_model("qwen3", "tiny", overrides, device="cpu")
    return save_hf_pretrained(model, folder / "base")


def _train(mode: str, base: str, folder: str, ranks: int, r: int, seq_len: int, batch: int, steps: int) -> dict:
    import torch

    from hpservice.spec import parse_job
    from hpservice.train import Trainer

    torch.set_num_threads(1)
    model: dict = {"init_from": base}
    if mode != "full":
        model["lora"] = {"r": r, "lora_alpha": 2 * r, "quantize_base": "nf4" if mode == "qlora" else "none"}
    spec = parse_job({"name": f"bench-lora-{mode}", "model": model,
                      "data": {"kind": "synthetic", "seq_len": seq_len, "global_batch": batch},
                      "training": {"steps": steps + 2, "max_grad_norm": None},
                      "parallelism": {"dp_shard": ranks},
                      "metrics": {"dir": f"{folder}/runs", "log_every": 10_000}})  # fmt: skip
    trainer = Trainer(spec, log_to_stdout=False)
    records, times = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        records.append(trainer.train_step())
        if i >= 2:  # warm-up first
            times.append(time.perf_counter() - t0)
    trainer.close()
    last = records[-1]
    return {"losses": [rec["loss"] for rec in records], "step_s": statistics.median(times),
            **{f"{k}_bytes": last[f"{k}_gib"] * 2**30 for k in ("params", "grads", "optimizer_state", "peak_rss")},
            "trainable": last["trainable_params"], "total": last["total_params"]}  # fmt: skip


def _analytic(mode: str, base: str, ranks: int, r: int) -> dict:
    """Bytes per rank from the element counts: fp32 parameters and gradients, AdamW's two fp32
    moments; fully_shard divides every sharded tensor by the ranks; an NF4 weight by rows where its
    blocks divide (``shard_base_nf4``), else it stays whole."""
    from hpservice.models import build_model
    from hpservice.models.lora import NF4_BLOCK, NF4_SCALER_BLOCK, LoRALinear, LoraSettings, apply_lora

    model = build_model(None, device="meta", init_from=base)
    total = sum(p.numel() for p in model.parameters())
    if mode == "full":
        return {"params": 4 * total / ranks, "grads": 4 * total / ranks, "optimizer_state": 8 * total / ranks}
    apply_lora(model, LoraSettings(r, 2 * r))
    adapters = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B")))
    weights = [m.weight for m in model.modules() if isinstance(m, LoRALinear)]
    adapted = sum(w.numel() for w in weights)
    if mode == "lora":
        params = 4 * (total + adapters) / ranks
    else:
        unit = NF4_BLOCK * NF4_SCALER_BLOCK
        split = [ranks if w.size(0) % ranks == 0 and (w.numel() // ranks) % unit == 0 else 1 for w in weights]
        params = sum(NF4_BYTES_PER_WEIGHT * w.numel() / k for w, k in zip(weights, split, strict=True))
        params += 4 * (total - adapted + adapters) / ranks
    return {"params": params, "grads": 4 * adapters / ranks, "optimizer_state": 8 * adapters / ranks}


def run(dim: int = 512, layers: int = 4, ranks: int = 2, r: int = 16, seq_len: int = 128, batch: int = 4, steps: int = 4) -> dict:
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-lora-") as tmp:
        base = str(_base(Path(tmp), dim, layers))
        rows = {}
        for mode in ("full", "lora", "qlora"):
            measured = run_ranks(_train, ranks, mode, base, tmp, ranks, r, seq_len, batch, steps, timeout=1800)[0]
            rows[mode] = {**measured, "analytic": _analytic(mode, base, ranks, r)}
    full = rows["full"]
    for row in rows.values():
        state = row["params_bytes"] + row["grads_bytes"] + row["optimizer_state_bytes"]
        row["state_bytes"] = state
        row["state_vs_full"] = state / (full["params_bytes"] + full["grads_bytes"] + full["optimizer_state_bytes"])
        row["step_vs_full"] = row["step_s"] / full["step_s"]
    qlora_vs_lora = max(abs(a - b) for a, b in zip(rows["qlora"]["losses"], rows["lora"]["losses"], strict=True))
    return {"dim": dim, "layers": layers, "ranks": ranks, "r": r, "seq_len": seq_len, "batch": batch, "rows": rows,
            "qlora_vs_lora_max_loss_diff": qlora_vs_lora}  # fmt: skip


def _mib(b: float) -> str:
    return f"{b / 2**20:9.2f}"


def _main(args: argparse.Namespace) -> int:
    r = run(args.dim, args.layers, args.ranks, args.r, args.seq_len, args.batch, args.steps)
    print(f"lora: qwen3-shaped dim {r['dim']} x {r['layers']} layers, fully_shard over {r['ranks']} ranks, r {r['r']}, "
          f"batch {r['batch']} x {r['seq_len']}, fp32 AdamW; MiB per rank, measured (analytic)")  # fmt: skip
    print(f"{'':7}{'trainable':>12}{'params':>20}{'grads':>20}{'optimizer':>20}{'state/full':>11}{'peak RSS':>10}"
          f"{'step ms':>9}{'step/full':>10}")
    for mode, row in r["rows"].items():
        a = row["analytic"]
        print(f"{mode:7}{row['trainable']:>12,}{_mib(row['params_bytes'])} ({_mib(a['params'])}){_mib(row['grads_bytes'])} ("
              f"{_mib(a['grads'])}){_mib(row['optimizer_state_bytes'])} ({_mib(a['optimizer_state'])})"
              f"{row['state_vs_full']:>10.3f}x{row['peak_rss_bytes'] / 2**20:>10.0f}{row['step_s'] * 1000:>9.1f}"
              f"{row['step_vs_full']:>9.2f}x")  # fmt: skip
    print(f"QLoRA vs LoRA, the same steps: max |loss difference| {r['qlora_vs_lora_max_loss_diff']:.2e} "
          f"(losses lora {[round(x, 4) for x in r['rows']['lora']['losses']]}, qlora "
          f"{[round(x, 4) for x in r['rows']['qlora']['losses']]})")  # fmt: skip
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="memory per rank and step time: full fine-tuning vs LoRA vs QLoRA")
    p.add_argument("--dim", type=int, default=512, help="model width (a multiple of 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (fully_shard over them)")
    p.add_argument("--r", type=int, default=16, help="adapter rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    p.set_defaults(run=_main)
