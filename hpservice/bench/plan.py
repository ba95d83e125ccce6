"""``python -m hpservice.bench plan``: the numbers that matter past this machine, on paper.

For a Llama flavor on ``--gpus`` GPUs (``--gpus-per-node`` each node) under a layout
(``--pp``, ``--tp``, ``--cp``, ``--dp-shard``; ``dp_replicate`` is the rest), it computes per rank
(with pipeline parallelism, for pp rank 0: the first stage, which holds the most micro-batches):

- **memory**: the sharded fp32 parameters, gradients and AdamW's two moments as fully_shard lays
  them out (each parameter's dim 0 split in ``ceil(n / (dp_shard x cp))`` rows: fully_shard shards
  over dp_shard x cp, as the trainer does; tensor parallelism's dims first); the collective
  scratch (each unit's all-gather output and reduce-scatter input: on CPU kept for every unit, on
  an accelerator freed after use); the unsharded parameters and gradients
  held at the peak (the root, which stays gathered from its forward to the end of backward, and
  two blocks); and the activations of one micro-batch (an estimate: what autograd keeps per
  block, see ``block_activation_elements``), with or without full activation checkpointing, of
  the ``seq_len / cp`` tokens of each sequence a context-parallel rank holds;
- **collectives per step** (one micro-batch): fully_shard's all-gathers (forward, and backward for
  every unit that resharded), reduce-scatters, HSDP's all-reduce over the replicas, tensor
  parallelism's per-block all-reduces, context parallelism's exchange of keys and values (per
  block: gathered around the ring in forward and again in backward, and their gradients
  reduce-scattered back); the bytes each rank sends (ring algorithms: all-gather and
  reduce-scatter send ``(n-1)/n`` of the gathered size, all-reduce twice that) and the time they
  take at the link they run on (inside a node: ``--nvlink-gbs``; across nodes: ``--ib-gbs``);
- **checkpoint**: the bytes each rank writes (parameters and optimizer state, replicas written
  once) and the time at ``--storage-gbs`` per rank;
- the largest HSDP shard group that keeps the all-gathers inside a node (``gpus_per_node / tp``);
- **pipeline** (``--pp``, ``--pp-schedule``, ``--pp-microbatches``, ``--pp-virtual-stages``): the
  stage's parameters only (its blocks, the embedding on the first stage, the norm and head on the
  last: ``pipelining.split_layers``), all of them unsharded with their gradients from the first
  backward to the last (a stage reshards and reduce-scatters after its last micro-batch); the
  schedule simulated (``pipelining.simulate``, a backward costing two forwards) for its bubble and the most micro-batches each pp rank holds at once,
  which times one micro-batch's activations of a stage is each stage's activation memory; the
  point-to-point bytes each rank sends a step (every micro-batch's activations forward and their
  gradients back, at each stage boundary the rank owns) and their time on the link between
  neighbouring stages (``gpus / pp`` ranks apart: across nodes once that is a node or more);
  fully_shard gathers the blocks it reshards after forward again in each micro-batch's forward and
  backward (``reshard_after_forward: false`` avoids that, as torchtitan does under pp; a
  zero-bubble step keeps them gathered).

The layout and byte counts are exact for hpservice's fully_shard (``tests/bench/test_bench_plan.py``
checks them against the tiny Llama on 4 CPU ranks: the tracked bytes of every rank's shards and
the bytes handed to each collective; the pipeline's numbers are the simulated schedule and
arithmetic, not measured); link times assume the stated bandwidth is reached.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from hpservice.memory.plan import ring_bytes
from hpservice.models.llama import LLAMA_FLAVORS, LlamaConfig

from .plan_moe import MOE_MODELS, moe_plan
from .plan_moe import report as moe_report

# Tensor parallelism's plan for the built-in Llama (hpservice.parallel.apply_llama_tp): the dim
# of each weight it shards. Norms stay replicated.
_TP_DIM = {
    "tok_embeddings.weight": 0,  # RowwiseParallel on an embedding: vocab rows
    "output.weight": 0,  # ColwiseParallel: vocab rows
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1,
}


@dataclass(frozen=True)
class Layout:
    gpus: int
    gpus_per_node: int
    tp: int
    dp_shard: int
    cp: int = 1
    pp: int = 1
    pp_virtual_stages: int = 1

    @property
    def dp_replicate(self) -> int:
        return self.gpus // (self.pp * self.tp * self.dp_shard * self.cp)

    @property
    def fsdp_shards(self) -> int:
        """fully_shard's group: dp_shard x cp (context-parallel ranks hold the same parameters)."""
        return self.dp_shard * self.cp

    def check(self) -> None:
        inner = self.pp * self.tp * self.dp_shard * self.cp
        if self.gpus % inner:
            raise SystemExit(f"plan: --gpus {self.gpus} is not divisible by pp x tp x dp_shard x cp = {inner}")


@dataclass(frozen=True)
class Links:
    nvlink_gbs: float  # GB/s per GPU inside a node
    ib_gbs: float  # GB/s per GPU across nodes
    storage_gbs: float  # GB/s of checkpoint writes per rank


def parameter_shapes(config: LlamaConfig, layout: Layout | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of the model (a tied head once), built on the meta device; with a
    pipelined ``layout``, only those of pp rank 0's stages."""
    import torch

    from hpservice.models.llama import Llama
    from hpservice.parallel.pipelining import split_model

    with torch.device("meta"):
        model = Llama(config)
    parts = [model]
    if layout is not None and layout.pp > 1:
        try:
            parts = [part for _, part in split_model(model, 0, layout.pp, layout.pp_virtual_stages)]
        except ValueError as e:
            raise SystemExit(f"plan: {e}") from e
    return [(name, tuple(p.shape)) for part in parts for name, p in part.named_parameters()]


def unit_of(name: str) -> str:
    """The fully_shard unit a parameter belongs to: its block (``layers.3``), else the root."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else "root"


def _tp_local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    suffix = name.split(".", 2)[2] if name.startswith("layers.") else name
    dim = _TP_DIM.get(suffix)
    if dim is None or tp == 1:
        return shape
    return shape[:dim] + (math.ceil(shape[dim] / tp),) + shape[dim + 1 :]


def _rows(n: int, shards: int, rank: int) -> tuple[int, int]:
    """(padded rows, real rows) of ``rank``'s dim-0 chunk of ``n`` rows over ``shards``."""
    chunk = math.ceil(n / shards)
    return chunk, max(0, min(chunk, n - rank * chunk))


def shard_layout(config: LlamaConfig, layout: Layout, rank: int = 0) -> dict[str, dict[str, int]]:
    """Per fully_shard unit: ``padded`` (the rank's flat shard, elements: the all-gather input),
    ``local`` (its real elements: what AdamW keeps state for) and ``unsharded`` (the padded
    gathered size, ``dp_shard x cp`` x padded: the all-gather output)."""
    units: dict[str, dict[str, int]] = {}
    for name, shape in parameter_shapes(config, layout):
        local_shape = _tp_local(name, shape, layout.tp)
        rest = math.prod(local_shape[1:])
        padded_rows, real_rows = _rows(local_shape[0], layout.fsdp_shards, rank)
        u = units.setdefault(unit_of(name), {"padded": 0, "local": 0, "unsharded": 0})
        u["padded"] += padded_rows * rest
        u["local"] += real_rows * rest
        u["unsharded"] += padded_rows * rest * layout.fsdp_shards
    return units


def block_activation_elements(config: LlamaConfig, tokens: int, tp: int) -> int:
    """What autograd keeps of one block's forward for a rank's ``tokens`` (an estimate, per
    element kind): the two norms' inputs and outputs (4h), q/k/v after rotary (h + 2 h_kv), the
    attention output (h), and SwiGLU's w1 and w3 outputs, silu's output and the product (4f).
    Everything but the norms is split by tensor parallelism (with sequence parallelism, all of it)."""
    h, f = config.dim, config.ffn_hidden_dim
    kv = config.n_kv_heads * config.head_dim
    return tokens * (4 * h + (h + 2 * kv + h + 4 * f) // tp)



def plan(
    config: LlamaConfig,
    layout: Layout,
    links: Links,
    *,
    seq_len: int,
    micro_batch: int,
    param_bytes: int = 2,
    reduce_bytes: int = 4,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    device: str = "cuda",
    pp_schedule: str = "1f1b",
    pp_microbatches: int | None = None,
) -> dict:
    """Everything the module doc lists, for rank 0 (the rank with the largest shards; with pp,
    the first stage's). ``micro_batch``: sequences per rank per micro-batch; with pp, a step
    runs ``pp_microbatches`` (default pp) of them through the stages."""
    layout.check()
    units = shard_layout(config, layout)
    blocks = [u for u in units if u != "root"]
    fp32 = 4
    padded = sum(u["padded"] for u in units.values())
    local = sum(u["local"] for u in units.values())
    unsharded = sum(u["unsharded"] for u in units.values())
    # held unsharded at the peak: the root (gathered at its pre-forward, resharded after the whole
    # backward) and two blocks (the current one and the prefetched one)
    largest_block = max((units[u]["unsharded"] for u in blocks), default=0)
    working = units["root"]["unsharded"] + 2 * largest_block
    pipeline = _pipeline(config, layout, pp_schedule, pp_microbatches) if layout.pp > 1 else None
    m = pipeline["microbatches"] if pipeline else 1
    if pipeline is not None:  # a stage reshards and reduces after its last backward: all of it gathered till then
        working = unsharded
    two_largest = sum(sorted((u["unsharded"] for u in units.values()), reverse=True)[:2])
    if seq_len % (2 * layout.cp):
        raise SystemExit(f"plan: --seq-len {seq_len} is not divisible by 2 x cp = {2 * layout.cp} (load balancing)")
    tokens = seq_len * micro_batch // layout.cp  # this rank's part of its sequences
    block_acts = block_activation_elements(config, tokens, layout.tp)
    act_bytes = param_bytes
    def stage_activations(n_blocks: int) -> int:  # one micro-batch's, through n_blocks blocks
        if activation_checkpointing:  # each block keeps its input; one block's activations while it recomputes
            return n_blocks * tokens * config.dim * act_bytes + block_acts * act_bytes
        return n_blocks * block_acts * act_bytes

    if pipeline is None:
        activations = stage_activations(len(blocks))
    else:  # the most micro-batches a rank holds at once, each through one of its stages
        per_rank = {r: pipeline["peak_microbatches"][r] * stage_activations(n) for r, n in pipeline["stage_blocks"].items()}
        pipeline["activation_bytes"] = per_rank
        activations = per_rank[0]
    memory = {
        "params": padded * fp32,  # flat_shard: fp32 shards, padded
        "grads": padded * fp32,  # grad_flat
        "optimizer": 2 * local * fp32,  # AdamW's exp_avg and exp_avg_sq, of the real elements
        # ag_out and rs_in (the gathered size in param and reduce dtype), rs_out, and ag_in when
        # mixed precision casts: on CPU fully_shard keeps every unit's allocated across steps; on
        # an accelerator it frees ag_out and rs_in after use (at most two units' at once: a bound)
        "collective_scratch": (unsharded if device == "cpu" else two_largest) * (param_bytes + reduce_bytes)
        + padded * (reduce_bytes + (param_bytes if param_bytes != fp32 else 0)),
        "unsharded_params": working * param_bytes,
        "unsharded_grads": working * param_bytes,
        "activations": activations,
        # fp32 logits and their gradient (with pp on the last stage: not rank 0's)
        "logits": 0 if pipeline else 2 * tokens * math.ceil(config.vocab_size / layout.tp) * fp32,
    }
    memory["total"] = sum(memory.values())

    shard_group = layout.fsdp_shards * layout.tp
    inside = shard_group <= layout.gpus_per_node
    kv_elements = seq_len * micro_batch * 2 * config.n_kv_heads * config.head_dim // layout.tp  # K and V
    regathered = blocks[:-1] if reshard_after_forward else []  # the last block and the root keep theirs
    gathered = unsharded * param_bytes
    # the first forward gathers every unit; the blocks resharded after forward are gathered again in
    # each backward and each later micro-batch's forward (a pipeline stage reshards after its last
    # backward only; a zero-bubble step keeps everything gathered from the first forward on)
    again = sum(units[u]["unsharded"] for u in regathered) * param_bytes
    all_gathers = gathered if pipeline and pp_schedule == "zero_bubble" else gathered + (2 * m - 1) * again
    stage_ranks = layout.gpus // layout.pp  # one stage's ranks (the whole world without pp)
    ends = 2 if pipeline is None else 1  # the embedding (first stage) and the head (last) that rank 0 holds
    collectives = {
        "fsdp_all_gather": {
            "bytes": all_gathers,
            "group": layout.fsdp_shards,
            "link": "nvlink" if inside else "ib",
            "kind": "all_gather",
        },
        "fsdp_reduce_scatter": {
            "bytes": unsharded * reduce_bytes,
            "group": layout.fsdp_shards,
            "link": "nvlink" if inside else "ib",
            "kind": "reduce_scatter",
        },
        "hsdp_all_reduce": {
            "bytes": padded * reduce_bytes,
            "group": layout.dp_replicate,
            "link": "nvlink" if stage_ranks <= layout.gpus_per_node else "ib",
            "kind": "all_reduce",
        },
        # per block 2 forward + 2 backward all-reduces of the residual stream, and one each for
        # the embedding (forward) and the head's input gradient (backward); per micro-batch
        "tp_all_reduce": {
            "bytes": m * (4 * len(blocks) + ends) * tokens * config.dim * act_bytes,
            "group": layout.tp,
            "link": "nvlink" if layout.tp <= layout.gpus_per_node else "ib",
            "kind": "all_reduce",
        },
        # per block: the whole sequence's keys and values gathered around the ring in forward and
        # again in backward, their gradients reduce-scattered back (each sends (cp-1)/cp of it)
        "cp_kv_exchange": {
            "bytes": m * 3 * len(blocks) * kv_elements * act_bytes,
            "group": layout.cp,
            "link": "nvlink" if layout.cp * layout.tp <= layout.gpus_per_node else "ib",
            "kind": "all_gather",
        },
    }
    for c in collectives.values():
        if c["group"] <= 1:
            c["bytes"] = 0
        c["sent_bytes"] = ring_bytes(c["kind"], c["group"], c["bytes"])
        bandwidth = links.nvlink_gbs if c["link"] == "nvlink" else links.ib_gbs
        c["seconds"] = c["sent_bytes"] / (bandwidth * 1e9)
    if pipeline is not None:  # activations forward, their gradients back, at each boundary rank 0 owns
        boundary = tokens * config.dim * act_bytes
        p2p = pipeline["sends_per_microbatch"] * m * boundary
        link = "nvlink" if stage_ranks < layout.gpus_per_node else "ib"
        bandwidth = links.nvlink_gbs if link == "nvlink" else links.ib_gbs
        pipeline["p2p"] = {"bytes": p2p, "link": link, "seconds": p2p / (bandwidth * 1e9)}
    checkpoint_bytes = (local * fp32 + 2 * local * fp32) / layout.dp_replicate  # replicas write their shard once
    return {
        "model": {"params": sum(math.prod(s) for _, s in parameter_shapes(config)), "n_layers": config.n_layers},
        "layout": {**asdict(layout), "dp_replicate": layout.dp_replicate, "shard_group": shard_group},
        "links": asdict(links),
        "memory_bytes": memory,
        "collectives": collectives,
        "comm_seconds_per_step": sum(c["seconds"] for c in collectives.values()) + (pipeline["p2p"]["seconds"] if pipeline else 0),
        "pipeline": pipeline,
        "checkpoint": {
            "bytes_per_rank": checkpoint_bytes,
            "total_bytes": sum(math.prod(s) for _, s in parameter_shapes(config)) * 3 * fp32,
            "save_seconds": checkpoint_bytes / (links.storage_gbs * 1e9),
        },
        "node_local_shard_size": max(1, layout.gpus_per_node // layout.tp),
        "shard_group_inside_node": inside,
    }


def _pipeline(config: LlamaConfig, layout: Layout, schedule: str, microbatches: int | None) -> dict:
    """The schedule simulated (a backward costs two forwards): its bubble, the most micro-batches
    each pp rank holds, each rank's blocks per stage, rank 0's sends per micro-batch."""
    from hpservice.parallel.pipelining import compute_order, simulate, split_layers, stage_rank, with_communication

    pp, v = layout.pp, layout.pp_virtual_stages
    m = microbatches or pp
    try:
        bounds = split_layers(config.n_layers, pp * v)
        timeline = simulate(with_communication(compute_order(schedule, pp, m, v), pp), pp)
    except ValueError as e:
        raise SystemExit(f"plan: {e}") from e
    stages = {r: [s for s in range(pp * v) if stage_rank(s, pp) == r] for r in range(pp)}
    return {
        "schedule": schedule,
        "microbatches": m,
        "virtual_stages": v,
        "bubble": timeline.bubble,
        "peak_microbatches": dict(timeline.peak_activations),
        # a rank's largest stage: what one micro-batch held there keeps
        "stage_blocks": {r: max(len(bounds[s]) for s in ss) for r, ss in stages.items()},
        "sends_per_microbatch": sum((s < pp * v - 1) + (s > 0) for s in stages[0]),
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def report(result: dict) -> str:
    lay, mem = result["layout"], result["memory_bytes"]
    lines = [
        f"model: {result['model']['params'] / 1e9:.2f}B parameters, {result['model']['n_layers']} blocks",
        f"layout: {lay['gpus']} GPUs ({lay['gpus_per_node']} per node) = "
        + (f"pp {lay['pp']} x " if lay["pp"] > 1 else "")
        + f"dp_replicate {lay['dp_replicate']} x "
        f"dp_shard {lay['dp_shard']} x cp {lay['cp']} x tp {lay['tp']}; shard group {lay['shard_group']} ranks "
        f"({'inside a node' if result['shard_group_inside_node'] else 'SPANS NODES'}); the largest HSDP shard "
        f"group inside a node: dp_shard x cp {result['node_local_shard_size']}",
        "memory per rank:",
        *(f"  {k:<16}{_gib(v):>14}" for k, v in mem.items()),
        "collectives per step (per rank):",
    ]
    for name, c in result["collectives"].items():
        lines.append(
            f"  {name:<20} {_gib(c['bytes']):>12} gathered/reduced, {_gib(c['sent_bytes']):>12} sent over "
            f"{c['group']} ranks on {c['link']}: {c['seconds'] * 1e3:,.1f} ms"
        )
    lines.append(f"  total communication {result['comm_seconds_per_step'] * 1e3:,.1f} ms per step (if none overlaps)")
    pipe = result["pipeline"]
    if pipe is not None:
        p2p = pipe["p2p"]
        lines += [
            f"pipeline: {lay['pp']} stages x {pipe['virtual_stages']} per rank, {pipe['schedule']}, "
            f"{pipe['microbatches']} micro-batches: bubble {pipe['bubble']:.1%} of the step",
            f"  point-to-point {_gib(p2p['bytes'])} sent on {p2p['link']}: {p2p['seconds'] * 1e3:,.1f} ms",
            "  activations per pp rank (micro-batches held at once): "
            + ", ".join(
                f"{r}: {_gib(b)} ({pipe['peak_microbatches'][r]})" for r, b in pipe["activation_bytes"].items()
            ),
        ]
    ck = result["checkpoint"]
    lines.append(
        f"checkpoint: {_gib(ck['total_bytes'])} in all, {_gib(ck['bytes_per_rank'])} per rank, "
        f"{ck['save_seconds']:,.1f} s per save at {result['links']['storage_gbs']:g} GB/s per rank"
    )
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="per-rank memory, collective bytes and times, checkpoint size, on paper")
    p.add_argument(
        "--model", default="8B", choices=[*sorted(LLAMA_FLAVORS), *MOE_MODELS],
        help="a built-in Llama flavor, or a mixture-of-experts family/flavor (its own plan: bench/plan_moe.py)",
    )  # fmt: skip
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (mixture-of-experts models)")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context parallelism: ranks each sequence is split over")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallelism: stages (the outermost dim)")
    p.add_argument("--pp-schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"))
    p.add_argument("--pp-microbatches", type=int, default=None, help="micro-batches per step (default pp)")
    p.add_argument("--pp-virtual-stages", type=int, default=1, help="stages per rank (interleaved_1f1b)")
    p.add_argument("--dp-shard", type=int, default=None, help="default: gpus_per_node / (tp x cp) (HSDP inside a node)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--param-bytes", type=int, default=2, help="compute dtype bytes (bf16: 2)")
    p.add_argument("--ac", choices=("none", "full"), default="none", help="activation checkpointing")
    p.add_argument(
        "--reshard-after-forward", choices=("true", "false"), default="true", help="parallelism.reshard_after_forward"
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the ranks run")
    p.add_argument("--nvlink-gbs", type=float, default=450.0, help="GB/s per GPU inside a node (H100 NVLink: 450)")
    p.add_argument("--ib-gbs", type=float, default=50.0, help="GB/s per GPU across nodes (400 Gb/s NDR: 50)")
    p.add_argument("--storage-gbs", type=float, default=2.0, help="checkpoint write GB/s per rank")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.model in MOE_MODELS:
        if args.pp > 1 or args.cp > 1:
            raise SystemExit("bench plan: a mixture-of-experts model's plan covers tp, dp and ep (ep with pp or cp is not built yet)")
        family, flavor = args.model.split("/")
        result = moe_plan(
            family, flavor, gpus=args.gpus, gpus_per_node=args.gpus_per_node, tp=args.tp, dp_shard=args.dp_shard,
            ep=args.ep, seq_len=args.seq_len, micro_batch=args.micro_batch, param_bytes=args.param_bytes,
            nvlink_gbs=args.nvlink_gbs, ib_gbs=args.ib_gbs,
        )  # fmt: skip
        print(json.dumps(result, indent=1) if args.json else moe_report(result))
        return 0
    if args.ep > 1:
        raise SystemExit(f"bench plan: --ep needs a mixture-of-experts model ({', '.join(MOE_MODELS)})")
    stage_ranks = args.gpus // args.pp
    dp_shard = args.dp_shard or max(1, min(stage_ranks, args.gpus_per_node) // (args.tp * args.cp))
    result = plan(
        LLAMA_FLAVORS[args.model],
        Layout(args.gpus, args.gpus_per_node, args.tp, dp_shard, args.cp, args.pp, args.pp_virtual_stages),
        Links(args.nvlink_gbs, args.ib_gbs, args.storage_gbs),
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        param_bytes=args.param_bytes,
        activation_checkpointing=args.ac == "full",
        reshard_after_forward=args.reshard_after_forward == "true",
        device=args.device,
        pp_schedule=args.pp_schedule,
        pp_microbatches=args.pp_microbatches,
    )
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0
