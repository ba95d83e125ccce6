"""Mixture-of-experts benchmark: a Qwen3-MoE trained by ``hpservice.train.Trainer``, side by side in
one run:

- ``grouped, 1 process``: ours, one process (the experts' rows grouped by expert, one matmul each);
- ``naive loop, 1 process``: the same model with the layer computed as transformers' reference
  does (for each expert: find its tokens with a one-hot mask, gather, compute, ``index_add``):
  the anchor a grouped implementation must beat;
- ``ep N``: ours with ``parallelism.ep = N`` on N gloo ranks (dp_shard = N), tokens exchanged with
  all-to-all.

Per row: the median step time (after warm-up steps) and its ratio to the grouped single process;
MFU as the trainer reports it, with MoE-aware FLOPs (only the active parameters: the router and
the ``experts_per_token`` experts a token reaches, ``ffn_matmul_params``); for ep, the bytes
all-to-all moved per step on rank 0 (rows sent to other ranks, forward and backward), against the
analytic count for a uniform routing::

    2 (dispatch + combine) x 2 (forward + backward) x sparse layers x tokens per rank x top_k
      x (ep - 1) / ep x dim x bytes per element

(each (token, expert) pair leaves its rank unless the expert is local, 1/ep of them under uniform
routing). The measured/analytic ratio is above 1 when the routing sends more than its share away.

On 2 CPU cores ep ranks share the cores: the ep row measures the work and the exchange, not a
speed-up; on GPUs it is the row to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from hpservice.launch import run_ranks


def _spec(out: str, size: dict, steps: int, ep: int):
    from hpservice.spec import parse_job

    return parse_job({
        "name": "bench-moe",
        "model": {"name": "qwen3_moe", "flavor": "tiny", "overrides": size["model"]},
        "data": {"kind": "synthetic", "seq_len": size["seq_len"], "global_batch": size["batch"]},
        "training": {"steps": steps},
        "parallelism": {"ep": ep} if ep > 1 else {},
        "metrics": {"dir": out, "log_every": 10_000},
    })  # fmt: skip


def _naive_forward(self, x):
    """transformers' reference computation of a MoE layer (``Qwen3MoeExperts.forward``)."""
    import torch
    import torch.nn.functional as F

    B, S, D = x.shape
    tokens = x.reshape(-1, D)
    weights, experts, _ = self.router(tokens, self.expert_bias)
    self.tokens_per_expert += torch.bincount(experts.flatten(), minlength=self.num_experts).float()
    out = torch.zeros_like(tokens)
    mask = F.one_hot(experts, self.num_experts).permute(2, 1, 0)  # [E, k, T]
    e = self.experts
    for i in range(self.num_experts):
        slot, token = torch.where(mask[i])
        if token.numel() == 0:
            continue
        rows = tokens[token]
        h = F.linear(F.silu(F.linear(rows, e.w1[i])) * F.linear(rows, e.w3[i]), e.w2[i])
        out.index_add_(0, token, h * weights[token, slot, None])
    return out.view(B, S, D)


def _measure(out: str, size: dict, steps: int, warmup: int, ep: int, naive: bool) -> dict:
    import torch.distributed as dist

    from hpservice.models import moe
    from hpservice.parallel import expert_parallel
    from hpservice.train import Trainer

    if naive:
        moe.MoE.forward = _naive_forward
    sent = [0]
    original = expert_parallel.dist.all_to_all_single

    def counting(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        if input_split_sizes is not None and tensor.ndim == 2:  # rows, not the counts
            me = dist.get_rank(group)
            away = sum(n for r, n in enumerate(input_split_sizes) if r != me)
            sent[0] += away * tensor.shape[1] * tensor.element_size()
        return original(output, tensor, output_split_sizes, input_split_sizes, group=group, **kw)

    expert_parallel.dist.all_to_all_single = counting
    try:
        trainer = Trainer(_spec(out, size, steps + warmup, ep), log_to_stdout=False)
        records = [trainer.train_step() for _ in range(warmup)]
        sent[0] = 0
        records += [trainer.train_step() for _ in range(steps)]
        trainer.close()
    finally:
        expert_parallel.dist.all_to_all_single = original
    timed = records[warmup:]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if timed[-1].get("mfu") is not None else None,
        "loss": timed[-1]["loss"],
        "all_to_all_bytes_per_step": sent[0] / steps,
        "imbalance": timed[-1]["expert_imbalance"],
    }


SIZES = {
    "tiny": {"model": {}, "seq_len": 64, "batch": 8},
    "small": {
        "model": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "attn_head_dim": 32, "hidden_dim": 512,
                  "num_experts": 8, "experts_per_token": 2, "moe_hidden_dim": 256, "max_seq_len": 256},
        "seq_len": 256,
        "batch": 8,
    },
}  # fmt: skip


def analytic_all_to_all_bytes(size: dict, ep: int) -> float:
    """Bytes one rank sends to others per step under uniform routing (see the module doc)."""
    from hpservice.models import model_config

    cfg = model_config("qwen3_moe", "tiny", size["model"])
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.n_layers))
    tokens = size["batch"] // ep * size["seq_len"]
    return 2 * 2 * sparse * tokens * cfg.experts_per_token * (ep - 1) / ep * cfg.dim * 4


def run(size_name: str = "small", ep: int = 2, steps: int = 5, warmup: int = 2) -> dict:
    size = SIZES[size_name]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-moe-") as out:
        for name, world, naive in (("grouped, 1 process", 1, False), ("naive loop, 1 process", 1, True), (f"ep {ep}", ep, False)):
            r = run_ranks(_measure, world, out, size, steps, warmup, world, naive, timeout=1800)[0]
            rows.append({"config": name, **r})
    base = rows[0]["step_s"]
    for row in rows:
        row["step_ratio"] = row["step_s"] / base
    analytic = analytic_all_to_all_bytes(size, ep)
    rows[-1]["all_to_all_analytic_bytes"] = analytic
    rows[-1]["all_to_all_ratio"] = rows[-1]["all_to_all_bytes_per_step"] / analytic
    return {"size": size_name, "ep": ep, "rows": rows}


def _main(args: argparse.Namespace) -> int:
    r = run(args.size, args.ep, args.steps, args.warmup)
    print(f"moe: qwen3_moe {r['size']} ({SIZES[r['size']]['model'] or 'tiny flavor'}), ratios to the grouped single process")
    print(f"{'config':<24}{'step ms':>10}{'ratio':>8}{'MFU':>8}{'loss':>9}{'busiest':>9}{'a2a MiB/step':>14}{'analytic':>10}")
    for row in r["rows"]:
        a2a = row.get("all_to_all_analytic_bytes")
        mfu = f"{row['mfu']:.2%}" if row["mfu"] is not None else "-"
        print(
            f"{row['config']:<24}{row['step_s'] * 1000:>10.1f}{row['step_ratio']:>7.2f}x{mfu:>8}{row['loss']:>9.4f}"
            f"{row['imbalance']:>8.2f}x"
            + (f"{row['all_to_all_bytes_per_step'] / 2**20:>14.2f}{a2a / 2**20:>10.2f}" if a2a else f"{'-':>14}{'-':>10}")
        )
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("moe", help="mixture of experts: grouped vs naive per-expert loop vs expert parallelism")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks of the ep row (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)
