"""Context-parallelism benchmark: step time and activation memory per rank against sequence length,
for cp = 1, 2, 4, side by side in one run.

For each sequence length and each ``cp``, a Llama (``--flavor``, default ``tiny``) is trained by
``hpservice.train.Trainer`` on ``cp`` gloo ranks with ``parallelism.cp`` (cp = 1: one process,
torch's own ``F.scaled_dot_product_attention``), one sequence per step:

- ``step ms``: median of the trainer's ``step_time_s`` over the timed steps (after 2 warm-up steps);
- ``held MiB/rank``: the bytes of the tensors autograd keeps for backward during one forward and
  loss on rank 0 (counted by ``saved_tensors_hooks``, each storage once): the activation memory,
  exactly, independent of the allocator. It falls as ``1/cp``: every activation of the sequence is
  split over the cp ranks, and ring attention keeps only q, k, v, its output and log-sum-exp;
- ``vs cp 1``: both as ratios to the cp = 1 row of the same length.

torch's ``context_parallel`` is the anchor this benchmark would set beside ours, but torch 2.13
has no CPU kernel for it (its ring attention runs SDPA's CPU flash kernel, for which its DTensor
has no rule; ``tests/parallel/test_context_parallel.py`` checks that this is still so), so its
column reads "n/a (no CPU kernel)" here; on CUDA it is the comparison to make.
On 2 CPU cores, cp > 2 ranks share cores: step times measure the work and the ring's
communication, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from hpservice.launch import run_ranks


def _measure(flavor: str, seq_len: int, cp: int, steps: int, out: str, rotate: str) -> dict:
    import torch
    import torch.distributed as dist

    from hpservice.spec import parse_job
    from hpservice.train import Trainer
    from hpservice.train._forward import attention, micro_batch_loss

    spec = parse_job(
        {
            "name": "bench-cp",
            "model": {"name": "llama", "flavor": flavor, "overrides": {"max_seq_len": seq_len}},
            "data": {"kind": "synthetic", "seq_len": seq_len, "global_batch": 1},
            "training": {"steps": steps + 3},
            "parallelism": {"cp": cp, "cp_rotate": rotate},
            "metrics": {"dir": out, "log_every": 10_000},
        }
    )
    trainer = Trainer(spec, log_to_stdout=False)
    records = [trainer.train_step() for _ in range(steps + 2)]
    sample = trainer.data(0)
    trainer.loss.begin(sample, global_tokens=trainer.data.global_tokens, every_label_valid=True)
    seen: set[int] = set()
    held = 0

    def pack(t):
        nonlocal held
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
        return t

    dims = trainer.parallel_dims
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), attention(sample, dims):
        loss = micro_batch_loss(trainer.model, sample, dims, trainer.loss)
    del loss
    trainer.close()
    if dist.is_initialized():
        dist.barrier()
    return {"step_s": statistics.median(r["step_time_s"] for r in records[2:]), "held_bytes": held}


def run(flavor: str = "tiny", seq_lens=(1024, 4096), cps=(1, 2, 4), steps: int = 3, rotate: str = "ring") -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-cp-") as out:
        for seq_len in seq_lens:
            base = None
            for cp in cps:
                r = run_ranks(_measure, cp, flavor, seq_len, cp, steps, out, rotate, timeout=1800)[0]
                base = base or r
                rows.append({
                    "seq_len": seq_len, "cp": cp, **r,
                    "step_ratio_vs_cp1": r["step_s"] / base["step_s"],
                    "held_ratio_vs_cp1": r["held_bytes"] / base["held_bytes"],
                })  # fmt: skip
    return {"flavor": flavor, "rotate": rotate, "rows": rows, "torch_context_parallel": "n/a (no CPU kernel in torch 2.13)"}


def _main(args: argparse.Namespace) -> int:
    r = run(args.flavor, args.seq_lens, args.cps, args.steps, args.rotate)
    mib = 2**20
    print(f"cp: llama {r['flavor']}, one sequence per step, rotate {r['rotate']}; torch's context_parallel: {r['torch_context_parallel']}")
    print(f"{'seq':>7}{'cp':>4}{'step ms':>10}{'vs cp 1':>9}{'held MiB/rank':>15}{'vs cp 1':>9}")
    for row in r["rows"]:
        print(
            f"{row['seq_len']:>7}{row['cp']:>4}{row['step_s'] * 1000:>10.1f}{row['step_ratio_vs_cp1']:>8.2f}x"
            f"{row['held_bytes'] / mib:>15.1f}{row['held_ratio_vs_cp1']:>8.2f}x"
        )
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("cp", help="context parallelism: step time and activation memory per rank vs sequence length")
    p.add_argument("--flavor", default="tiny", help="llama flavor (default tiny)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096], help="sequence lengths (default 1024 4096)")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="cp sizes (default 1 2 4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--rotate", choices=["ring", "allgather"], default="ring")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)
