"""Activation-checkpointing benchmark: activation memory and tokens/s per mode, and with compile.

What is measured, for one Llama (``--flavor``, default ``small``: dim 256, 4 blocks) trained by
``hpservice.train.Trainer`` in a fresh process per configuration (world of one, so a mode's
memory is not mixed with another's), on ``--batch`` x ``--seq-len`` synthetic tokens:

- ``held MiB``: resident memory after the forward pass and the loss minus just before it (after
  ``gc.collect()`` and ``malloc_trim``): the activations autograd keeps for backward, plus the
  logits. glibc is told to serve every allocation of 64 KiB or more with its own mapping
  (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the resident set at once and the
  difference is the live memory, not the allocator's cache.
- ``peak MiB``: the largest resident memory seen during the backward pass (a thread polls
  ``/proc/self/statm``), minus the same baseline: the held activations, plus what backward
  allocates (gradients, recomputed blocks).
- ``tokens/s``: median over the timed steps (the trainer's own ``tokens_per_s``).

Expected, with L blocks: ``full`` keeps one tensor per block (its input, B x S x dim) and
recomputes a block at a time in backward, so its held memory is about L block inputs plus what
lies outside the blocks (embedding output, final norm, logits), and its backward peak adds one
block's activations to that and to what backward allocates anyway (gradients, temporaries: the
``none`` row's peak minus its held memory). One block's activations are taken from the rows
themselves: (none held - full held) / L + one block input. The bound and the measured peak are
printed side by side. Every mode trains the same
loss (the trainer's parity tests check that); this benchmark only measures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile

from hpservice.bench import _harness as h
from hpservice.launch import run_ranks

MODES = {
    "none": {},
    "selective op": {"activation_checkpointing": "selective"},
    "selective 1/2": {"activation_checkpointing": "selective", "selective_every": 2},
    "full": {"activation_checkpointing": "full"},
}
COMPILED = {"compile": {"compile": True}, "compile + op": {"compile": True, "activation_checkpointing": "selective"}}


def _measure(flavor: str, training: dict, batch: int, seq_len: int, steps: int, out: str) -> dict:
    import torch

    from hpservice.spec import parse_job
    from hpservice.train import Trainer
    from hpservice.train._loss import cross_entropy_loss

    spec = parse_job(
        {
            "name": "bench-ac",
            "model": {"name": "llama", "flavor": flavor},
            "data": {"kind": "synthetic", "seq_len": seq_len, "global_batch": batch},
            "training": {"steps": steps + 3, **training},
            "metrics": {"dir": out, "log_every": 10_000},
        }
    )
    trainer = Trainer(spec, log_to_stdout=False)
    records = [trainer.train_step() for _ in range(steps + 2)]  # warm-up (and compile) first
    sample = trainer.data(0)
    gc.collect()
    h.malloc_trim()
    before = h.rss_bytes()
    loss = cross_entropy_loss(trainer.model(sample.inputs), sample.labels)
    held = h.rss_bytes() - before
    with h.RssSampler() as sampler:
        loss.backward()
    trainer.optimizer.zero_grad()
    trainer.close()
    cfg = trainer.model.cfg
    return {
        "held_bytes": held,
        "peak_bytes": sampler.peak - before,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[2:]),
        "n_layers": cfg.n_layers,
        "block_input_bytes": batch * seq_len * cfg.dim * torch.finfo(torch.float32).bits // 8,
    }


def run(flavor: str = "small", batch: int = 8, seq_len: int = 256, steps: int = 5, compile: bool = False) -> dict:
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # read by the rank processes' glibc
    rows = {}
    configs = {**MODES, **(COMPILED if compile else {})}
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-ac-") as out:
        for name, training in configs.items():
            rows[name] = run_ranks(_measure, 1, flavor, training, batch, seq_len, steps, out, timeout=1200)[0]
    none, full = rows["none"], rows["full"]
    per_block = (none["held_bytes"] - full["held_bytes"]) / none["n_layers"] + full["block_input_bytes"]
    bound = full["held_bytes"] + per_block + none["peak_bytes"] - none["held_bytes"]
    return {
        "flavor": flavor,
        "batch": batch,
        "seq_len": seq_len,
        "rows": rows,
        "block_activation_bytes": per_block,
        # what full may reach in backward: what it holds, one block recomputed, and what backward
        # itself allocates beyond the held activations (gradients, temporaries: none's peak - held)
        "full_peak_bound_bytes": bound,
        "full_peak_within_bound": full["peak_bytes"] <= bound,
        "full_held_ratio_vs_none": full["held_bytes"] / none["held_bytes"],
        "full_tokens_per_s_ratio_vs_none": full["tokens_per_s"] / none["tokens_per_s"],
    }


def _main(args: argparse.Namespace) -> int:
    r = run(args.flavor, args.batch, args.seq_len, args.steps, args.compile)
    mib = 2**20
    print(f"ac: llama {r['flavor']}, batch {r['batch']} x {r['seq_len']} tokens, one process per row")
    print(f"{'':16}{'held MiB':>10}{'peak MiB':>10}{'tokens/s':>11}{'vs none':>9}")
    base = r["rows"]["none"]["tokens_per_s"]
    for name, row in r["rows"].items():
        print(
            f"{name:16}{row['held_bytes'] / mib:>10.1f}{row['peak_bytes'] / mib:>10.1f}"
            f"{row['tokens_per_s']:>11,.0f}{row['tokens_per_s'] / base:>8.2f}x"
        )
    print(
        f"one block's activations ~{r['block_activation_bytes'] / mib:.1f} MiB; full holds {r['full_held_ratio_vs_none']:.2f}x "
        f"of none; full's backward peak {r['rows']['full']['peak_bytes'] / mib:.1f} MiB vs bound "
        f"{r['full_peak_bound_bytes'] / mib:.1f} (held + one block + backward's own): {r['full_peak_within_bound']}"
    )
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ac", help="activation memory and tokens/s per activation-checkpointing mode (and compile)")
    p.add_argument("--flavor", default="small", help="llama flavor (default small)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--compile", action="store_true", help="also rows with training.compile (needs a C++ compiler)")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)
