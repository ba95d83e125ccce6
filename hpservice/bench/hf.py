"""Hugging Face import/export benchmark: ``model.init_from`` and ``hpservice export --format hf``
against transformers' own ``from_pretrained`` / ``save_pretrained`` on the same checkpoint.

What is measured, on a random Llama that transformers builds and saves here (no download):
- anchor: ``LlamaForCausalLM.from_pretrained(dir)`` in one process (wall time, peak RSS growth);
- ours: on N local ranks, building the model on meta, ``fully_shard`` per block and root, and
  ``load_hf_weights`` (every rank reads only its slices): the slowest rank's wall time and the
  largest per-rank peak RSS growth;
- export: one of our checkpoints of that model -> a Hugging Face directory (``export_hf``),
  against ``save_pretrained`` of the loaded transformers model.
The logits of ours and transformers' on a few tokens are compared (a fast wrong import is
flagged). Peak RSS is ``ru_maxrss`` (a process-lifetime high-water mark), measured in fresh
processes: transformers' growth over the load; ours, the growth over reading the weights into the
laid-out model (fully_shard's own buffers, shards + gradient and gather buffers, are reported
apart: they are the training engine's, not the import's).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from hpservice.launch import run_ranks

__all__ = ["add_parser"]

SIZES = {
    "small": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 8192},
    "base": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 32000},
}  # fmt: skip


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _make(path: str, size: str) -> int:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(max_position_embeddings=256, tie_word_embeddings=False, **SIZES[size])
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def _anchor(path: str, out: str) -> dict:
    import transformers

    before = _rss_mib()
    t = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    load_s = time.perf_counter() - t
    rss = _rss_mib() - before
    with torch.no_grad():
        logits = model(torch.arange(16).view(1, 16)).logits
    t = time.perf_counter()
    model.save_pretrained(out, max_shard_size="200MB")
    return {"load_s": load_s, "rss_mib": rss, "save_s": time.perf_counter() - t, "logits": logits}


def _ours(path: str) -> dict:
    import torch.distributed as dist

    from hpservice.dtensor import init_device_mesh
    from hpservice.fsdp import fully_shard
    from hpservice.models.hf import config_from_hf, load_hf_weights
    from hpservice.models.llama import Llama

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    start = _rss_mib()
    dist.barrier()
    t = time.perf_counter()
    with torch.device("meta"):
        model = Llama(config_from_hf(path))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.init_buffers()  # the rotary table; the weights come from the checkpoint
    laid_out = _rss_mib()  # fully_shard's own buffers (shards, gradients, gather buffers)
    load_hf_weights(model, path)
    dist.barrier()
    load_s = time.perf_counter() - t
    rss = _rss_mib() - laid_out
    with torch.no_grad():
        logits = model(torch.arange(16).view(1, 16))
    return {"load_s": load_s, "rss_mib": rss, "fsdp_mib": laid_out - start, "logits": logits}


def _export(path: str, root: str, out: str) -> float:
    from hpservice.checkpoint import CheckpointManager
    from hpservice.models.hf import config_from_hf, export_hf, load_hf_weights
    from hpservice.models.llama import Llama

    cfg = config_from_hf(path)
    model = Llama(cfg)
    load_hf_weights(model, path)
    CheckpointManager(root).save(1, model)
    t = time.perf_counter()
    export_hf(f"{root}/step-00000001", out, cfg, max_shard_bytes=200 << 20)
    return time.perf_counter() - t


def run(size: str, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/hf"
        params = run_ranks(_make, 1, src, size, timeout=600)[0]
        anchor = run_ranks(_anchor, 1, src, f"{tmp}/saved", timeout=600)[0]
        ours = run_ranks(_ours, world, src, timeout=600)
        export_s = run_ranks(_export, 1, src, f"{tmp}/ckpt", f"{tmp}/exported", timeout=600)[0]
        size_mib = sum(p.stat().st_size for p in Path(src).glob("*.safetensors")) / 2**20
    max_err = max(float((o["logits"] - anchor["logits"]).abs().max()) for o in ours)
    slowest = max(o["load_s"] for o in ours)
    largest = max(o["rss_mib"] for o in ours)
    return {
        "size": size, "params": params, "checkpoint_mib": size_mib, "world": world,
        "transformers_load_s": anchor["load_s"], "transformers_rss_mib": anchor["rss_mib"],
        "ours_load_s": slowest, "ours_rss_mib_per_rank": largest, "max_abs_logit_diff": max_err,
        "ours_fsdp_buffers_mib_per_rank": max(o["fsdp_mib"] for o in ours),
        "transformers_save_s": anchor["save_s"], "ours_export_s": export_s,
    }  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser("hf", help="Hugging Face import/export: hpservice vs transformers' from_pretrained/save_pretrained")
    p.add_argument("--size", choices=tuple(SIZES), default="base", help="model size (base: 125M parameters)")
    p.add_argument("--world-size", type=int, default=2, help="ranks that import the sharded model (default 2)")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    r = run(args.size, args.world_size)
    print(f"hf: {r['params'] / 1e6:.1f}M-parameter Llama, {r['checkpoint_mib']:.0f} MiB of safetensors")
    print(f"{'':24}{'wall s':>10}{'peak RSS +MiB':>16}")
    print(f"{'transformers load':24}{r['transformers_load_s']:>10.2f}{r['transformers_rss_mib']:>16.0f}")
    ours_row = f"{'ours, ' + str(r['world']) + ' FSDP ranks':24}{r['ours_load_s']:>10.2f}{r['ours_rss_mib_per_rank']:>16.0f}"
    print(f"{ours_row}  (per rank, reading only; fully_shard's buffers: {r['ours_fsdp_buffers_mib_per_rank']:.0f} MiB)")
    print(f"{'transformers save':24}{r['transformers_save_s']:>10.2f}")
    print(f"{'ours export (hf)':24}{r['ours_export_s']:>10.2f}")
    print(
        f"ours/transformers: load {r['ours_load_s'] / r['transformers_load_s']:.2f}x, RSS per rank "
        f"{r['ours_rss_mib_per_rank'] / max(r['transformers_rss_mib'], 1):.2f}x, export/save "
        f"{r['ours_export_s'] / r['transformers_save_s']:.2f}x; max |logit diff| {r['max_abs_logit_diff']:.1e}"
    )
    if args.json:
        print(json.dumps(r))
    return 0 if r["max_abs_logit_diff"] < 1e-4 else 1
