"""One-GPU benchmark: our fully_shard against torch FSDP2 in the same training loop, and the
trainer's bf16 / activation-checkpointing / compile configurations: tokens/s, MFU, peak memory.

What is measured, on ``cuda:0`` in this process (a world of one over NCCL), for one Llama
(``--size``: ``1b``-like shapes by default, bf16 parameters with fp32 reductions):

- ``ours`` / ``fsdp2``: the same loop (``zero_grad``, forward, cross entropy, backward, AdamW
  ``step``) over the same synthetic batches, the model wrapped per block then at the root by
  ``hpservice.fsdp.fully_shard`` or ``torch.distributed.fsdp.fully_shard`` with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. A world of one issues no
  collectives, so the ratio measures what each FSDP adds to a step on one device.
- ``trainer ...``: ``hpservice.train.Trainer`` on the same shapes with
  ``parallelism.mixed_precision: bf16`` and the activation-checkpointing / compile settings named.

Per row: median step time over ``--steps`` after ``--warmup`` (compile happens in the warm-up),
tokens/s, MFU (``hpservice.train._utilisation``'s peak table; None for a GPU not in it) and the
peak allocated memory (``torch.cuda.max_memory_allocated`` since the row started).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SIZES = {
    "1b": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 32000, "max_seq_len": 2048},
    "small": {"dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 8192, "max_seq_len": 512},
}
TRAINER_ROWS = {
    "trainer bf16": {},
    "trainer bf16 + AC full": {"activation_checkpointing": "full"},
    "trainer bf16 + AC op": {"activation_checkpointing": "selective"},
    "trainer bf16 + compile": {"compile": True},
    "trainer bf16 + compile + AC op": {"compile": True, "activation_checkpointing": "selective"},
}


def _loop_row(kind: str, size: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    from hpservice.models import build_model

    torch.manual_seed(0)
    model = build_model("llama", "tiny", SIZES[size], device="cuda")
    if kind == "ours":
        from hpservice.dtensor import init_device_mesh
        from hpservice.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers.values()):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = SIZES[size]["vocab_size"]
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "peak_bytes": torch.cuda.max_memory_allocated()}


def _trainer_row(training: dict, size: str, batch: int, seq: int, steps: int, warmup: int, out: str) -> dict:
    import torch

    from hpservice.spec import parse_job
    from hpservice.train import Trainer

    spec = parse_job(
        {
            "name": "bench-gpu",
            "model": {"name": "llama", "flavor": "tiny", "overrides": SIZES[size]},
            "data": {"kind": "synthetic", "seq_len": seq, "global_batch": batch},
            "training": {"steps": warmup + steps, **training},
            "parallelism": {"mixed_precision": "bf16"},
            "resources": {"use_gpu": True},
            "metrics": {"dir": out, "log_every": 10_000},
        }
    )
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(spec, log_to_stdout=False)
    records = trainer.train()
    timed = records[warmup:]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_bytes": max(r["peak_memory_allocated_gib"] for r in timed) * 2**30,
        "mfu_trainer": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
    }


def run(size: str = "1b", batch: int = 4, seq: int = 2048, steps: int = 10, warmup: int = 3) -> dict:
    import tempfile

    import torch
    import torch.distributed as dist

    from hpservice.launch import free_port
    from hpservice.models import flops_per_token, model_config
    from hpservice.train._utilisation import table_peak_flops

    if not torch.cuda.is_available():
        raise SystemExit("bench gpu: no CUDA device on this machine")
    name = torch.cuda.get_device_name(0)
    peak = table_peak_flops(name, "bf16")
    flops = flops_per_token(model_config("llama", "tiny", SIZES[size]), seq)
    rows: dict[str, dict] = {}
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for kind in ("ours", "fsdp2"):
            rows[kind] = _loop_row(kind, size, batch, seq, steps, warmup)
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-gpu-") as out:
        for label, training in TRAINER_ROWS.items():
            rows[label] = _trainer_row(training, size, batch, seq, steps, warmup, out)
            torch.cuda.empty_cache()
    for row in rows.values():
        row["tokens_per_s"] = batch * seq / row["step_s"]
        row["mfu"] = row["tokens_per_s"] * flops / peak if peak else None
        row["peak_gib"] = row["peak_bytes"] / 2**30
    return {
        "device": name,
        "size": size,
        "batch": batch,
        "seq_len": seq,
        "flops_per_token": flops,
        "rows": rows,
        "ours_vs_fsdp2_step_time": rows["ours"]["step_s"] / rows["fsdp2"]["step_s"],
    }


def format_rows(r: dict) -> str:
    lines = [f"{'':34}{'step ms':>9}{'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}"]
    for label, row in r["rows"].items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        lines.append(f"{label:34}{row['step_s'] * 1e3:>9.1f}{row['tokens_per_s']:>11,.0f}{mfu:>7}{row['peak_gib']:>10.2f}")
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    r = run(args.size, args.batch, args.seq_len, args.steps, args.warmup)
    print(f"gpu: {r['device']}, llama {r['size']}, batch {r['batch']} x {r['seq_len']} tokens, bf16")
    print(format_rows(r))
    print(f"ours/fsdp2 step time: {r['ours_vs_fsdp2_step_time']:.3f}x")
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="one CUDA GPU: ours vs torch FSDP2, and the trainer with bf16 / AC / compile")
    p.add_argument("--size", choices=tuple(SIZES), default="1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)
