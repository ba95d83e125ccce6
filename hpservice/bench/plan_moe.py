"""``python -m hpservice.bench plan --model deepseek_v3/671B --gpus 256 --ep 64``: a mixture-of-
experts model's numbers past this machine, on paper, per rank (the ``plan`` of a MoE flavor).

Layout, as the trainer builds it (``ParallelDims.expert_mesh``): ``dp_replicate x dp_shard`` data
ranks (``--tp`` x them = ``--gpus``), ``ep`` dividing ``dp_shard``; an ep group is ep consecutive
ranks, inside one node when ``ep <= gpus_per_node / tp``.

- **memory** (fp32 parameters, gradients and AdamW's two moments: 16 bytes per parameter):
  the dense parameters (attention, norms, routers, shared experts, dense layers, embedding, head)
  fully sharded over dp_shard (their tp-split ones over tp too); the routed experts: E / ep of each
  layer's per ep rank, fully sharded again over the ``dp_shard / ep`` ranks holding the same ones
  (``dp_shard_mod_ep``): in all, the experts divided by dp_shard;
- **all-to-all per step**: each sparse layer sends every (token, expert) pair whose expert lives
  on another ep rank there and back, forward and backward::

      2 x 2 x sparse layers x tokens per rank x top_k x (ep - 1) / ep x dim x param_bytes

  (uniform routing: a pair stays on its rank with probability 1 / ep), at NVLink speed when the ep
  group is inside a node, else at InfiniBand speed (``--nvlink-gbs`` / ``--ib-gbs``, per GPU);
- **fully_shard of the experts** over dp_shard_mod_ep: all-gather of a rank's E / ep experts
  forward and backward, reduce-scatter of their fp32 gradients, and with dp_replicate the
  all-reduce of each shard's gradients over the replicas (across nodes);
- **fully_shard** of the dense parameters: all-gather forward and backward, reduce-scatter of the
  gradients (ring: ``(n - 1) / n`` of the gathered bytes each), inside a node;
- tokens per rank: ``--micro-batch x --seq-len`` (one micro-batch; activations not estimated).

Assumptions: uniform routing (a real router's imbalance moves more bytes to the busiest ranks:
``bench moe`` measures it on the tiny model), links at their stated bandwidth, no overlap of
communication with compute, no dropped tokens.
"""

from __future__ import annotations

from hpservice.memory.plan import ring_bytes

_STATE_BYTES = 16  # fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq



def moe_plan(family: str, flavor: str, *, gpus: int, gpus_per_node: int, tp: int, dp_shard: int | None, ep: int,
             seq_len: int, micro_batch: int, param_bytes: int, nvlink_gbs: float, ib_gbs: float) -> dict:  # fmt: skip
    from hpservice.models import build_model, model_config
    from hpservice.models.moe import GroupedExperts

    cfg = model_config(family, flavor)
    if gpus % tp:
        raise ValueError(f"--gpus {gpus} is not a multiple of --tp {tp}")
    dp = gpus // tp
    dp_shard = dp_shard or max(1, gpus_per_node // tp)
    if dp % dp_shard or dp_shard % ep or cfg.num_experts % ep:
        raise ValueError(
            f"ep {ep} must divide dp_shard {dp_shard} (which must divide the {dp} data ranks) and the {cfg.num_experts} experts"
        )
    model = build_model(family, flavor, device="meta")
    expert_params = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    dense = total - expert_params
    tp_split = sum(  # what tensor parallelism divides: the attention's and dense layers' projections
        p.numel() for n, p in model.named_parameters() if tp > 1 and n.endswith(".weight") and ("attention.w" in n or "feed_forward.w" in n)
    )  # fmt: skip
    dense_per_rank = (dense - tp_split) / dp_shard + tp_split / (dp_shard * tp)
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.n_layers))
    tokens = micro_batch * seq_len
    a2a = 2 * 2 * sparse * tokens * cfg.experts_per_token * (ep - 1) / ep * cfg.dim * param_bytes
    ep_in_node = ep * tp <= gpus_per_node
    a2a_gbs = nvlink_gbs if ep_in_node else ib_gbs
    edp = dp // ep
    mod_ep, replicas = dp_shard // ep, dp // dp_shard
    experts_gathered = expert_params / ep  # a rank's E / ep experts, unsharded
    experts_per_rank = experts_gathered / mod_ep
    expert_fsdp = 2 * ring_bytes("all_gather", mod_ep, experts_gathered * param_bytes) + ring_bytes(
        "reduce_scatter", mod_ep, experts_gathered * 4
    )
    expert_replicas = ring_bytes("all_reduce", replicas, experts_per_rank * 4)
    gathered = (dense - tp_split) + tp_split / tp  # one rank's unsharded dense parameters (tp pieces)
    fsdp_bytes = 2 * ring_bytes("all_gather", dp_shard, gathered * param_bytes) + ring_bytes("reduce_scatter", dp_shard, gathered * 4)
    fsdp_gbs = nvlink_gbs if dp_shard * tp <= gpus_per_node else ib_gbs
    gib = 2**30
    return {
        "model": f"{family}/{flavor}",
        "layout": {"gpus": gpus, "gpus_per_node": gpus_per_node, "tp": tp, "dp_replicate": dp // dp_shard,
                   "dp_shard": dp_shard, "ep": ep, "expert_dp": edp},
        "parameters": {"total": total, "experts": expert_params, "dense": dense, "sparse_layers": sparse},
        "memory_gib": {
            "dense_state": dense_per_rank * _STATE_BYTES / gib,
            "expert_state": experts_per_rank * _STATE_BYTES / gib,
            "total_state": (dense_per_rank + experts_per_rank) * _STATE_BYTES / gib,
        },
        "all_to_all": {"bytes": a2a, "link": "nvlink" if ep_in_node else "infiniband", "seconds": a2a / (a2a_gbs * 1e9)},
        "expert_fully_shard": {"bytes": expert_fsdp, "seconds": expert_fsdp / (fsdp_gbs * 1e9)},
        "expert_replica_all_reduce": {"bytes": expert_replicas, "seconds": expert_replicas / (ib_gbs * 1e9)},
        "fully_shard": {"bytes": fsdp_bytes, "seconds": fsdp_bytes / (fsdp_gbs * 1e9)},
        "tokens_per_rank": tokens,
    }


def report(r: dict) -> str:
    lay, mem, p = r["layout"], r["memory_gib"], r["parameters"]
    a2a, efs, rep, fs = r["all_to_all"], r["expert_fully_shard"], r["expert_replica_all_reduce"], r["fully_shard"]
    return "\n".join([
        f"{r['model']} on {lay['gpus']} GPUs ({lay['gpus_per_node']} per node): tp {lay['tp']} x dp_replicate "
        f"{lay['dp_replicate']} x dp_shard {lay['dp_shard']}, ep {lay['ep']} (experts' data-parallel copies: {lay['expert_dp']})",
        f"parameters: {p['total'] / 1e9:,.1f}e9 ({p['experts'] / 1e9:,.1f}e9 routed experts in {p['sparse_layers']} sparse layers, "
        f"{p['dense'] / 1e9:,.2f}e9 the rest)",
        f"memory per rank (fp32 params, grads, AdamW): {mem['total_state']:,.1f} GiB = dense {mem['dense_state']:,.1f} "
        f"(fully sharded) + experts {mem['expert_state']:,.1f} (1/{lay['ep']} of them per ep rank, sharded over "
        f"the {lay['dp_shard'] // lay['ep']} ranks holding the same ones)",
        f"all-to-all per step ({r['tokens_per_rank']:,} tokens per rank): {a2a['bytes'] / 2**30:,.2f} GiB sent per rank, "
        f"{a2a['seconds'] * 1e3:,.1f} ms on {a2a['link']}",
        f"fully_shard of the experts: {efs['bytes'] / 2**30:,.2f} GiB per rank per step, {efs['seconds'] * 1e3:,.1f} ms; "
        f"their gradients all-reduced over {lay['dp_replicate']} replicas: {rep['bytes'] / 2**30:,.2f} GiB, "
        f"{rep['seconds'] * 1e3:,.1f} ms across nodes",
        f"fully_shard of the dense parameters: {fs['bytes'] / 2**30:,.2f} GiB per rank per step, {fs['seconds'] * 1e3:,.1f} ms",
    ])  # fmt: skip


MOE_MODELS = ("deepseek_v3/671B", "qwen3_moe/30B-A3B")
__all__ = ["MOE_MODELS", "moe_plan", "report"]
