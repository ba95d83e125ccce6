"""Checkpoint benchmark: training time blocked by a save, sync vs async, and a resharding load.

What is measured, for a Llama of ``--size`` (``base``: about 134M parameters, AdamW, fp32) built by
the trainer itself (``hpservice.train.Trainer``: FSDP over ``--world-size`` gloo ranks) after one
training step, so the optimizer holds its two moments:

- ``sync``: ``CheckpointManager.save`` with ``async_save=False``: the whole write and commit
  (DCP shard files, each rank's trainer state, the manifest with every file's sha256, the atomic
  rename) happens on the training thread. Blocked time = the call's duration, slowest rank.
- ``async``: ``async_save=True``: the training thread builds the state dicts and copies them to
  CPU memory ("staging"); a background thread writes and commits. Blocked time = the ``save``
  call's duration, slowest rank; the background write is reported beside it (``wait()`` after it).
  While it runs, nothing else happens here: on a busy trainer the write also competes for CPU.
- ``load 2 -> 1``: one fresh process (world of one, no sharding) loads the last async checkpoint
  written by the ranks: verify every file's checksum, read and reshard the DCP shards into the
  model and optimizer. Wall time of ``load``.

Saves alternate sync/async ``--repeats`` times each; medians are reported. The first async save
also allocates the staging buffers that later saves reuse (reported on its own).
``async_blocking_ratio`` = async blocked / sync blocked (DCP's published async save blocks 23x
less than its sync save, i.e. a ratio of about 0.04; the goal here is <= 0.1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from hpservice.launch import run_ranks

SIZES = {
    "base": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "vocab_size": 32000, "hidden_dim": 2048},
    "tiny": {},  # tests
}


def _spec(size: str, out: Path, device: str):
    from hpservice.spec import parse_job

    return parse_job(
        {
            "name": "bench-checkpoint",
            "model": {"name": "llama", "flavor": "tiny", "overrides": SIZES[size]},
            "data": {"kind": "synthetic", "seq_len": 32, "global_batch": 2},
            "training": {"steps": 1},
            "resources": {"use_gpu": device == "cuda"},
            "parallelism": {"mixed_precision": "bf16" if device == "cuda" else "none"},
            "metrics": {"dir": str(out / "runs"), "log_every": 1000},
        }
    )


def _save_rank(size: str, out: str, repeats: int, device: str = "cpu") -> dict:
    import torch.distributed as dist

    from hpservice.checkpoint import CheckpointManager
    from hpservice.train import Trainer

    trainer = Trainer(_spec(size, Path(out), device), log_to_stdout=False)
    trainer.train_step()
    managers = {
        "sync": CheckpointManager(Path(out) / "sync", keep=1),
        "async": CheckpointManager(Path(out) / "async", keep=1, async_save=True),
    }
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    background: list[float] = []
    for i in range(repeats):
        for kind in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
            dist.barrier()
            t0 = time.perf_counter()
            managers[kind].save(i + 1, trainer.model, trainer.optimizer, {"step": i + 1})
            blocked[kind].append(time.perf_counter() - t0)
            if kind == "async":
                managers[kind].wait()
                background.append(time.perf_counter() - t0)
    for m in managers.values():
        m.close()
    params = sum(p.numel() for p in trainer.model.parameters())  # DTensor numel is the global one
    trainer.close()
    return {"blocked": blocked, "background": background, "params": params}


def _load_rank(size: str, out: str, device: str = "cpu") -> float:
    from hpservice.checkpoint import CheckpointManager
    from hpservice.train import Trainer

    trainer = Trainer(_spec(size, Path(out) / "load", device), log_to_stdout=False)
    t0 = time.perf_counter()
    CheckpointManager(Path(out) / "async", keep=1).load(trainer.model, trainer.optimizer)
    elapsed = time.perf_counter() - t0
    trainer.close()
    return elapsed


def run(size: str = "base", world: int = 2, repeats: int = 3, device: str = "cpu") -> dict:
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-ckpt-") as out:
        if device == "cuda":  # one GPU: one process here, with its own NCCL world of one
            ranks = [_save_rank(size, out, repeats, device)]
            load_s = _load_rank(size, out, device)
        else:
            ranks = run_ranks(_save_rank, world, size, out, repeats, timeout=1800)
            load_s = run_ranks(_load_rank, 1, size, out, timeout=1800)[0]
        size_bytes = sum(p.stat().st_size for p in (Path(out) / "async").rglob("*") if p.is_file())

    def slowest_median(kind: str) -> float:  # per repeat the slowest rank, then the median
        return statistics.median(max(r["blocked"][kind][i] for r in ranks) for i in range(repeats))

    sync_s, async_s = slowest_median("sync"), slowest_median("async")
    return {
        "params": ranks[0]["params"],
        "world_size": len(ranks),
        "device": device,
        "checkpoint_mib": size_bytes / 2**20,
        "sync_save_s": sync_s,
        "async_blocked_s": async_s,
        "async_first_blocked_s": max(r["blocked"]["async"][0] for r in ranks),  # allocates the staging buffers
        "async_background_s": statistics.median(max(r["background"][i] for r in ranks) for i in range(repeats)),
        "async_blocking_ratio": async_s / sync_s,
        "load_reshard_s": load_s,
        "repeats": repeats,
    }


def _main(args: argparse.Namespace) -> int:
    if args.device == "cuda" and args.world_size != 1:
        args.world_size = 1  # one GPU per process and this benchmark uses one machine's GPU
    r = run(args.size, args.world_size, args.repeats, args.device)
    print(
        f"checkpoint: llama {r['params'] / 1e6:.0f}M parameters + AdamW, {r['world_size']} FSDP ranks ({r['device']}), "
        f"{r['checkpoint_mib']:.0f} MiB per checkpoint, median of {r['repeats']} saves each"
    )
    print(f"{'':30}{'seconds':>10}")
    print(f"{'sync save (blocked)':30}{r['sync_save_s']:>10.2f}")
    print(f"{'async save (blocked)':30}{r['async_blocked_s']:>10.2f}")
    print(f"{'  first async save (blocked)':30}{r['async_first_blocked_s']:>10.2f}  (allocates the reused staging buffers)")
    print(f"{'async save (background total)':30}{r['async_background_s']:>10.2f}")
    load_label = f"load, resharded {r['world_size']} -> 1"
    print(f"{load_label:30}{r['load_reshard_s']:>10.2f}")
    print(f"async/sync blocked time: {r['async_blocking_ratio']:.3f}x (goal <= 0.1; DCP's published ~0.04)")
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="training time blocked per save (sync vs async) and a 2 -> 1 resharding load")
    p.add_argument("--size", choices=tuple(SIZES), default="base", help="model size (base: ~134M parameters)")
    p.add_argument("--world-size", type=int, default=2, help="FSDP ranks that save (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind, alternating (default 3)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU, bf16, world of one")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)
